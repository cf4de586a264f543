"""Run the edge: aiohttp on uvloop, until SIGINT/SIGTERM, then drain."""
from __future__ import annotations

import logging

from aiohttp import web

from pdserve.config import EdgeConfig
from pdserve.lifecycle import until_signalled

from .app import build_app
from .orchestrator import Orchestrator
from .prompts import PromptEncoder

log = logging.getLogger("pdserve.edge")


async def serve(cfg: EdgeConfig) -> None:
    """Serve HTTP on cfg.host:cfg.port until signalled; streams in flight get 30 s to finish."""
    orchestrator = Orchestrator(cfg.router, cfg.request_timeout_seconds)
    app = build_app(cfg, orchestrator, PromptEncoder(cfg.model))
    # handler_cancellation: a client that goes away cancels its handler, which
    # cancels the decode call, which aborts the request on the worker.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=30.0,
                           access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    log.info("edge listening on http://%s:%d (model %s, router %s)", cfg.host, cfg.port,
             cfg.name, cfg.router)
    try:
        await until_signalled()
    finally:
        log.info("edge draining")
        await runner.cleanup()
        await orchestrator.close()
