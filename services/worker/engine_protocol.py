"""vLLM's own engine protocol on a pdserve worker: `vllm.grpc.engine.VllmEngine`.

The servicer is vLLM's (from `smg-grpc-servicer`, the one `vllm serve --grpc`
runs): Generate (token ids in, streamed tokens out, `kv_transfer_params_json`
for prefill/decode), Abort, GetLoads, SubscribeKvEvents, GetServerInfo,
GetTokenizer, HealthCheck. Any gateway that speaks it (SMG, pdserve's own edge)
can drive a pdserve worker, and a pdserve worker keeps what a bare
`vllm ... --grpc` lacks: its cores, its connector, drain and these checks.
"""
from __future__ import annotations

import logging
import time

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from opentelemetry import trace
from smg_grpc_servicer.vllm.servicer import VllmEngineServicer

from pdserve import genai, telemetry
from pdserve.transfer.claim import LeaseClaims
from pdserve.transfer.metrics import HANDOVER_SECONDS
from pdserve.transfer.params import (PREFILL_ADDRESS, REMOTE_BLOCK_IDS, MalformedParams, decode, encode,
                             keeps_blocks, lease_id, pulls_blocks, salt_mismatch,
                             with_lease_seconds, with_salt_tag)

from .engine import VllmEngine
from .load_push import LoadNudges
from .request_salt import CURRENT as CURRENT_SALT, SaltedEngine, salt_of
from .validation import prompt_problem, sampling_problem

log = logging.getLogger(__name__)

SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name


class WorkerEngineServicer(VllmEngineServicer):
    """vLLM's VllmEngine servicer over a worker's engine, checking each request first."""

    def __init__(self, engine: VllmEngine, worker_id: str):
        super().__init__(engine.llm, time.time())
        self.engine = SaltedEngine(engine.llm)     # each call's cache salt into its prompt
        self.worker_id = worker_id
        self.max_model_len = engine.cfg.max_model_len
        self.vocab_size = engine.llm.model_config.get_vocab_size()
        self.claims = LeaseClaims()
        self.leases = None              # a prefill worker's KVTransferService
        self.in_flight = 0              # Generate calls running: a drain waits for none
        self.draining = False           # set on SIGTERM: HealthCheck says so
        self.load_nudges = LoadNudges()

    async def Generate(self, request, context):
        s = request.sampling_params
        problem = sampling_problem(s.max_tokens if s.HasField("max_tokens") else None,
                                   s.temperature if s.HasField("temperature") else None,
                                   s.top_p)
        if request.WhichOneof("input") == "tokenized":
            problem = problem or prompt_problem(request.tokenized.input_ids, self.max_model_len,
                                                self.vocab_size)
        salt, salt_problem = salt_of(context.invocation_metadata())
        problem = problem or salt_problem
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        CURRENT_SALT.set(salt)
        started = time.perf_counter()
        n, prompt_tokens, cached, ended = 0, 0, 0, "cancelled"
        self.in_flight += 1
        params = _kv_params(request)
        # A P/D decode: its handover (claim, pull, first step) is timed and traced.
        pull = _pull_attributes(params)
        handover = telemetry.span("kv_transfer", attributes=pull) if pull else None
        try:
            with telemetry.current(handover or trace.INVALID_SPAN):
                await self._claim(request, params, salt)
            async for resp in super().Generate(request, context):
                if handover is not None:
                    self._handed_over(handover, request, resp, started)
                    handover = None
                if resp.HasField("chunk"):
                    n += len(resp.chunk.token_ids)
                else:
                    n = n or len(resp.complete.output_ids)
                    prompt_tokens, cached = resp.complete.prompt_tokens, resp.complete.cached_tokens
                    ended = resp.complete.finish_reason
                    if self.leases and resp.complete.HasField("kv_transfer_params_json"):
                        self._issue_lease(resp.complete, salt)
                yield resp
        finally:
            self.in_flight -= 1
            self.load_nudges.ended()
            if handover is not None:
                telemetry.end(handover, error="ended before its first token")
            if telemetry.enabled():
                span = trace.get_current_span()     # the gRPC server span of this call
                span.set_attributes(genai.usage_attributes(prompt_tokens, n, cached))
                span.set_attributes({"pdserve.worker.id": self.worker_id,
                                     "pdserve.finish_reason": ended})
            # "cancelled": the caller went away; vLLM aborted the request as the
            # cancellation passed through AsyncLLM.generate, freeing its blocks.
            log.info("generate %s on %s %s after %d tokens: %d prompt tokens (%d cached), "
                     "%.1f ms%s", request.request_id, self.worker_id, ended, n, prompt_tokens,
                     cached, (time.perf_counter() - started) * 1000, _kv_note(request))

    @staticmethod
    def _handed_over(span, request, resp, started: float) -> None:
        """The first output of a P/D decode: the KV is in (pulled, or recomputed when
        the claim refused it); `pdserve:kv_transfer_seconds` counts only pulls."""
        pulled = request.HasField("kv_transfer_params_json")     # the claim kept it
        if pulled:
            HANDOVER_SECONDS.observe(time.perf_counter() - started)
        cached = (resp.chunk.cached_tokens if resp.HasField("chunk")
                  else resp.complete.cached_tokens)
        telemetry.end(span, pdserve__kv__pulled=pulled, pdserve__kv__cached_tokens=cached)

    def _issue_lease(self, complete, salt: str) -> None:
        """A prefill hands out a lease: the lease service hears of it, and the params
        say how long it holds (so a gateway can tell a fresh one, transfer/claim.py)
        and under which cache salt its blocks were computed."""
        params = decode(complete.kv_transfer_params_json)
        lease = lease_id(params)
        if lease:
            self.leases.issued(lease)
            complete.kv_transfer_params_json = encode(with_salt_tag(
                with_lease_seconds(params, self.leases.lease_seconds), salt))

    async def _claim(self, request, params: dict | None, salt: str = "") -> None:
        """A pull whose lease is gone (or whose prefill worker is) becomes a local
        prefill: the request reaches the engine without its kv_transfer_params
        (`params`: the request's, parsed)."""
        if params is None:
            return
        # Blocks computed under another tenant's salt never land in this request.
        reason = ("computed under another cache salt" if salt_mismatch(params, salt)
                  else await self.claims.refusal(params))
        if reason:
            log.warning("generate %s on %s: not pulling lease %s from %s (%s); prefilling "
                        "locally", request.request_id, self.worker_id,
                        lease_id(params), params.get(PREFILL_ADDRESS), reason)
            request.ClearField("kv_transfer_params_json")

    async def SubscribeKvEvents(self, request, context):
        """The servicer's relay of the engine's KV events and load records, plus a
        record as soon as a request ends (load_push.py)."""
        async for batch in self.load_nudges.stream(
                super().SubscribeKvEvents(request, context), self._load_record,
                before_first=request.load_records_before_first_batch):
            yield batch

    async def HealthCheck(self, request, context):
        """Unhealthy while draining: a router probing this worker (one that does not
        register) stops placing requests here, as a registered one is deregistered."""
        if self.draining:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="draining")
        return await super().HealthCheck(request, context)

    async def Abort(self, request, context):
        log.info("abort %s on %s", ",".join(request.request_ids), self.worker_id)
        return await super().Abort(request, context)


def _kv_params(request) -> dict | None:
    """The request's kv_transfer_params, or None when it has none readable (a bad one
    the engine answers with INVALID_ARGUMENT)."""
    if not request.HasField("kv_transfer_params_json"):
        return None
    try:
        return decode(request.kv_transfer_params_json)
    except MalformedParams:
        return None


def _pull_attributes(params: dict | None) -> dict | None:
    """The span attributes of a request that asks to pull a prefill's KV, else None."""
    if not params or not pulls_blocks(params):
        return None
    return {"pdserve.kv.lease_id": lease_id(params) or "",
            "pdserve.kv.prefill_address": str(params.get(PREFILL_ADDRESS, "")),
            "pdserve.kv.remote_blocks": len(params.get(REMOTE_BLOCK_IDS) or ())}


def _kv_note(request) -> str:
    """Which side of a P/D handoff a request is, for the log."""
    if not request.HasField("kv_transfer_params_json"):
        return ""
    try:
        params = decode(request.kv_transfer_params_json)
    except MalformedParams:
        return " (unreadable kv_transfer_params_json)"
    if pulls_blocks(params):
        return " (KV pulled from a prefill worker)"
    return " (KV kept for a decode worker)" if keeps_blocks(params) else ""


def add_to_server(servicer: WorkerEngineServicer, server: grpc.aio.Server) -> None:
    """Register VllmEngine on a gRPC server."""
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
