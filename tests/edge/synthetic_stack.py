"""An edge in front of the synthetic decode worker, all in this test's process.

Real parts everywhere but the model: the router probes the synthetic engine
over vLLM's engine protocol, the edge places requests through the router and
streams from the engine over gRPC, and clients talk real HTTP/WebSocket to it.
"""
from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from dataclasses import dataclass, field, replace

from aiohttp import web
from smg_grpc_proto import vllm_engine_pb2_grpc

from pdserve.config import EdgeConfig, RouterConfig
from pdserve.rpc import Server
from pdserve.v1 import inference_pb2_grpc
from pdserve.services.edge.app import ADMISSION, METRICS, STREAMS, build_app
from pdserve.services.edge.inference import InferenceService
from pdserve.services.edge.orchestrator import Orchestrator
from pdserve.services.edge.prompts import PromptEncoder
from pdserve.services.edge.runner import EdgeRunner
from pdserve.services.router.local import LocalRouter
from pdserve.services.router.registry import WorkerRegistry
from pdserve.services.router.server import Router
from pdserve.bench.synthetic import SERVICE_NAMES, SyntheticEngine, add_to_server
from support import free_port


@dataclass
class EdgeStack:
    url: str
    model: str
    engine: SyntheticEngine                         # the first decode engine
    app: web.Application
    replicas: list[tuple[str, web.Application]]     # every edge (the first is url/app)
    inference: str                                   # the first edge's Inference gRPC API
    engines: list[tuple[SyntheticEngine, Server]]    # every decode engine, with its server
    registry: WorkerRegistry | None = None           # the router's view of the engines
    routers: list = field(default_factory=list)      # every router replica (the first's registry)

    def body(self, max_tokens: int = 20, **extra) -> dict:
        return {"model": self.model, "prompt": "hello", "max_tokens": max_tokens,
                "stream": True, **extra}

    @property
    def streams(self):
        return self.app[STREAMS]

    @property
    def metrics(self):
        return self.app[METRICS]

    @property
    def admission(self):
        return self.app[ADMISSION]

    async def until(self, condition, timeout: float = 10.0) -> None:
        """Wait for `condition()` to hold (a reading the edge takes in the background);
        fail after `timeout` seconds."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not condition():
            assert asyncio.get_running_loop().time() < deadline, f"not within {timeout} s"
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def edge_stack(model_dir, rate: float = 200.0, replicas: int = 1, capacity: int = 0,
                     engines: int = 1, stock_engines: bool = False, batch_from: int = 0,
                     embedded_router: bool = False, routers: int = 1, **edge_options):
    """Yield an EdgeStack (`replicas` edges and `engines` decode engines on one router;
    `stock_engines`: serving vLLM's engine protocol only, as `vllm ... --grpc` does;
    `batch_from`: legs open on an engine before they share its batched call, here 0;
    `embedded_router`: the first edge runs the router's service in-process; `routers`:
    router replicas, each probing every engine, which the edges dial as one list);
    everything is stopped on exit."""
    encoder = PromptEncoder(str(model_dir))
    keys = edge_options.get("api_keys_file")
    if keys and "tenant_salt_file" not in edge_options:
        # Keys need the deployment's salt secret (tenant_salt.py): one beside them.
        salt = Path(keys).with_name("tenant-salt")
        salt.write_text("test-secret-" + "0" * 32)
        edge_options["tenant_salt_file"] = str(salt)
    decoders = []
    for _ in range(engines):
        engine = SyntheticEngine(encoder.tokenizer, str(model_dir), rate, capacity=capacity)
        if stock_engines:
            server = Server("127.0.0.1", 0, lambda s, e=engine: vllm_engine_pb2_grpc
                            .add_VllmEngineServicer_to_server(e, s), SERVICE_NAMES[:1])
        else:
            server = Server("127.0.0.1", 0, lambda s, e=engine: add_to_server(e, s),
                            SERVICE_NAMES)
        await server.start()
        decoders.append((engine, server))
    router_cfg = RouterConfig(port=0, static_workers=tuple(
        ("decode", f"127.0.0.1:{server.port}") for _, server in decoders))
    router_replicas = [Router(router_cfg, probe_interval=0.5) for _ in range(routers)]
    for router in router_replicas:
        await router.start()
    service = router_replicas[0].service
    cfg = replace(EdgeConfig(model=str(model_dir), router=",".join(
        f"127.0.0.1:{r.port}" for r in router_replicas), min_prefill_workers=0), **edge_options)
    edges = []
    for _ in range(replicas):
        # embedded_router: the first edge places in its own process (`--router embedded`).
        local = LocalRouter(service) if embedded_router and not edges else None
        orchestrator = Orchestrator(cfg, encoder.tokenizer, router=local, batch_from=batch_from)
        app = build_app(cfg, orchestrator, encoder,
                        router_metrics=service.metrics.registry if local else None)
        runner = EdgeRunner(app, handler_cancellation=True, shutdown_timeout=2.0)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        edges.append((f"http://127.0.0.1:{port}", app, runner, orchestrator))
    inference = InferenceService(cfg, encoder, edges[0][1])
    inference_server = Server("127.0.0.1", 0, lambda s: inference_pb2_grpc
                              .add_InferenceServicer_to_server(inference, s), [])
    await inference_server.start()
    stack = EdgeStack(edges[0][0], cfg.name, decoders[0][0], edges[0][1],
                      [(url, app) for url, app, _, _ in edges],
                      f"127.0.0.1:{inference_server.port}", decoders, service.registry,
                      router_replicas)
    try:
        # Until the router's probes found every engine serving: a request placed before
        # then sees fewer workers than the test started (a session's home would move).
        await stack.until(lambda: all(sum(w.serving for w in r.service.registry.snapshot())
                                      == engines for r in router_replicas), timeout=20)
        yield stack
    finally:
        await inference_server.stop(0)
        for _, _, runner, orchestrator in edges:
            await runner.cleanup()
            await orchestrator.close()
        for router in router_replicas:
            await router.stop(grace=0)
        for engine, server in decoders:
            engine.thaw()
            await server.stop(0)
