"""Run one worker process: engine, gRPC server, router registration."""
from __future__ import annotations

import logging
import socket

from pdserve.config import WorkerConfig
from pdserve.lifecycle import until_signalled
from pdserve.rpc import Server
from pdserve.v1 import common_pb2, router_pb2

from .engine import VllmEngine
from .registration import RouterRegistration

log = logging.getLogger(__name__)

_ROLES = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE}


async def serve_worker(cfg: WorkerConfig, make_servicer, add_to_server, service_name: str) -> None:
    """Build the engine, serve `service_name` on gRPC, stay registered until signalled."""
    engine = VllmEngine(cfg.engine, cfg.role, cfg.kv)
    servicer = make_servicer(engine, cfg.worker_id)
    server = Server(cfg.host, cfg.port, lambda s: add_to_server(servicer, s), [service_name])
    # Default id from the bound port, so that port 0 still gives a stable, unique name.
    worker_id = servicer.worker_id = (cfg.worker_id
                                      or f"{cfg.role}-{socket.gethostname()}-{server.port}")
    await server.start()
    address = f"{cfg.advertise_host or cfg.host}:{server.port}"
    info = router_pb2.WorkerInfo(worker_id=worker_id, role=_ROLES[cfg.role], address=address,
                                 model=cfg.engine.name, serving=True)
    registration = RouterRegistration(cfg.router, info, cfg.heartbeat_seconds)
    registration.start()
    log.info("%s worker %s serving on %s", cfg.role, worker_id, address)
    try:
        await until_signalled()
    finally:
        log.info("%s worker %s stopping", cfg.role, worker_id)
        await registration.stop()
        await server.stop(grace=5.0)
        engine.shutdown()
