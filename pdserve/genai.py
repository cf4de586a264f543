"""OpenTelemetry GenAI semantic conventions, in one place: the attributes pdserve
sets on a generation's spans and the span name "{operation} {model}".

The names come from the semantic-conventions package, never spelled here.
"""
from __future__ import annotations

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as ga

PROVIDER = "pdserve"
OPERATIONS = {"chat": ga.GenAiOperationNameValues.CHAT.value,
              "completion": ga.GenAiOperationNameValues.TEXT_COMPLETION.value}


def span_name(kind: str, model: str) -> str:
    """"chat my-model", "text_completion my-model"."""
    return f"{OPERATIONS.get(kind, kind)} {model}"


def request_attributes(kind: str, model: str, prompt_tokens: int, sampling,
                       stream: bool | None = None) -> dict:
    """What is known when a generation starts (`sampling`: pdserve's SamplingParams)."""
    attrs = {ga.GEN_AI_OPERATION_NAME: OPERATIONS.get(kind, kind),
             ga.GEN_AI_PROVIDER_NAME: PROVIDER,
             ga.GEN_AI_REQUEST_MODEL: model,
             ga.GEN_AI_USAGE_INPUT_TOKENS: prompt_tokens,
             ga.GEN_AI_REQUEST_MAX_TOKENS: sampling.max_tokens,
             ga.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature,
             ga.GEN_AI_REQUEST_TOP_P: sampling.top_p}
    if sampling.HasField("seed"):
        attrs[ga.GEN_AI_REQUEST_SEED] = sampling.seed
    if stream is not None:
        attrs[ga.GEN_AI_REQUEST_STREAM] = stream
    return attrs


def response_attributes(response_id: str, model: str, output_tokens: int,
                        finish_reason: str | None) -> dict:
    """What is known when it ends."""
    attrs = {ga.GEN_AI_RESPONSE_ID: response_id, ga.GEN_AI_RESPONSE_MODEL: model,
             ga.GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens}
    if finish_reason:
        attrs[ga.GEN_AI_RESPONSE_FINISH_REASONS] = [finish_reason]
    return attrs


def usage_attributes(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    """A worker's share: the tokens its engine saw, computed and reused."""
    return {ga.GEN_AI_USAGE_INPUT_TOKENS: prompt_tokens,
            ga.GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
            ga.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: cached_tokens}
