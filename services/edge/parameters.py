"""Which request parameters the edge knows, and the structured ones it reads.

Every parameter of OpenAI's chat and completions APIs and of vLLM's extensions
is either honoured or refused with a 400 naming it; a parameter nobody knows
is refused too, never ignored (an answer that looks right and is not is the
worst outcome). `DEFAULT_ONLY` are those honoured only at their default value
(the value changes nothing, any other would need what pdserve does not do).
docs/openai-parameters.md is the table, side by side with vLLM's server.
"""
from __future__ import annotations

import json
import math
from typing import Any

COMMON = frozenset({
    "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "temperature", "top_p",
    "user", "response_format", "best_of",
    # vLLM's extensions
    "top_k", "min_p", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "truncate_prompt_tokens", "structured_outputs",
    "skip_special_tokens", "spaces_between_special_tokens", "use_beam_search",
    "length_penalty", "priority", "add_special_tokens", "cache_salt",
    # pdserve's: the session key (placement)
    "session_id",
})
CHAT = COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "modalities", "store", "metadata", "service_tier",
}
COMPLETION = COMMON | {"prompt", "echo", "suffix"}

# name -> the only accepted value (None: absent is the only value).
DEFAULT_ONLY: dict[str, Any] = {
    "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "use_beam_search": False, "length_penalty": 1.0, "priority": 0, "store": False,
    "suffix": None, "metadata": None, "modalities": ["text"], "service_tier": "auto",
}
MAX_CACHE_SALT_BYTES = 256                            # a client's `cache_salt`
MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}       # OpenAI's limits


class Refused(ValueError):
    """A parameter the edge does not honour (its name, and why)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def check_known(kind: str, body: dict) -> None:
    """Refuse any parameter this edge does not know, and any default-only one that is
    not at its default."""
    known = CHAT if kind == "chat" else COMPLETION
    for key, value in body.items():
        if value is None:
            continue                    # null is absent: SDKs send unset fields so
        if key not in known:
            raise Refused(key, f"'{key}' is not a supported parameter of this endpoint")
        if key in DEFAULT_ONLY and value != DEFAULT_ONLY[key]:
            raise Refused(key, f"'{key}' is supported only at its default "
                               f"({json.dumps(DEFAULT_ONLY[key])})")


def logit_bias(value: Any, vocab_limit: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} map, biases in [-100, 100]."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise Refused("logit_bias", "'logit_bias' must be an object of token id -> bias")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) <= vocab_limit):
            raise Refused("logit_bias", f"'logit_bias' key {key!r} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not math.isfinite(bias) or not -100 <= bias <= 100:
            raise Refused("logit_bias", f"'logit_bias' values must be numbers in [-100, 100], "
                                        f"got {bias!r} for {key}")
        out.append((int(key), float(bias)))
    return tuple(out)


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise Refused(param, f"'{param}' is not valid JSON") from None
    if not isinstance(schema, dict):
        raise Refused(param, f"'{param}' must be a JSON schema object")
    return json.dumps(schema)


def response_format(value: Any) -> tuple[str, Any] | None:
    """OpenAI's response_format as an engine constraint: (kind, value) or None."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise Refused("response_format.json_schema",
                          "'response_format.json_schema' must be an object with a 'name'")
        if spec.get("schema") is None:
            return ("json_object", True)        # a schema-less json_schema: any JSON object
        return ("json_schema", _schema_text(spec["schema"], "response_format.json_schema.schema"))
    raise Refused("response_format.type", "'response_format.type' must be one of "
                                          "'text', 'json_object', 'json_schema'")


_STRUCTURED = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def structured_outputs(value: Any) -> tuple[str, Any] | None:
    """vLLM's `structured_outputs` extension: exactly one of its constraints."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Refused("structured_outputs", "'structured_outputs' must be an object")
    for key in value:
        if key not in _STRUCTURED:
            raise Refused(f"structured_outputs.{key}",
                          f"'structured_outputs.{key}' is not supported")
    given = [k for k in _STRUCTURED if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise Refused("structured_outputs", "'structured_outputs' takes exactly one of "
                                            f"{list(_STRUCTURED)}")
    key, item = given[0], value[given[0]]
    param = f"structured_outputs.{key}"
    if key == "json":
        return ("json_schema", _schema_text(item, param))
    if key == "json_object":
        if item is not True:
            raise Refused(param, f"'{param}' must be true")
        return ("json_object", True)
    if key == "choice":
        if not (isinstance(item, list) and item and all(isinstance(c, str) for c in item)):
            raise Refused(param, f"'{param}' must be a non-empty list of strings")
        return ("choice", tuple(item))
    if not isinstance(item, str) or not item:
        raise Refused(param, f"'{param}' must be a non-empty string")
    return (key, item)
