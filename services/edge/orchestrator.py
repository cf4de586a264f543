"""One request's trip through the cluster: Route -> Prefill -> Decode.

`start()` does everything that can still fail cleanly (routing, prefill), so
the HTTP layer knows the outcome and the path before it sends headers; the
returned `GenerationStream` then yields the decode worker's token chunks.
A prefill that fails does not fail the request: the decode worker prefills
locally instead (path "local").
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from pdserve.rpc import channel
from pdserve.v1 import (common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2,
                        prefill_pb2_grpc, router_pb2, router_pb2_grpc)

from .openai_protocol import APIError

log = logging.getLogger("pdserve.edge")

FINISH_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                common_pb2.FINISH_REASON_ABORT: "abort"}


@dataclass(slots=True)
class Generation:
    """What the edge asks the cluster to generate (already tokenized and validated)."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    session_id: str = ""


@dataclass(slots=True)
class GenerationStream:
    """A placed request: its path is known; iterate `chunks()` for tokens."""

    gen: Generation
    path: str                                   # "disaggregated" | "local"
    decode_worker: str
    decode_stub: decode_pb2_grpc.DecodeStub
    kv: common_pb2.KVHandle | None
    timeout: float
    completion_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None         # perf_counter() when the first token arrived
    stats: dict = field(default_factory=dict)

    async def chunks(self) -> AsyncIterator[decode_pb2.DecodeChunk]:
        """Decode chunks in order; leaving early cancels the call (frees the blocks)."""
        req = decode_pb2.DecodeRequest(request_id=self.gen.request_id,
                                       prompt_token_ids=self.gen.prompt_token_ids,
                                       sampling=self.gen.sampling, kv=self.kv)
        call = self.decode_stub.Decode(req, timeout=self.timeout)
        try:
            async for chunk in call:
                if chunk.num_prompt_tokens:
                    self.stats.update(decode_cached_tokens=chunk.num_cached_tokens,
                                      decode_external_tokens=chunk.num_external_tokens)
                if chunk.token_ids and self.first_token_at is None:
                    self.first_token_at = time.perf_counter()
                self.completion_tokens += len(chunk.token_ids)
                if chunk.finish_reason:
                    self.finish_reason = FINISH_NAMES.get(chunk.finish_reason, "stop")
                yield chunk
        except grpc.aio.AioRpcError as e:
            raise _api_error(e, f"decode worker {self.decode_worker}") from e
        finally:
            call.cancel()


def _api_error(e: grpc.aio.AioRpcError, who: str) -> APIError:
    """A worker's gRPC status as the error the client sees (mapped once, here)."""
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, e.details() or "invalid request")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return APIError(429, "the server is overloaded; retry later", type="server_overloaded")
    log.warning("%s failed: %s %s", who, code.name, e.details())
    return APIError(503, f"{who} is unavailable ({code.name})", type="service_unavailable")


class Orchestrator:
    """Places requests and holds one channel per worker address."""

    def __init__(self, router_address: str, request_timeout: float):
        self.router_channel = channel(router_address)
        self.router = router_pb2_grpc.RouterStub(self.router_channel)
        self.timeout = request_timeout
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.prefill_fallbacks = 0

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = channel(address)
        return self._channels[address]

    async def workers(self) -> list[router_pb2.WorkerInfo]:
        """Every worker the router knows, with liveness."""
        resp = await self.router.ListWorkers(router_pb2.ListWorkersRequest(), timeout=2.0)
        return list(resp.workers)

    async def start(self, gen: Generation) -> GenerationStream:
        """Route and prefill; raises APIError when no worker can take the request."""
        try:
            decision = await self.router.Route(router_pb2.RouteRequest(
                request_id=gen.request_id, session_id=gen.session_id, model=gen.model,
                prompt_tokens=len(gen.prompt_token_ids)), timeout=5.0)
        except grpc.aio.AioRpcError as e:
            raise _api_error(e, "router") from e
        kv, stats = None, {}
        if not decision.local_prefill:
            kv, stats = await self._prefill(gen, decision.prefill)
        path = "disaggregated" if kv is not None else "local"
        log.info("request %s: path=%s decode=%s prefill=%s (%s)", gen.request_id, path,
                 decision.decode.worker_id, decision.prefill.worker_id or "-", decision.reason)
        return GenerationStream(
            gen=gen, path=path, decode_worker=decision.decode.worker_id,
            decode_stub=decode_pb2_grpc.DecodeStub(self._channel(decision.decode.address)),
            kv=kv, timeout=self.timeout, stats=stats)

    async def _prefill(self, gen: Generation, worker: router_pb2.WorkerInfo
                       ) -> tuple[common_pb2.KVHandle | None, dict]:
        stub = prefill_pb2_grpc.PrefillStub(self._channel(worker.address))
        started = time.perf_counter()
        try:
            resp = await stub.Prefill(prefill_pb2.PrefillRequest(
                request_id=gen.request_id, prompt_token_ids=gen.prompt_token_ids,
                sampling=gen.sampling), timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise _api_error(e, f"prefill worker {worker.worker_id}") from e
            # NOTE: a failed prefill degrades to local prefill, never to an error.
            self.prefill_fallbacks += 1
            log.warning("prefill on %s failed (%s: %s); prefilling locally", worker.worker_id,
                        e.code().name, e.details())
            return None, {"prefill_fallback": True}
        return resp.kv, {"prefill_worker": resp.worker_id, "first_token_id": resp.first_token_id,
                         "prefill_ms": (time.perf_counter() - started) * 1000}

    async def close(self) -> None:
        """Close every channel."""
        for ch in [self.router_channel, *self._channels.values()]:
            await ch.close()
