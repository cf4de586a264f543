"""pdserve's sampling settings as vLLM engine-protocol requests (`vllm.grpc.engine`).

The edge keeps one sampling form (pdserve's `SamplingParams`, which its
`Inference` API carries); this is the one place it becomes the worker
protocol's `GenerateRequest`: the prefill leg (`max_tokens=1`, keep the
blocks for a decoder) and the decode leg (pull them, or prefill locally).
"""
from __future__ import annotations

from typing import Any

from smg_grpc_proto import vllm_engine_pb2

from pdserve import telemetry
from pdserve.cache_salt import METADATA_KEY
from pdserve.v1 import common_pb2
from pdserve.transfer.params import (computed_tokens, encode, request_params_for_decode,
                             request_params_for_prefill)

_INT32 = 2**31


def _seed32(seed: int) -> int:
    """The protocol's seed is int32; a wider seed folds into it (same seed, same draw)."""
    return seed if -_INT32 <= seed < _INT32 else (seed + _INT32) % (2 * _INT32) - _INT32


def engine_sampling(p: common_pb2.SamplingParams, *, max_tokens: int,
                    prefill: bool = False) -> vllm_engine_pb2.SamplingParams:
    """Engine sampling params. `prefill`: for a prefill's one token, which needs no stop
    strings (no detokenizing), no logprobs and no grammar (its token goes to the client
    only when none is asked for: `continues_from_prefill_token`)."""
    s = vllm_engine_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p or 1.0, top_k=max(p.top_k, 0),
        max_tokens=max_tokens, stop=[] if prefill else list(p.stop),
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        min_p=p.min_p, min_tokens=min(p.min_tokens, max_tokens), logit_bias=dict(p.logit_bias),
        include_stop_str_in_output=p.include_stop_str_in_output,
        # vLLM's own defaults (the protocol's zero values are the opposite).
        skip_special_tokens=True, spaces_between_special_tokens=True)
    if p.HasField("seed"):
        s.seed = _seed32(p.seed)
    if prefill:
        return s
    if p.HasField("logprobs"):
        s.logprobs = p.logprobs
    if p.HasField("prompt_logprobs"):
        s.prompt_logprobs = p.prompt_logprobs
    kind = p.WhichOneof("constraint")
    if kind == "choice":
        s.choice.choices.extend(p.choice.choices)
    elif kind is not None:
        setattr(s, kind, getattr(p, kind))
    return s


def call_metadata(cache_salt: str) -> list[tuple[str, str]] | None:
    """A worker call's metadata: the trace context and the request's cache salt (which
    vLLM's protocol has no field for), on every leg: prefill, decode, moved, resumed."""
    metadata = list(telemetry.metadata() or ())
    if cache_salt:
        metadata.append((METADATA_KEY, cache_salt))
    return metadata or None


def constrained(p: common_pb2.SamplingParams) -> bool:
    """Whether a grammar holds the output: its state lives in the engine, so a leg cannot
    go on after tokens another engine made (a prefill's, a failed worker's)."""
    return p.WhichOneof("constraint") is not None


def prefill_request(request_id: str, prompt_ids: list[int],
                    sampling: common_pb2.SamplingParams) -> vllm_engine_pb2.GenerateRequest:
    """Compute the prompt's KV and one token; the engine keeps the blocks for a decoder."""
    return vllm_engine_pb2.GenerateRequest(
        request_id=request_id, tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt_ids),
        sampling_params=engine_sampling(sampling, max_tokens=1, prefill=True), stream=False,
        kv_transfer_params_json=encode(request_params_for_prefill()))


def continues_from_prefill_token(sampling: common_pb2.SamplingParams,
                                 prefill_params: dict[str, Any]) -> bool:
    """Whether a decode leg may go on from the prompt plus the token its prefill sampled
    (which the client then gets at once) and be what one engine would generate: the
    prefill says how many tokens it computed (`remote_num_tokens`, which the decode
    worker's connector loads no more than), and the sampling does not tell the token
    apart from the prompt. Greedy always qualifies; with sampling, a seed (the decode
    engine's generator would start one draw late) and presence/frequency penalties
    (they count output tokens only; vLLM's repetition penalty counts the prompt too)
    do not. Nor does a request that asks for logprobs or prompt logprobs (the prefill's
    token has none) or holds the output to a grammar (the decode engine's would start
    over)."""
    if sampling.HasField("logprobs") or sampling.HasField("prompt_logprobs") \
            or constrained(sampling):
        return False
    if computed_tokens(prefill_params) is None:
        return False
    if sampling.temperature == 0:
        return True
    return (not sampling.HasField("seed") and sampling.presence_penalty == 0
            and sampling.frequency_penalty == 0)


def decode_request(request_id: str, prompt_ids: list[int], sampling: common_pb2.SamplingParams,
                   prefill_params: dict[str, Any] | None, prefill_address: str = "",
                   fresh: bool = False) -> vllm_engine_pb2.GenerateRequest:
    """Stream the request's tokens; its KV is pulled when `prefill_params` names blocks
    (after the decode worker claims their lease at `prefill_address`, unless `fresh`:
    see transfer/claim.py)."""
    req = vllm_engine_pb2.GenerateRequest(
        request_id=request_id, tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt_ids),
        sampling_params=engine_sampling(sampling, max_tokens=sampling.max_tokens), stream=True)
    if prefill_params:
        req.kv_transfer_params_json = encode(
            request_params_for_decode(prefill_params, prefill_address, fresh))
    return req
