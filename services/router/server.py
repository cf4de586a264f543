"""The Router gRPC service: registration, heartbeats, Route.

Workers are found two ways (see `probes.py`): pdserve's own register and
heartbeat; engines named with `--prefill-worker`/`--decode-worker` are probed
over vLLM's engine protocol. Every worker's load is read with GetLoads.
"""
from __future__ import annotations

import logging
import time

import grpc
import prometheus_client

from pdserve.cluster_token import read_token, shown
from pdserve.config import RouterConfig
from pdserve.lifecycle import freeze_startup_heap, until_signalled
from pdserve.netaddr import hostport
from pdserve.rpc import Server
from pdserve.v1 import router_pb2, router_pb2_grpc

from .edges import EdgeReports
from .metrics import RouterMetrics
from .placement import NoWorkerError, Policy, place
from .probes import EngineProbes
from .prefix_index import PrefixIndex
from .registry import ROLE_NAMES, WorkerRegistry

log = logging.getLogger("pdserve.router")


class RouterService(router_pb2_grpc.RouterServicer):
    """Answers Route from the registry; workers keep the registry fresh."""

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.registry = WorkerRegistry(cfg.worker_timeout_seconds)
        self.policy = Policy(balance=cfg.balance, balance_slack=cfg.balance_slack,
                             local_below_tokens=cfg.local_prefill_below_tokens,
                             local_cached_fraction=cfg.local_cached_fraction,
                             prefill_saturated=cfg.prefill_saturated)
        self.index = PrefixIndex()                # kept by the workers' KV events
        self.on_join = lambda: None               # called when a new worker registers
        self.edges = EdgeReports()                # the edges' admission counts
        self.metrics = RouterMetrics(self.registry)
        self.token = read_token(cfg.cluster_token_file)

    async def _check_token(self, context) -> None:
        if not shown(context, self.token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "registration needs this pool's cluster token "
                                "(--cluster-token-file)")

    async def Register(self, request, context):
        await self._check_token(context)
        w = request.worker
        if not w.worker_id or not w.address or w.role not in ROLE_NAMES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "worker needs worker_id, address and a prefill/decode role")
        if self.registry.register(w):
            log.info("worker up: %s %s at %s model=%s", ROLE_NAMES[w.role], w.worker_id,
                     w.address, w.model)
            self.on_join()
        interval = int(self.cfg.worker_timeout_seconds * 1000 / 3)
        return router_pb2.RegisterResponse(heartbeat_interval_ms=interval)

    async def Deregister(self, request, context):
        await self._check_token(context)
        if self.registry.deregister(request.worker_id):
            log.info("worker gone: %s", request.worker_id)
        return router_pb2.DeregisterResponse()

    async def Route(self, request, context):
        decision, code, details = self.decide(request)
        if decision is None:
            await context.abort(code, details)
        return decision

    async def RouteStream(self, request_iterator, context):
        """Route, for every request the call brings, a message's requests answered in
        one; a request that cannot be placed is answered with its status, and the
        call goes on."""
        async for batch in request_iterator:
            yield router_pb2.RouteAnswers(answers=[self._answer(r) for r in batch.requests])

    def _answer(self, request: router_pb2.RouteRequest) -> router_pb2.RouteAnswer:
        try:
            decision, code, details = self.decide(request)
        except Exception:  # noqa: BLE001 (one request's bug must not end every edge's call)
            log.exception("route %s failed", request.request_id)
            decision, code = None, grpc.StatusCode.INTERNAL
            details = "the router failed to place it"
        if decision is None:
            return router_pb2.RouteAnswer(request_id=request.request_id,
                                          status_code=code.value[0], status_details=details)
        return router_pb2.RouteAnswer(request_id=request.request_id, decision=decision)

    def decide(self, request: router_pb2.RouteRequest
               ) -> tuple[router_pb2.RouteDecision | None, grpc.StatusCode, str]:
        """One request's placement, counted in the registry's pending loads; or None,
        and the status it fails with."""
        started = time.perf_counter()
        try:
            decision, decode, prefill = place(self.registry, request, self.policy, self.index)
        except NoWorkerError as e:
            self.metrics.unplaced.inc()
            return None, grpc.StatusCode.UNAVAILABLE, str(e)
        except ValueError as e:                 # packed token ids of a broken length
            return None, grpc.StatusCode.INVALID_ARGUMENT, str(e)
        self.metrics.routed(decision.reason, started)
        for entry in (decode, prefill):
            if entry is not None:
                self.registry.placed(entry)
        if log.isEnabledFor(logging.INFO):
            log.info("route %s: decode=%s prefill=%s (%s; %d of %d prompt tokens held; "
                     "decode loads %s)", request.request_id, decision.decode.worker_id,
                     decision.prefill.worker_id or "-", decision.reason,
                     decision.cached_tokens,
                     request.prompt_tokens or len(request.prompt_token_ids),
                     " ".join(f"{e.info.worker_id}={e.load}+{e.pending}"
                              for e in self.registry.workers.values()
                              if e.info.role == decode.info.role))
        return decision, grpc.StatusCode.OK, ""

    async def ListWorkers(self, request, context):
        elsewhere = self.edges.report(request.edge_id, request.admitted)
        return router_pb2.ListWorkersResponse(workers=self.registry.snapshot(),
                                              admitted_elsewhere=elsewhere.admitted,
                                              edges=elsewhere.edges)


class Router:
    """The service on its gRPC port, and the probes that keep its registry and prefix
    index fed: what runs in a router process, or in an edge's (`--router embedded`,
    local.py). The port is bound here (cfg.port 0: any free one, then `port`). Workers
    are probed every `probe_interval` seconds, a third of the worker timeout unless told."""

    def __init__(self, cfg: RouterConfig, probe_interval: float | None = None):
        self.service = RouterService(cfg)
        self.probes = EngineProbes(self.service.registry, list(cfg.static_workers),
                                   probe_interval or cfg.worker_timeout_seconds / 3,
                                   self.service.index)
        self.service.on_join = self.probes.wake
        self.server = Server(cfg.host, cfg.port, lambda s: router_pb2_grpc
                             .add_RouterServicer_to_server(self.service, s),
                             ["pdserve.v1.Router"])
        self.port = self.server.port

    async def start(self) -> None:
        """Serve, and begin probing the workers."""
        await self.server.start()
        self.probes.start()

    async def stop(self, grace: float = 2.0) -> None:
        await self.probes.stop()
        await self.server.stop(grace)


async def serve(cfg: RouterConfig) -> None:
    """Run the router until SIGINT/SIGTERM."""
    router = Router(cfg)
    await router.start()
    freeze_startup_heap()
    if cfg.metrics_port:
        prometheus_client.start_http_server(cfg.metrics_port, addr=cfg.host,
                                            registry=router.service.metrics.registry)
    log.info("router listening on %s (%d static workers)", hostport(cfg.host, router.port),
             len(cfg.static_workers))
    try:
        await until_signalled()
    finally:
        await router.stop()
