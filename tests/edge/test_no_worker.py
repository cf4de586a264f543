"""No worker serves: Route is UNAVAILABLE, the edge answers 503 with Retry-After; /health
is ready while the minimum of workers serve, whatever else the router lists."""
from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from aiohttp import web

from pdserve.config import EdgeConfig, RouterConfig
from pdserve.rpc import Server
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.services.edge.app import build_app
from pdserve.services.edge.orchestrator import Orchestrator
from pdserve.services.edge.prompts import PromptEncoder
from pdserve.services.router.local import LocalRouter
from pdserve.services.router.server import RouterService
from support import free_port


@contextlib.asynccontextmanager
async def _edge(model_dir, service: RouterService, embedded: bool = False, **options):
    """A real router (serving `service`) and an edge in front of it, or with `embedded`
    the edge calling `service` in-process (`--router embedded`); yields the edge's URL."""
    router = Server("127.0.0.1", 0, lambda s: router_pb2_grpc.add_RouterServicer_to_server(
        service, s), ["pdserve.v1.Router"])
    await router.start()
    cfg = EdgeConfig(model=str(model_dir), router=f"127.0.0.1:{router.port}", **options)
    encoder = PromptEncoder(cfg.model)
    orchestrator = Orchestrator(cfg, encoder.tokenizer,
                                router=LocalRouter(service) if embedded else None)
    runner = web.AppRunner(build_app(cfg, orchestrator, encoder))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", cfg
    finally:
        await runner.cleanup()
        await orchestrator.close()
        await router.stop(0)


@pytest.mark.parametrize("embedded", [False, True], ids=["router", "embedded"])
async def test_no_worker_is_503_with_retry_after(model_dir, embedded):
    async with _edge(model_dir, RouterService(RouterConfig(port=0)), embedded) as (url, cfg):
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/completions",
                                 json={"model": cfg.name, "prompt": "hello"}) as r:
                body = await r.json()
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert body["error"]["type"] == "service_unavailable"
                assert "router" in body["error"]["message"]


async def test_health_stays_ready_while_the_minimum_of_workers_serve(model_dir):
    """A dead worker still listed makes the edge "degraded", not unready: readiness of
    every edge must not hang on one worker. Below the minimum it is 503."""
    service = RouterService(RouterConfig(port=0))
    decode = common_pb2.WORKER_ROLE_DECODE
    for wid, serving in (("decode-0", True), ("decode-1", False)):
        service.registry.register(router_pb2.WorkerInfo(
            worker_id=wid, role=decode, address=f"127.0.0.1:{free_port()}", serving=serving))
    async with _edge(model_dir, service, min_prefill_workers=0,
                     min_decode_workers=1) as (url, _):
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/health") as r:
                body = await r.json()
                assert r.status == 200 and body["status"] == "degraded"
                assert {w["worker_id"]: w["serving"] for w in body["workers"]} == {
                    "decode-0": True, "decode-1": False}
            service.registry.deregister("decode-0")
            # /health answers from the edge's last reading (one a second), never the router.
            deadline = asyncio.get_running_loop().time() + 3
            while True:
                async with http.get(f"{url}/health") as r:
                    if r.status == 503:
                        assert (await r.json())["status"] == "unavailable"
                        break
                assert asyncio.get_running_loop().time() < deadline, "still ready"
                await asyncio.sleep(0.1)
