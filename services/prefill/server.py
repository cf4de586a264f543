"""The Prefill gRPC service over one vLLM engine (`kv_producer`)."""
from __future__ import annotations

import json
import logging
import time

import grpc

from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.worker.engine import VllmEngine, sampling_from_proto
from services.worker.validation import check_prompt
from transfer.connector import request_params_for_prefill

log = logging.getLogger("pdserve.prefill")


def _flat(block_ids) -> list[int]:
    """vLLM reports block ids per KV-cache group; the handle lists them flat."""
    out: list[int] = []
    for b in block_ids or []:
        out.extend(_flat(b) if isinstance(b, (list, tuple)) else [int(b)])
    return out


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    """Runs the prompt with max_tokens=1 and returns the first token + KV handle."""

    def __init__(self, engine: VllmEngine, worker_id: str):
        self.engine = engine
        self.worker_id = worker_id
        self.vocab_size = engine.llm.model_config.get_vocab_size()
        self.lease_seconds = engine.llm.vllm_config.kv_transfer_config.get_from_extra_config(
            "kv_lease_duration", 30)

    async def Prefill(self, request, context):
        ids = list(request.prompt_token_ids)
        await check_prompt(context, ids, self.engine.cfg.max_model_len, self.vocab_size,
                           request.sampling)
        rid = request.request_id or f"prefill-{time.monotonic_ns()}"
        sampling = sampling_from_proto(request.sampling, max_tokens=1,
                                       kv_transfer_params=request_params_for_prefill())
        start = time.perf_counter()
        last = None
        first_token = None
        async for step in self.engine.generate(rid, ids, sampling):
            if first_token is None and step.token_ids:
                first_token = step.token_ids[0]
            last = step
        params = last.kv_transfer_params if last else None
        if first_token is None or not params or not params.get("remote_block_ids"):
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"prefill of {rid} produced no KV blocks to hand over")
        log.info("prefill %s: %d tokens, %d blocks, %.1f ms", rid, len(ids),
                 len(_flat(params["remote_block_ids"])), (time.perf_counter() - start) * 1000)
        handle = common_pb2.KVHandle(
            connector="nixl", engine_id=str(params.get("remote_engine_id", "")),
            block_ids=_flat(params["remote_block_ids"]), lease_id=rid,
            lease_expires_unix_ms=int((time.time() + self.lease_seconds) * 1000),
            params_json=json.dumps(params), num_tokens=int(params.get("remote_num_tokens") or 0))
        return prefill_pb2.PrefillResponse(first_token_id=first_token, kv=handle,
                                           worker_id=self.worker_id, num_prompt_tokens=len(ids),
                                           num_cached_tokens=last.num_cached_tokens)


def add_to_server(servicer: PrefillService, server: grpc.aio.Server) -> None:
    """Register the Prefill service on a gRPC server."""
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
