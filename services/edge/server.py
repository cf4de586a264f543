"""Run the edge: aiohttp on uvloop, until SIGINT/SIGTERM, then drain."""
from __future__ import annotations

import logging

from aiohttp import web

from pdserve.config import EdgeConfig
from pdserve.lifecycle import freeze_startup_heap, until_signalled
from pdserve.netaddr import hostport
from pdserve.rpc import Server
from pdserve.v1 import inference_pb2_grpc
from pdserve.services.router.local import LocalRouter
from pdserve.services.router.server import Router

from . import websocket
from .app import ADMISSION, METRICS, ROUTER_METRICS, STREAMS, build_app, metrics
from .detokenizer import byte_table
from .inference import InferenceService
from .orchestrator import Orchestrator
from .prompts import PromptEncoder
from .runner import EdgeRunner

# Full garbage collections, one per 1,000 of the middle generation's instead of 10:
# in a ramp of 1,000 streams the edge ran one every second or so, 17-25 ms each,
# and none in the same runs with this (docs/design/2026-12-05-edge-garbage-collection.md).
FULL_COLLECTION_EVERY = 1000

# What a stop costs after the drain, at most (k8s/base/edge.yaml's grace adds them up):
STOP_GRPC_GRACE_S = 1.0       # the Inference gRPC server's calls in flight
# aiohttp waits this long for the HTTP handlers still running (their streams were cut
# at the drain's end, so they are writing their last event), then cancels them and
# waits as long again: at most twice this.
SHUTDOWN_TIMEOUT_S = 3.0
STOP_ROUTER_GRACE_S = 1.0     # an embedded router's calls in flight


def stop_budget(drain_seconds: float) -> float:
    """The longest a SIGTERMed edge takes to stop, exit aside: its drain, then every
    shutdown timeout after it (WebSockets close concurrently within WS_CLOSE_SECONDS)."""
    return (drain_seconds + STOP_GRPC_GRACE_S + websocket.WS_CLOSE_SECONDS
            + 2 * SHUTDOWN_TIMEOUT_S + STOP_ROUTER_GRACE_S)


log = logging.getLogger("pdserve.edge")


async def _serve_metrics(cfg: EdgeConfig, app: web.Application) -> web.AppRunner | None:
    """With --metrics-port: /metrics alone on that port (the API's port answers it 404),
    bound where the API is, so that a policy can admit scrapers to it alone."""
    if not cfg.metrics_port:
        return None
    scrape = web.Application()
    scrape[METRICS], scrape[ROUTER_METRICS] = app[METRICS], app[ROUTER_METRICS]
    scrape.router.add_get("/metrics", metrics)
    runner = web.AppRunner(scrape, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, None if cfg.host == "::" else cfg.host, cfg.metrics_port).start()
    return runner


async def serve(cfg: EdgeConfig) -> None:
    """Serve HTTP on cfg.host:cfg.port until signalled; streams in flight get 30 s to finish."""
    encoder = PromptEncoder(cfg.model, cfg.tool_call_parser)
    # The detokenizer's byte table is built and checked once per tokenizer (a decode
    # of every id), here rather than in the first request.
    byte_table(encoder.tokenizer._tokenizer)
    # --router embedded: the router's registry, probes and placement on this loop.
    router = Router(cfg.embedded_router) if cfg.embedded_router else None
    orchestrator = Orchestrator(cfg, encoder.tokenizer,
                                router=LocalRouter(router.service) if router else None)
    app = build_app(cfg, orchestrator, encoder,
                    router_metrics=router.service.metrics.registry if router else None)
    inference = InferenceService(cfg, encoder, app)
    grpc_server = Server(cfg.host, cfg.grpc_port,
                         lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(inference, s),
                         ["pdserve.v1.Inference"])
    await grpc_server.start()
    if router:
        await router.start()
    # handler_cancellation: a client that goes away cancels its handler, which
    # cancels the decode call, which aborts the request on the worker.
    runner = EdgeRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                        access_log=None)
    await runner.setup()
    # backlog: a burst of thousands of connections must queue, not be refused
    # (aiohttp's default of 128 dropped 740 of 10,000 streams opened in a second).
    # `::`: every address of both families, as gRPC's [::] takes IPv4 too (asyncio binds
    # `::` IPv6-only; no host binds 0.0.0.0 and :: side by side).
    site = web.TCPSite(runner, None if cfg.host == "::" else cfg.host, cfg.port, backlog=4096)
    await site.start()
    metrics_runner = await _serve_metrics(cfg, app)
    freeze_startup_heap(full_every=FULL_COLLECTION_EVERY)
    log.info("edge listening on http://%s, Inference gRPC on :%d (model %s, router %s)",
             hostport(cfg.host, cfg.port), grpc_server.port, cfg.name,
             f"embedded, Router gRPC on {hostport(cfg.embedded_router.host, router.port)}"
             if router else cfg.router)
    try:
        await until_signalled()
    finally:
        # Drain: /health fails and nothing new is admitted at once (a load balancer
        # stops sending here); streams in flight get drain_seconds to finish, and those
        # still running then are cut, so that their readers get an end, not a reset.
        log.info("edge draining: %d streams in flight", len(app[STREAMS].live))
        app[ADMISSION].drain()
        await app[STREAMS].wait_idle(cfg.drain_seconds)
        if app[STREAMS].live:
            log.warning("edge drain ended with %d streams running; cutting them",
                        len(app[STREAMS].live))
            await app[STREAMS].cut("the edge's drain ended")
        await grpc_server.stop(grace=STOP_GRPC_GRACE_S)
        await runner.cleanup()
        if metrics_runner:
            await metrics_runner.cleanup()
        await orchestrator.close()
        if router:
            await router.stop(grace=STOP_ROUTER_GRACE_S)
