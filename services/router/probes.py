"""The router's view of its engines, read over vLLM's engine protocol.

Workers are found two ways. pdserve's own workers register with the router and
heartbeat (they know when they start, drain and stop). An engine that does not
know pdserve (a stock `vllm ... --grpc` server, any servicer of vLLM's engine
protocol) is named instead: `pdserve router --prefill-worker HOST:PORT
--decode-worker HOST:PORT`; each round the router probes it (`HealthCheck`,
and `GetModelInfo` once for the model it serves) and keeps it in the same
registry while it answers healthy, so placement treats both kinds alike. One
that stops answering ages out like a silent registered worker.

Why both: registration is what a worker that knows its own lifecycle does best
(it is routable the moment its engine is up, and leaves the moment it starts
draining, with no probe lag and no discovery API to grant); probing is the only
way to use an engine that cannot register. A DNS or Kubernetes-endpoints list
of foreign engines would feed the same probes.

Each round also reads every live worker's `GetLoads` (requests running and
waiting in its scheduler), which placement uses to pick the least-loaded one.
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from pdserve.rpc import channel
from pdserve.v1 import router_pb2

from .registry import ROLE_NAMES, WorkerEntry, WorkerRegistry

log = logging.getLogger("pdserve.router")

ROLES = {name: role for role, name in ROLE_NAMES.items()}


class EngineProbes:
    """Probes static workers into the registry and refreshes every worker's load."""

    def __init__(self, registry: WorkerRegistry, static: list[tuple[str, str]],
                 interval: float):
        self.registry = registry
        self.static = static
        self.interval = interval
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._models: dict[str, str] = {}
        self._task: asyncio.Task | None = None

    def _stub(self, address: str) -> vllm_engine_pb2_grpc.VllmEngineStub:
        if address not in self._channels:
            self._channels[address] = channel(address)
        return vllm_engine_pb2_grpc.VllmEngineStub(self._channels[address])

    def start(self) -> None:
        """Begin probing in the background."""
        self._task = asyncio.create_task(self._run(), name="engine-probes")

    async def _run(self) -> None:
        while True:
            await self.round()
            await asyncio.sleep(self.interval)

    async def round(self) -> None:
        """Probe every static worker, then read the load of every live worker."""
        await asyncio.gather(*(self.probe(role, address) for role, address in self.static))
        live = [e for role in ROLE_NAMES for e in self.registry.serving(role)]
        await asyncio.gather(*(self.read_load(e) for e in live))

    async def probe(self, role: str, address: str) -> bool:
        """One health probe; True when the worker answered healthy (and is routable)."""
        stub = self._stub(address)
        try:
            health = await stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=2.0)
            if address not in self._models:
                info = await stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=2.0)
                self._models[address] = info.served_model_name or info.model_path
        except grpc.aio.AioRpcError as e:
            log.debug("probe of %s worker %s failed: %s", role, address, e.code().name)
            return False
        worker = router_pb2.WorkerInfo(worker_id=f"{role}@{address}", role=ROLES[role],
                                       address=address, model=self._models[address],
                                       serving=health.healthy)
        if self.registry.register(worker) and health.healthy:
            log.info("worker up: %s %s (static) model=%s", role, address, worker.model)
        elif not health.healthy:
            log.warning("%s worker %s reports unhealthy: %s", role, address, health.message)
        return health.healthy

    async def read_load(self, entry: WorkerEntry) -> None:
        """Requests running + waiting on the worker's engine (unchanged when unreadable)."""
        try:
            resp = await self._stub(entry.info.address).GetLoads(
                vllm_engine_pb2.GetLoadsRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return
        entry.load = sum(s.num_running_reqs + s.num_waiting_reqs for s in resp.loads)
        entry.pending = 0

    async def stop(self) -> None:
        """Stop probing and close the channels."""
        if self._task:
            self._task.cancel()
        for ch in self._channels.values():
            await ch.close()
