"""One request's trip through the cluster: Route -> prefill -> decode.

Workers speak vLLM's engine protocol (`vllm.grpc.engine.VllmEngine`): the
prefill leg is a `Generate` with `max_tokens=1` that leaves the prompt's KV
blocks for a decoder and returns their `kv_transfer_params_json`; the decode
leg is a streaming `Generate` carrying those params, whose connector pulls the
blocks. `start()` does everything that can still fail cleanly (routing,
prefill), so the HTTP layer knows the outcome and the path before it sends
headers; the returned `GenerationStream` (generation_stream.py) then yields
text chunks, and moves to another decode worker if its own fails.

A prefill that fails (the worker is gone, refuses, or takes longer than
`prefill_timeout_seconds`) is aborted there and tried on another prefill
worker; after `prefill_attempts` the decode worker prefills locally instead
(path "local"). Every setting comes from the edge's `EdgeConfig`.
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
from opentelemetry.trace import INVALID_SPAN, Span
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from pdserve import routers, telemetry
from pdserve.config import EdgeConfig
from pdserve.rpc import channel
from pdserve.v1 import router_pb2, transfer_pb2, transfer_pb2_grpc
from pdserve.services.router.keystore import packed
from pdserve.transfer.params import REMOTE_BLOCK_IDS, check_prefill_answer, decode

from .batched import BATCH_FROM, BatchedCalls
from .batched import SERVICE_NAME as BATCHED_SERVICE
from .detokenizer import StopRule, TextStream
from .engine_requests import call_metadata, continues_from_prefill_token, prefill_request
from .generation import Generation, api_error
from .generation_stream import GenerationStream
from .leg import DecodeLeg, Heard, in_background
from .route_calls import RouteCalls
from .stats import GenerationStats, Placed

log = logging.getLogger("pdserve.edge")


def _stop_rule(tokenizer, s) -> StopRule:
    """What ends generation besides max_tokens: stop strings, stop ids, EOS."""
    ids = set(s.stop_token_ids)
    if not s.ignore_eos and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return StopRule(stop=tuple(s.stop), stop_token_ids=frozenset(ids),
                    include_stop=s.include_stop_str_in_output)


class Orchestrator:
    """Places requests and holds one channel per worker address. Its settings are the
    edge's config (`cfg`); `router`: the router's calls answered in this process
    (services/router/local.py), else each Route is a message on one open call to
    `cfg.router` (route_calls.py); `batch_from`: see batched.py."""

    def __init__(self, cfg: EdgeConfig, tokenizer, router=None, batch_from: int = BATCH_FROM):
        self.cfg = cfg
        self.router_channel = None if router else channel(routers.channel_target(cfg.router))
        self.router = router or RouteCalls(self.router_channel)
        self.tokenizer = tokenizer
        self.heard = Heard()                # decode workers' last output, for stall checks
        self._channels: dict[str, grpc.aio.Channel] = {}
        # A stub builds a callable per method: one per worker and service, not one per
        # request (a new stub for each request was ~5% of the edge's CPU at 1,000 starts/s).
        self._stubs: dict[tuple[type, str], Any] = {}
        self.batch_from = batch_from
        self._batched: dict[str, BatchedCalls | None] = {}
        self._probes: dict[str, asyncio.Future] = {}
        self.prefill_fallbacks = 0          # requests prefilled locally after prefill failed
        self.prefill_failovers = 0          # prefill legs retried on another worker
        self._aborts: set[asyncio.Future] = set()

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = channel(address, self.cfg.decode_window_bytes)
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
        if self.cfg.decode_calls != "batched" or address in self._batched:
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

    async def pool(self, edge_id: str, admitted: int) -> router_pb2.ListWorkersResponse:
        """The workers, and what the other edges have admitted, for this edge's count
        of its own (services/router/edges.py)."""
        return await self.router.ListWorkers(router_pb2.ListWorkersRequest(
            edge_id=edge_id, admitted=admitted), timeout=2.0)

    async def start(self, gen: Generation, span: Span = INVALID_SPAN) -> GenerationStream:
        """Route and prefill; raises APIError when no worker can take the request.
        `span`: the generation's trace span, its legs' parent."""
        if not gen.deadline:
            gen.deadline = time.monotonic() + self.cfg.request_timeout_seconds
        leg, placed = await self.place(gen, gen.request_id, gen.prompt_token_ids, set())
        path = "disaggregated" if leg.prefill_params is not None else "local"
        log.info("request %s: path=%s decode=%s prefill=%s (%s)", gen.request_id, path,
                 leg.worker_id, placed.prefill_worker or "-", placed.reason)
        text = TextStream(self.tokenizer, gen.prompt_token_ids,
                          _stop_rule(self.tokenizer, gen.sampling))
        return GenerationStream(gen, leg, text, GenerationStats(placed, path), self.cfg,
                                place=self.place, heard=self.heard, aborts=self._aborts,
                                span=span)

    async def place(self, gen: Generation, request_id: str, prompt: list[int],
                    exclude: set[str]) -> tuple[DecodeLeg, Placed]:
        """A decode leg for `prompt` (the request's, or a moved generation's prompt plus
        its output so far), never on a worker in `exclude`: prefilled on a prefill
        worker (the next one when one fails), else locally."""
        decision = await self._route(gen, request_id, prompt, exclude)
        placed = Placed(decision.reason.split(":")[0], decision.reason, decision.cached_tokens)
        failed = 0
        # Prompt logprobs come from the engine that computes the prompt: the decode's.
        remote = not decision.local_prefill and not gen.sampling.HasField("prompt_logprobs")
        while remote and not decision.local_prefill:
            params, token = await self._prefill(gen, request_id, prompt, decision.prefill,
                                                placed)
            if params is not None:
                return await self._pulling(gen, request_id, decision, params, token), placed
            failed += 1
            if failed >= self.cfg.prefill_attempts:
                break
            self.prefill_failovers += 1
            placed.prefill_failovers += 1
            exclude = exclude | {decision.prefill.worker_id}
            decision = await self._route(gen, request_id, prompt, exclude)
        if failed:
            # NOTE: a failed prefill degrades to local prefill, never to an error.
            self.prefill_fallbacks += 1
            placed.prefill_fallback = True
        return DecodeLeg(request_id, decision.decode.worker_id,
                         self._engine(decision.decode.address),
                         calls=await self._decode_calls(decision.decode.address)), placed

    async def _pulling(self, gen: Generation, request_id: str,
                       decision: router_pb2.RouteDecision, params: dict[str, Any],
                       token: int | None) -> DecodeLeg:
        """The decode leg that pulls what the prefill worker of `decision` computed."""
        address = decision.prefill.address
        prefilled_at = time.monotonic()
        # The prefill's token goes to the client now when the decode worker can go on
        # after it (engine_requests.continues_from_prefill_token).
        if not (self.cfg.first_token == "prefill" and decision.decode.continues_prefill
                and continues_from_prefill_token(gen.sampling, params)):
            token = None
        return DecodeLeg(request_id, decision.decode.worker_id,
                         self._engine(decision.decode.address), params, address,
                         self._leases(address), prefilled_at, self._channel(address),
                         calls=await self._decode_calls(decision.decode.address),
                         first_token=token)

    async def _route(self, gen: Generation, request_id: str, prompt: list[int],
                     exclude: set[str]) -> router_pb2.RouteDecision:
        span = telemetry.span("route", attributes={"pdserve.request.id": request_id,
                                                   "pdserve.prompt_tokens": len(prompt)})
        try:
            with telemetry.current(span):
                decision = await self.router.Route(router_pb2.RouteRequest(
                    request_id=request_id, session_id=gen.session_id, model=gen.model,
                    prompt_tokens=len(prompt), prompt_token_ids_packed=packed(prompt),
                    exclude_workers=sorted(exclude), cache_salt=gen.cache_salt),
                    timeout=min(5.0, gen.remaining()))
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
                       worker: router_pb2.WorkerInfo, placed: Placed
                       ) -> tuple[dict[str, Any] | None, int | None]:
        """The prefill leg, traced as one span (the worker's call its child)."""
        span = telemetry.span("prefill", attributes={"pdserve.worker.id": worker.worker_id,
                                                     "pdserve.request.id": request_id})
        try:
            with telemetry.current(span):
                params, token = await self._prefill_leg(gen, request_id, prompt, worker, placed)
        except BaseException as e:
            telemetry.end(span, e)
            raise
        telemetry.end(span, None if params else "failed: tried elsewhere",
                      pdserve__kv__blocks=len((params or {}).get(REMOTE_BLOCK_IDS) or ()))
        return params, token

    async def _prefill_leg(self, gen: Generation, request_id: str, prompt: list[int],
                           worker: router_pb2.WorkerInfo, placed: Placed
                           ) -> tuple[dict[str, Any] | None, int | None]:
        """The prefill leg: the KV handover's params and the token the prefill sampled
        (None if it sent none), the leg recorded in `placed`; (None, None) when it fails
        for any reason but bad input or the request's own deadline (then it is aborted
        on the worker)."""
        started = time.perf_counter()
        budget = gen.remaining()
        try:
            call = self._engine(worker.address).Generate(
                prefill_request(request_id, prompt, gen.sampling),
                timeout=min(self.cfg.prefill_timeout_seconds, budget),
                metadata=call_metadata(gen.cache_salt))
            params, token, cached = await self._prefill_answer(call)
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
            return None, None
        except ValueError as e:
            log.warning("prefill of %s on %s failed (%s)", request_id, worker.worker_id, e)
            return None, None
        placed.prefill_worker, placed.prefill_cached_tokens = worker.worker_id, cached
        placed.prefill_ms = (time.perf_counter() - started) * 1000
        return params, token

    async def _prefill_answer(self, call) -> tuple[dict[str, Any] | None, int | None, int]:
        """The prefill call's answer: the KV handover's params (None: it sent none), the
        token it sampled (None if not one), and its prefix hit in tokens."""
        while True:
            resp = await call.read()
            if resp is grpc.aio.EOF:
                return None, None, 0
            if resp.HasField("complete") and resp.complete.HasField("kv_transfer_params_json"):
                break
        done = resp.complete
        params = decode(done.kv_transfer_params_json)
        # The answer is in: the decode starts now. The call's status follows the
        # worker's own bookkeeping after its last message; it is read in the
        # background (the call must stay referenced until it ends).
        in_background(call.code(), self._aborts)
        token = done.output_ids[0] if len(done.output_ids) == 1 else None
        return params, token, done.cached_tokens

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
