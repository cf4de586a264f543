"""No decode worker serves: the router answers UNAVAILABLE, the edge 503 with Retry-After."""
from __future__ import annotations

import aiohttp
from aiohttp import web

from pdserve.config import EdgeConfig, RouterConfig
from pdserve.rpc import Server
from pdserve.v1 import router_pb2_grpc
from services.edge.app import build_app
from services.edge.orchestrator import Orchestrator
from services.edge.prompts import PromptEncoder
from services.router.server import RouterService
from support import free_port


async def test_no_worker_is_503_with_retry_after(model_dir):
    service = RouterService(RouterConfig(port=0))
    router = Server("127.0.0.1", 0, lambda s: router_pb2_grpc.add_RouterServicer_to_server(
        service, s), ["pdserve.v1.Router"])
    await router.start()
    cfg = EdgeConfig(model=str(model_dir), router=f"127.0.0.1:{router.port}")
    encoder = PromptEncoder(cfg.model)
    orchestrator = Orchestrator(cfg.router, 30, encoder.tokenizer)
    runner = web.AppRunner(build_app(cfg, orchestrator, encoder))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{port}/v1/completions",
                                 json={"model": cfg.name, "prompt": "hello"}) as r:
                body = await r.json()
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert body["error"]["type"] == "service_unavailable"
                assert "router" in body["error"]["message"]
    finally:
        await runner.cleanup()
        await orchestrator.close()
        await router.stop(0)
