"""Run one worker process: engine, gRPC server (vLLM's engine protocol), router registration.

On SIGTERM a worker drains: gRPC health goes NOT_SERVING and it leaves the
router at once (no new request is placed here), then the Generate calls it is
running get up to `drain_seconds` to finish before the server and the engine
stop. A second SIGTERM/SIGINT cuts the drain short. When its engine core dies
instead, it goes NOT_SERVING, leaves the router and exits at once, non-zero
(engine_watch.py): its calls have failed already, and the edge moves them.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time

import prometheus_client
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from pdserve.cluster_token import read_token
from pdserve.config import WorkerConfig
from pdserve.lifecycle import freeze_startup_heap, until_signalled
from pdserve.netaddr import hostport
from pdserve.rpc import Server
from pdserve.v1 import common_pb2, router_pb2
from pdserve.transfer.connector import check_side_channel, continues_prefill
from pdserve.transfer.params import CONTINUES_PREFILL
from pdserve.transfer.ucx_transport import detect as detect_ucx
from pdserve.transfer.service import SERVICE_NAME as LEASE_SERVICE
from pdserve.transfer.service import KVTransferService
from pdserve.transfer.service import add_to_server as add_lease_service

from .batched import SERVICE_NAME as BATCHED_SERVICE
from .batched import add_to_server as add_batched_generate
from .engine import VllmEngine
from .engine_protocol import SERVICE_NAME as ENGINE_SERVICE
from .engine_protocol import WorkerEngineServicer
from .engine_protocol import add_to_server as add_engine_protocol
from .engine_watch import ENGINE_ALIVE, EngineDied, until_engine_dead
from .registration import RouterRegistration

log = logging.getLogger(__name__)

_ROLES = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE}


async def serve_worker(cfg: WorkerConfig) -> None:
    """Build the engine; serve vLLM's `VllmEngine` (and gRPC health, reflection) on
    one port; stay registered with the router until signalled."""
    token = read_token(cfg.cluster_token_file)     # a bad file fails before the engine loads
    if cfg.kv:
        check_side_channel(cfg.kv)    # a taken port would hang the engine's start
        transport = detect_ucx()
        (log.warning if transport.degraded else log.info)(
            "KV plane: UCX transport %s (%s)", transport.name, transport.why)
    engine = VllmEngine(cfg.engine, cfg.role, cfg.kv)
    servicer = WorkerEngineServicer(engine, cfg.worker_id)

    # A prefill worker also ends and checks its engine's KV leases by id.
    leases = (KVTransferService(engine.llm, cfg.worker_id, cfg.kv.lease_seconds)
              if cfg.role == "prefill" and cfg.kv else None)
    servicer.leases = leases
    continues = continues_prefill(cfg.role, cfg.kv)
    server = _server(cfg, servicer, leases, continues)
    # Default id from the bound port, so that port 0 still gives a stable, unique name.
    worker_id = servicer.worker_id = (
        cfg.worker_id or f"{cfg.role}-{socket.gethostname()}-{server.port}")
    await server.start()
    await server.health.set(ENGINE_ALIVE, health_pb2.HealthCheckResponse.SERVING)
    refresh = None
    if leases:
        leases.worker_id = worker_id
        refresh = asyncio.create_task(leases.refresh(), name="lease-stats")
    if cfg.metrics_port:
        serve_metrics(cfg, worker_id)
    address = hostport(cfg.advertise_host or cfg.host, server.port)
    info = router_pb2.WorkerInfo(worker_id=worker_id, role=_ROLES[cfg.role], address=address,
                                 model=cfg.engine.name, serving=True,
                                 continues_prefill=continues)
    freeze_startup_heap()
    registration = RouterRegistration(cfg.router, info, cfg.heartbeat_seconds, token)
    registration.start()
    log.info("%s worker %s serving on %s", cfg.role, worker_id, address)
    died = False
    try:
        died = await signalled_or_dead(engine.llm)
    finally:
        if refresh is not None:
            refresh.cancel()
        if died:
            await leave_dead(server, registration)
        else:
            await leave_drained(server, registration, servicer, cfg.drain_seconds,
                                f"{cfg.role} worker {worker_id}")
        engine.shutdown()
    if died:
        raise EngineDied(f"{cfg.role} worker {worker_id}: its engine core died")


def _server(cfg: WorkerConfig, servicer: WorkerEngineServicer, leases, continues: bool) -> Server:
    """The worker's gRPC server: the engine protocol, the same Generate batched, a prefill
    worker's lease service, health and reflection."""
    services = [ENGINE_SERVICE, BATCHED_SERVICE] + ([LEASE_SERVICE] if leases else [])

    def add_servicers(server) -> None:
        add_engine_protocol(servicer, server)
        # The same Generate, many generations to a call (an edge's --decode-calls batched).
        add_batched_generate(servicer, server)
        if leases:
            add_lease_service(leases, server)
        # grpcurl and gateways discover the services by reflection, as on `vllm serve --grpc`.
        reflection.enable_server_reflection(
            [*services, "grpc.health.v1.Health", reflection.SERVICE_NAME], server)

    # Health also answers for what the worker can do that is no service of its own.
    return Server(cfg.host, cfg.port, add_servicers,
                  services + ([CONTINUES_PREFILL] if continues else []))


def serve_metrics(cfg: WorkerConfig, worker_id: str) -> None:
    """vLLM's stat logger records the engine's vllm:* series into this process's
    default registry; serve them unchanged, as `vllm serve` does on /metrics, with
    the worker's pdserve:kv_* series and who it is (dashboards join on it)."""
    prometheus_client.Info("pdserve:worker", "This worker: its id, role and model").info(
        {"worker_id": worker_id, "role": cfg.role, "model_name": cfg.engine.name})
    prometheus_client.start_http_server(cfg.metrics_port, addr=cfg.host)


async def signalled_or_dead(llm) -> bool:
    """Wait for SIGINT/SIGTERM (False) or for the engine core's death (True)."""
    signalled = asyncio.create_task(until_signalled(), name="signal")
    death = asyncio.create_task(until_engine_dead(llm), name="engine-watch")
    try:
        done, _ = await asyncio.wait({signalled, death}, return_when=asyncio.FIRST_COMPLETED)
        return death in done
    finally:
        signalled.cancel()
        death.cancel()


async def leave_dead(server: Server, registration: RouterRegistration) -> None:
    """NOT_SERVING on every health name (the liveness probe's too), out of the router
    at once, then the server stops: its calls already ended with the engine's error."""
    await server.health.set(ENGINE_ALIVE, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.drain()
    await registration.stop()
    await server.stop(grace=0.5)


async def leave_drained(server: Server, registration: RouterRegistration,
                        servicer: WorkerEngineServicer, seconds: float, who: str) -> None:
    """NOT_SERVING and out of the router at once; the calls running get `seconds`
    (a second signal cuts that short), then the server stops."""
    again = asyncio.create_task(until_signalled(), name="second-signal")
    servicer.draining = True
    await server.drain()
    await registration.stop()
    await drain(servicer, seconds, again, who)
    again.cancel()
    await server.stop(grace=1.0)

async def drain(servicer: WorkerEngineServicer, seconds: float, cut_short: asyncio.Future,
                who: str) -> None:
    """Wait until `servicer` runs no Generate call, at most `seconds` or until
    `cut_short` is done; log how it began and how it ended."""
    log.info("%s draining: %d Generate calls in flight (up to %g s)", who, servicer.in_flight,
             seconds)
    started = time.monotonic()
    while (servicer.in_flight and not cut_short.done()
           and time.monotonic() - started < seconds):
        await asyncio.sleep(0.05)
    took = time.monotonic() - started
    if servicer.in_flight:
        log.warning("%s: drain cut short after %.1f s with %d Generate calls still running",
                    who, took, servicer.in_flight)
    else:
        log.info("%s drained in %.1f s", who, took)
