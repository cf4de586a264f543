"""Calls to a worker over vLLM's engine protocol, shared by the e2e tests."""
from __future__ import annotations

import json

from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import common_pb2

from support import metric_sum


def generate(stub, rid: str, ids: list[int], max_tokens: int, kv: dict | str | None = None):
    """(output token ids, the Complete message) of one streamed Generate."""
    sampling = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    req = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids),
                             sampling_params=sampling, stream=True)
    if kv is not None:
        req.kv_transfer_params_json = kv if isinstance(kv, str) else json.dumps(kv)
    tokens, complete = [], None
    for resp in stub.Generate(req, timeout=120):
        if resp.HasField("chunk"):
            tokens += resp.chunk.token_ids
        else:
            complete = resp.complete
    return tokens, complete


def external_kv_tokens(stack) -> float:
    """vLLM's count of prompt tokens the decode engine took over KV transfer."""
    return metric_sum(stack.decode_metrics, "vllm:prompt_tokens_by_source_total",
                      'source="external_kv_transfer"')


def flush_prefix_cache(*stubs) -> None:
    """Empty the engines' prefix caches: what follows computes or pulls every block."""
    for stub in stubs:
        assert stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10), timeout=15).success
