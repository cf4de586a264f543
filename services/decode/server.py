"""The Decode gRPC service over one vLLM engine (`kv_consumer`)."""
from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc

from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.worker.engine import VllmEngine, sampling_from_proto
from services.worker.validation import check_prompt
from transfer.connector import request_params_for_decode

log = logging.getLogger("pdserve.decode")

_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "abort": common_pb2.FINISH_REASON_ABORT}


class DecodeService(decode_pb2_grpc.DecodeServicer):
    """Streams a request's tokens; its KV comes from a prefill worker or is computed here."""

    def __init__(self, engine: VllmEngine, worker_id: str):
        self.engine = engine
        self.worker_id = worker_id
        self.vocab_size = engine.llm.model_config.get_vocab_size()

    async def Decode(self, request, context):
        generated = list(request.generated_token_ids)
        ids = list(request.prompt_token_ids) + generated
        await check_prompt(context, ids, self.engine.cfg.max_model_len, self.vocab_size,
                           request.sampling)
        if generated and request.sampling.max_tokens <= len(generated):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "generated_token_ids already reach sampling.max_tokens")
        # Resumption recomputes prompt + generated tokens; a handle only covers the prompt.
        params = None
        if request.HasField("kv") and not generated:
            try:
                params = request_params_for_decode(json.loads(request.kv.params_json))
            except (ValueError, TypeError):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "kv.params_json is not JSON")
        rid = request.request_id or f"decode-{time.monotonic_ns()}"
        sampling = sampling_from_proto(request.sampling,
                                       max_tokens=request.sampling.max_tokens - len(generated),
                                       kv_transfer_params=params)
        start = time.perf_counter()
        n = 0
        try:
            async for chunk in self._chunks(rid, ids, sampling, params):
                n += len(chunk.token_ids)
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            # The caller went away; vLLM aborts the request and frees its blocks
            # as the cancellation passes through AsyncLLM.generate.
            log.info("decode %s cancelled after %d tokens; aborted on the engine", rid, n)
            raise
        log.info("decode %s: prompt %d tokens (kv %s), %d generated, %.1f ms", rid, len(ids),
                 "remote" if params else "local", n, (time.perf_counter() - start) * 1000)

    async def _chunks(self, rid, ids, sampling, params):
        """The engine's steps as wire chunks; KV provenance rides on the first."""
        first = True
        async for step in self.engine.generate(rid, ids, sampling):
            chunk = decode_pb2.DecodeChunk(token_ids=step.token_ids, text=step.text,
                                           worker_id=self.worker_id)
            if first:
                chunk.num_prompt_tokens = step.num_prompt_tokens
                chunk.num_cached_tokens = step.num_cached_tokens
                chunk.num_external_tokens = step.num_cached_tokens if params else 0
                first = False
            if step.finished:
                chunk.finish_reason = _FINISH.get(step.finish_reason or "",
                                                  common_pb2.FINISH_REASON_STOP)
                chunk.stop_reason = step.stop_reason or ""
            yield chunk


def add_to_server(servicer: DecodeService, server: grpc.aio.Server) -> None:
    """Register the Decode service on a gRPC server."""
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
