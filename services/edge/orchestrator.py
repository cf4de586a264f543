"""One request's trip through the cluster: Route -> prefill -> decode.

Workers speak vLLM's engine protocol (`vllm.grpc.engine.VllmEngine`): the
prefill leg is a `Generate` with `max_tokens=1` that leaves the prompt's KV
blocks for a decoder and returns their `kv_transfer_params_json`; the decode
leg is a streaming `Generate` carrying those params, whose connector pulls the
blocks. `start()` does everything that can still fail cleanly (routing,
prefill), so the HTTP layer knows the outcome and the path before it sends
headers; the returned `GenerationStream` then yields text chunks. A prefill
that fails does not fail the request: the decode worker prefills locally
instead (path "local").
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from pdserve.rpc import channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, transfer_pb2, transfer_pb2_grpc

from .detokenizer import StopRule, TextStream
from .engine_requests import decode_request, prefill_request
from .openai_protocol import APIError

log = logging.getLogger("pdserve.edge")


@dataclass(slots=True)
class Generation:
    """What the edge asks the cluster to generate (already tokenized and validated)."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    session_id: str = ""


@dataclass(slots=True)
class Chunk:
    """A piece of one request's output, as the edge relays it."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None            # "stop" | "length" | "abort" on the last


@dataclass(slots=True)
class GenerationStream:
    """A placed request: its path is known; iterate `chunks()` for tokens and text."""

    gen: Generation
    path: str                                   # "disaggregated" | "local"
    decode_worker: str
    decode_stub: vllm_engine_pb2_grpc.VllmEngineStub
    prefill_params: dict[str, Any] | None       # the prefill's kv_transfer_params
    text: TextStream
    timeout: float
    prefill_address: str = ""                   # where the lease on those blocks lives
    leases: transfer_pb2_grpc.KVTransferStub | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None         # perf_counter() when the first token arrived
    stats: dict = field(default_factory=dict)
    aborts: set = field(default_factory=set)    # in-flight Abort calls (kept referenced)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Chunks in order; leaving early cancels the call and aborts the request."""
        req = decode_request(self.gen.request_id, self.gen.prompt_token_ids, self.gen.sampling,
                             self.prefill_params, self.prefill_address)
        call = self.decode_stub.Generate(req, timeout=self.timeout)
        try:
            async for resp in call:
                if resp.HasField("chunk"):
                    c = resp.chunk
                    if c.token_ids and self.first_token_at is None:
                        self.first_token_at = time.perf_counter()
                        self._first_chunk(c.cached_tokens)
                    self.completion_tokens += len(c.token_ids)
                    text = self.text.add(c.token_ids)
                    if self.text.stop_string is not None:
                        # The edge saw the stop string first: end here.
                        self.finish_reason = "stop"
                        yield Chunk(list(c.token_ids), text, "stop")
                        return
                    if text or c.token_ids:
                        yield Chunk(list(c.token_ids), text)
                else:
                    self.finish_reason = resp.complete.finish_reason or "stop"
                    yield Chunk([], self.text.finish(), self.finish_reason)
                    return
        except grpc.aio.AioRpcError as e:
            raise _api_error(e, f"decode worker {self.decode_worker}") from e
        finally:
            call.cancel()                       # a no-op once the call has ended
            if self.finish_reason is None:
                self._abort()
            self.close()

    def _first_chunk(self, cached_tokens: int) -> None:
        """The decode engine's first output says whether the KV travelled: a pull
        leaves all but the last prompt token cached. Less means the decode worker
        prefilled itself (it refused a lease that was gone, or the pull failed)."""
        pulled = (self.prefill_params is not None
                  and cached_tokens >= len(self.gen.prompt_token_ids) - 1)
        if self.prefill_params is not None and not pulled:
            self.path = "local"
            self.stats["pull_refused"] = True
            log.warning("request %s: the decode worker %s prefilled locally (%d tokens "
                        "cached); the prefill's KV was not used", self.gen.request_id,
                        self.decode_worker, cached_tokens)
        self.stats.update(decode_cached_tokens=cached_tokens,
                          decode_external_tokens=cached_tokens if pulled else 0)

    def close(self) -> None:
        """End the prefill's lease if the decode never got to pull it (the request
        ended first): its blocks are freed now, not when the lease runs out."""
        if self.leases is None or (self.first_token_at is not None
                                   and not self.stats.get("pull_refused")):
            return
        leases, self.leases = self.leases, None
        lease = (self.prefill_params or {}).get("remote_request_id")
        if lease:
            in_background(leases.Abort(transfer_pb2.LeaseRequest(
                lease_id=lease, reason=f"request {self.gen.request_id} ended before its "
                                       "decode"), timeout=2.0), self.aborts)

    def _abort(self) -> None:
        """Tell the decode worker to drop the request (cancelling the call does too;
        this also reaches an engine whose servicer missed the cancellation)."""
        in_background(self.decode_stub.Abort(
            vllm_engine_pb2.AbortRequest(request_ids=[self.gen.request_id]), timeout=2.0),
            self.aborts)


def in_background(call, running: set) -> None:
    """Run a fire-and-forget call (an Abort): kept referenced in `running` until it
    ends, its failure swallowed (the worker may be gone; nothing waits on it)."""
    task = asyncio.ensure_future(call)
    running.add(task)
    task.add_done_callback(lambda t: (running.discard(t), t.cancelled() or t.exception()))


def _api_error(e: grpc.aio.AioRpcError, who: str) -> APIError:
    """A worker's gRPC status as the error the client sees (mapped once, here)."""
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, e.details() or "invalid request")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return APIError(429, "the server is overloaded; retry later", type="server_overloaded")
    log.warning("%s failed: %s %s", who, code.name, e.details())
    return APIError(503, f"{who} is unavailable ({code.name})", type="service_unavailable")


def _stop_rule(tokenizer, s: common_pb2.SamplingParams) -> StopRule:
    """What ends generation besides max_tokens: stop strings, stop ids, EOS."""
    ids = set(s.stop_token_ids)
    if not s.ignore_eos and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return StopRule(stop=tuple(s.stop), stop_token_ids=frozenset(ids))


class Orchestrator:
    """Places requests and holds one channel per worker address."""

    def __init__(self, router_address: str, request_timeout: float, tokenizer):
        self.router_channel = channel(router_address)
        self.router = router_pb2_grpc.RouterStub(self.router_channel)
        self.timeout = request_timeout
        self.tokenizer = tokenizer
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.prefill_fallbacks = 0
        self._aborts: set[asyncio.Future] = set()

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = channel(address)
        return self._channels[address]

    def _engine(self, address: str) -> vllm_engine_pb2_grpc.VllmEngineStub:
        return vllm_engine_pb2_grpc.VllmEngineStub(self._channel(address))

    def _leases(self, address: str) -> transfer_pb2_grpc.KVTransferStub:
        return transfer_pb2_grpc.KVTransferStub(self._channel(address))

    async def workers(self) -> list[router_pb2.WorkerInfo]:
        """Every worker the router knows, with liveness."""
        resp = await self.router.ListWorkers(router_pb2.ListWorkersRequest(), timeout=2.0)
        return list(resp.workers)

    async def start(self, gen: Generation) -> GenerationStream:
        """Route and prefill; raises APIError when no worker can take the request."""
        try:
            decision = await self.router.Route(router_pb2.RouteRequest(
                request_id=gen.request_id, session_id=gen.session_id, model=gen.model,
                prompt_tokens=len(gen.prompt_token_ids), prompt_token_ids=gen.prompt_token_ids),
                timeout=5.0)
        except grpc.aio.AioRpcError as e:
            raise _api_error(e, "router") from e
        params, stats = None, {"placement": decision.reason.split(":")[0],
                               "cached_tokens": decision.cached_tokens}
        if not decision.local_prefill:
            try:
                params, leg = await self._prefill(gen, decision.prefill)
            except asyncio.CancelledError:
                # The client left while the prefill ran: it may have finished on the
                # worker and leased its blocks, under our request id. End that lease now.
                self._abort_lease(decision.prefill.address, gen.request_id)
                raise
            stats.update(leg)
        path = "disaggregated" if params is not None else "local"
        log.info("request %s: path=%s decode=%s prefill=%s (%s)", gen.request_id, path,
                 decision.decode.worker_id, decision.prefill.worker_id or "-", decision.reason)
        prefill_address = decision.prefill.address if params is not None else ""
        return GenerationStream(
            gen=gen, path=path, decode_worker=decision.decode.worker_id,
            decode_stub=self._engine(decision.decode.address), prefill_params=params,
            prefill_address=prefill_address,
            leases=self._leases(prefill_address) if prefill_address else None,
            text=TextStream(self.tokenizer, gen.prompt_token_ids,
                            _stop_rule(self.tokenizer, gen.sampling)),
            timeout=self.timeout, stats=stats)

    async def _prefill(self, gen: Generation, worker: router_pb2.WorkerInfo
                       ) -> tuple[dict[str, Any] | None, dict]:
        """The prefill leg; None (and local prefill) when it fails for any reason but
        bad input."""
        stub = self._engine(worker.address)
        started = time.perf_counter()
        try:
            params = None
            async for resp in stub.Generate(prefill_request(gen.request_id, gen.prompt_token_ids,
                                                            gen.sampling), timeout=self.timeout):
                if resp.HasField("complete") and resp.complete.HasField("kv_transfer_params_json"):
                    params = json.loads(resp.complete.kv_transfer_params_json)
            if not params or not params.get("remote_block_ids"):
                raise ValueError("the prefill returned no KV blocks to hand over")
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise _api_error(e, f"prefill worker {worker.worker_id}") from e
            return self._fall_back(worker, f"{e.code().name}: {e.details()}")
        except ValueError as e:
            return self._fall_back(worker, str(e))
        return params, {"prefill_worker": worker.worker_id,
                        "prefill_ms": (time.perf_counter() - started) * 1000}

    def _abort_lease(self, address: str, lease_id: str) -> None:
        in_background(self._leases(address).Abort(transfer_pb2.LeaseRequest(
            lease_id=lease_id, reason="client gone during prefill"), timeout=2.0), self._aborts)

    def _fall_back(self, worker: router_pb2.WorkerInfo, why: str) -> tuple[None, dict]:
        # NOTE: a failed prefill degrades to local prefill, never to an error.
        self.prefill_fallbacks += 1
        log.warning("prefill on %s failed (%s); prefilling locally", worker.worker_id, why)
        return None, {"prefill_fallback": True}

    async def close(self) -> None:
        """Close every channel."""
        for ch in [self.router_channel, *self._channels.values()]:
            await ch.close()
