"""One request's trip through the cluster: Route -> prefill -> decode.

Workers speak vLLM's engine protocol (`vllm.grpc.engine.VllmEngine`): the
prefill leg is a `Generate` with `max_tokens=1` that leaves the prompt's KV
blocks for a decoder and returns their `kv_transfer_params_json`; the decode
leg is a streaming `Generate` carrying those params, whose connector pulls the
blocks. `start()` does everything that can still fail cleanly (routing,
prefill), so the HTTP layer knows the outcome and the path before it sends
headers; the returned `GenerationStream` (generation.py) then yields text
chunks, and moves to another decode worker if its own fails.

A prefill that fails (the worker is gone, refuses, or takes longer than
`prefill_timeout`) is aborted there and tried on another prefill worker; after
`prefill_attempts` the decode worker prefills locally instead (path "local").
The client never sees a prefill failure, only a later first token. Every call
runs against the request's own deadline.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from pdserve import telemetry
from pdserve.config import DECODE_WINDOW_BYTES
from pdserve.rpc import channel
from pdserve.v1 import router_pb2, transfer_pb2, transfer_pb2_grpc
from services.router.keystore import packed
from transfer.params import REMOTE_BLOCK_IDS, check_prefill_answer, decode

from .batched import BATCH_FROM, BatchedCalls
from .batched import SERVICE_NAME as BATCHED_SERVICE
from .detokenizer import StopRule, TextStream
from .engine_requests import continues_from_prefill_token, prefill_request
from .generation import (DecodeLeg, Generation, GenerationStream, Heard, Resilience, api_error,
                         in_background)
from .route_calls import RouteCalls

log = logging.getLogger("pdserve.edge")


def _stop_rule(tokenizer, s) -> StopRule:
    """What ends generation besides max_tokens: stop strings, stop ids, EOS."""
    ids = set(s.stop_token_ids)
    if not s.ignore_eos and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return StopRule(stop=tuple(s.stop), stop_token_ids=frozenset(ids),
                    include_stop=s.include_stop_str_in_output)


class Orchestrator:
    """Places requests and holds one channel per worker address."""

    def __init__(self, router_address: str, request_timeout: float, tokenizer,
                 resilience: Resilience = Resilience(), batched: bool = False,
                 batch_from: int = BATCH_FROM, router=None,
                 first_token_from_prefill: bool = True,
                 worker_window: int = DECODE_WINDOW_BYTES):
        # `router`: the same calls answered in this process (services/router/local.py);
        # else the router's, each Route a message on one open call (route_calls.py).
        self.router_channel = None if router else channel(router_address)
        self.router = router or RouteCalls(self.router_channel)
        self.timeout = request_timeout
        self.tokenizer = tokenizer
        self.resilience = resilience
        self.heard = Heard()                # decode workers' last output, for stall checks
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.worker_window = worker_window  # each worker call's receive window (rpc.channel)
        # A stub builds a callable per method: one per worker and service, not one per
        # request (a new stub for each request was ~5% of the edge's CPU at 1,000 starts/s).
        self._stubs: dict[tuple[type, str], Any] = {}
        # --decode-calls batched: one shared call per decode worker that offers it.
        self.batched, self.batch_from = batched, batch_from
        # --first-token prefill: the client gets the prefill's token when it answers.
        self.first_token_from_prefill = first_token_from_prefill
        self._batched: dict[str, BatchedCalls | None] = {}
        self._probes: dict[str, asyncio.Future] = {}
        self.prefill_fallbacks = 0          # requests prefilled locally after prefill failed
        self.prefill_failovers = 0          # prefill legs retried on another worker
        self._aborts: set[asyncio.Future] = set()

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = channel(address, self.worker_window)
        return self._channels[address]

    def _stub(self, cls: type, address: str):
        stub = self._stubs.get((cls, address))
        if stub is None:
            stub = self._stubs[cls, address] = cls(self._channel(address))
        return stub

    def _engine(self, address: str) -> vllm_engine_pb2_grpc.VllmEngineStub:
        return self._stub(vllm_engine_pb2_grpc.VllmEngineStub, address)

    async def _decode_calls(self, address: str) -> BatchedCalls | None:
        """The worker's shared call when batched decode calls are on and it serves
        them (asked once, by gRPC health); None: a `Generate` call per leg."""
        if not self.batched or address in self._batched:
            return self._batched.get(address)
        probe = self._probes.get(address)
        if probe is None:                       # one question per worker, however many ask
            probe = self._probes[address] = asyncio.ensure_future(self._offers_batched(address))
            probe.add_done_callback(lambda _: self._probes.pop(address, None))
        serving = await asyncio.shield(probe)
        if serving is not None and address not in self._batched:
            self._batched[address] = (BatchedCalls(self._channel(address), self.batch_from)
                                      if serving else None)
            log.info("decode worker %s: %s decode calls", address,
                     "batched" if serving else "per-request")
        return self._batched.get(address)

    async def _offers_batched(self, address: str) -> bool | None:
        """Whether the worker serves BatchedGenerate (None: it did not answer)."""
        try:
            resp = await health_pb2_grpc.HealthStub(self._channel(address)).Check(
                health_pb2.HealthCheckRequest(service=BATCHED_SERVICE), timeout=1.0)
        except grpc.aio.AioRpcError as e:
            # NOT_FOUND: it serves health but not this; UNIMPLEMENTED: no health at all.
            no = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED)
            return False if e.code() in no else None
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def _leases(self, address: str) -> transfer_pb2_grpc.KVTransferStub:
        return self._stub(transfer_pb2_grpc.KVTransferStub, address)

    async def workers(self) -> list[router_pb2.WorkerInfo]:
        """Every worker the router knows, with liveness."""
        resp = await self.router.ListWorkers(router_pb2.ListWorkersRequest(), timeout=2.0)
        return list(resp.workers)

    async def pool(self, edge_id: str, admitted: int) -> router_pb2.ListWorkersResponse:
        """The workers, and what the other edges have admitted, for this edge's count
        of its own (services/router/edges.py)."""
        return await self.router.ListWorkers(router_pb2.ListWorkersRequest(
            edge_id=edge_id, admitted=admitted), timeout=2.0)

    async def start(self, gen: Generation) -> GenerationStream:
        """Route and prefill; raises APIError when no worker can take the request."""
        if not gen.deadline:
            gen.deadline = time.monotonic() + self.timeout
        leg, stats = await self.place(gen, gen.request_id, gen.prompt_token_ids, set())
        path = "disaggregated" if leg.prefill_params is not None else "local"
        log.info("request %s: path=%s decode=%s prefill=%s (%s)", gen.request_id, path,
                 leg.worker_id, stats.get("prefill_worker", "-"), stats["reason"])
        return GenerationStream(
            gen=gen, path=path, leg=leg, place=self.place, resilience=self.resilience,
            heard=self.heard,
            text=TextStream(self.tokenizer, gen.prompt_token_ids,
                            _stop_rule(self.tokenizer, gen.sampling)), stats=stats)

    async def place(self, gen: Generation, request_id: str, prompt: list[int],
                    exclude: set[str]) -> tuple[DecodeLeg, dict]:
        """A decode leg for `prompt` (the request's, or a moved generation's prompt plus
        its output so far), never on a worker in `exclude`: prefilled on a prefill
        worker (the next one when one fails), else locally."""
        decision = await self._route(gen, request_id, prompt, exclude)
        stats: dict = {"placement": decision.reason.split(":")[0], "reason": decision.reason,
                       "cached_tokens": decision.cached_tokens}
        failed = 0
        # Prompt logprobs come from the engine that computes the prompt: the decode's.
        remote = not decision.local_prefill and not gen.sampling.HasField("prompt_logprobs")
        while remote and not decision.local_prefill:
            params, token, leg = await self._prefill(gen, request_id, prompt, decision.prefill)
            if params is not None:
                stats.update(leg)
                address = decision.prefill.address
                prefilled_at = time.monotonic()
                # The prefill's token goes to the client now when the decode worker can
                # go on after it (engine_requests.continues_from_prefill_token).
                if not (self.first_token_from_prefill and decision.decode.continues_prefill
                        and continues_from_prefill_token(gen.sampling, params)):
                    token = None
                return DecodeLeg(request_id, decision.decode.worker_id,
                                 self._engine(decision.decode.address), params, address,
                                 self._leases(address), prefilled_at, self._channel(address),
                                 calls=await self._decode_calls(decision.decode.address),
                                 first_token=token), stats
            failed += 1
            if failed >= self.resilience.prefill_attempts:
                break
            self.prefill_failovers += 1
            stats["prefill_failovers"] = stats.get("prefill_failovers", 0) + 1
            exclude = exclude | {decision.prefill.worker_id}
            decision = await self._route(gen, request_id, prompt, exclude)
        if failed:
            # NOTE: a failed prefill degrades to local prefill, never to an error.
            self.prefill_fallbacks += 1
            stats["prefill_fallback"] = True
        return DecodeLeg(request_id, decision.decode.worker_id,
                         self._engine(decision.decode.address),
                         calls=await self._decode_calls(decision.decode.address)), stats

    async def _route(self, gen: Generation, request_id: str, prompt: list[int],
                     exclude: set[str]) -> router_pb2.RouteDecision:
        span = telemetry.span("route", attributes={"pdserve.request.id": request_id,
                                                   "pdserve.prompt_tokens": len(prompt)})
        try:
            with telemetry.current(span):
                decision = await self.router.Route(router_pb2.RouteRequest(
                    request_id=request_id, session_id=gen.session_id, model=gen.model,
                    prompt_tokens=len(prompt), prompt_token_ids_packed=packed(prompt),
                    exclude_workers=sorted(exclude)), timeout=min(5.0, gen.remaining()))
        except BaseException as e:
            telemetry.end(span, e)
            if isinstance(e, grpc.aio.AioRpcError):
                raise api_error(e, "router") from e
            raise
        telemetry.end(span, pdserve__route__reason=decision.reason,
                      pdserve__route__decode=decision.decode.worker_id,
                      pdserve__route__prefill=decision.prefill.worker_id,
                      pdserve__route__cached_tokens=decision.cached_tokens)
        return decision

    async def _prefill(self, gen: Generation, request_id: str, prompt: list[int],
                       worker: router_pb2.WorkerInfo
                       ) -> tuple[dict[str, Any] | None, int | None, dict]:
        """The prefill leg, traced as one span (the worker's call its child)."""
        span = telemetry.span("prefill", attributes={"pdserve.worker.id": worker.worker_id,
                                                     "pdserve.request.id": request_id})
        try:
            with telemetry.current(span):
                params, token, leg = await self._prefill_leg(gen, request_id, prompt, worker)
        except BaseException as e:
            telemetry.end(span, e)
            raise
        telemetry.end(span, None if params else "failed: tried elsewhere",
                      pdserve__kv__blocks=len((params or {}).get(REMOTE_BLOCK_IDS) or ()))
        return params, token, leg

    async def _prefill_leg(self, gen: Generation, request_id: str, prompt: list[int],
                           worker: router_pb2.WorkerInfo
                           ) -> tuple[dict[str, Any] | None, int | None, dict]:
        """The prefill leg: the KV handover's params, the token the prefill sampled (None
        if it sent none), and the leg's stats; (None, None, {}) when it fails for any
        reason but bad input or the request's own deadline (then it is aborted on the
        worker)."""
        stub = self._engine(worker.address)
        started = time.perf_counter()
        budget = gen.remaining()
        token, cached = None, 0
        try:
            params = None
            call = stub.Generate(prefill_request(request_id, prompt, gen.sampling),
                                 timeout=min(self.resilience.prefill_timeout, budget),
                                 metadata=telemetry.metadata())
            while params is None:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    break
                if resp.HasField("complete") and resp.complete.HasField("kv_transfer_params_json"):
                    params = decode(resp.complete.kv_transfer_params_json)
                    if len(resp.complete.output_ids) == 1:
                        token = resp.complete.output_ids[0]
                    cached = resp.complete.cached_tokens
            if params is not None:
                # The answer is in: the decode starts now. The call's status follows
                # the worker's own bookkeeping after its last message; it is read in
                # the background (the call must stay referenced until it ends).
                in_background(call.code(), self._aborts)
            check_prefill_answer(params or {})
        except asyncio.CancelledError:
            # The client left while the prefill ran: it may have finished on the
            # worker and leased its blocks, under this request id. End both now.
            self._abort_prefill(worker, request_id, "client gone during prefill")
            raise
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise api_error(e, f"prefill worker {worker.worker_id}") from e
            self._abort_prefill(worker, request_id, f"prefill failed: {e.code().name}")
            gen.remaining()                 # the request's own budget ran out: 504
            log.warning("prefill of %s on %s failed (%s: %s)", request_id, worker.worker_id,
                        e.code().name, e.details())
            return None, None, {}
        except ValueError as e:
            log.warning("prefill of %s on %s failed (%s)", request_id, worker.worker_id, e)
            return None, None, {}
        return params, token, {"prefill_worker": worker.worker_id, "prefill_cached_tokens": cached,
                               "prefill_ms": (time.perf_counter() - started) * 1000}

    def _abort_prefill(self, worker: router_pb2.WorkerInfo, request_id: str, why: str) -> None:
        """Drop a prefill leg that will not be used: the engine's request (it may still
        run there) and the lease on its blocks (it may have finished)."""
        in_background(self._engine(worker.address).Abort(
            vllm_engine_pb2.AbortRequest(request_ids=[request_id]), timeout=2.0), self._aborts)
        in_background(self._leases(worker.address).Abort(transfer_pb2.LeaseRequest(
            lease_id=request_id, reason=why), timeout=2.0), self._aborts)

    async def close(self) -> None:
        """Close every shared call and channel."""
        if isinstance(self.router, RouteCalls):
            await self.router.close()
        for calls in self._batched.values():
            if calls is not None:
                await calls.close()
        for ch in [self.router_channel, *self._channels.values()]:
            if ch is not None:
                await ch.close()
