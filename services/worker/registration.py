"""Keeps a worker registered with every router replica: register, then heartbeat.

`--router` may name several replicas (pdserve/routers.py); each gets its own
heartbeat, so each holds the whole pool and any one of them can place requests
while another restarts. A `dns:///` name is looked up again every
RESOLVE_SECONDS: a replica that appears is registered with at once.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve import routers
from pdserve.cluster_token import call_metadata
from pdserve.rpc import channel
from pdserve.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

RESOLVE_SECONDS = 5.0


class RouterLink:
    """One router replica: `info` registered with it and re-registered every heartbeat."""

    def __init__(self, address: str, info: router_pb2.WorkerInfo, interval: float,
                 token: str = ""):
        self.address, self.info, self.interval = address, info, interval
        self.metadata = call_metadata(token)
        self.channel = channel(address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.task = asyncio.create_task(self._beat(), name=f"router-heartbeat-{address}")

    async def _beat(self) -> None:
        registered = False
        while True:
            self.info.last_seen_unix_ms = int(time.time() * 1000)
            try:
                resp = await self.stub.Register(router_pb2.RegisterRequest(worker=self.info),
                                                timeout=2.0, metadata=self.metadata)
                if not registered:
                    log.info("registered %s with router %s", self.info.worker_id, self.address)
                registered = True
                wait = resp.heartbeat_interval_ms / 1000 or self.interval
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    log.error("router %s refused %s: %s (check --cluster-token-file)",
                              self.address, self.info.worker_id, e.details())
                elif registered:
                    log.warning("router %s unreachable (%s); retrying", self.address,
                                e.code().name)
                registered = False
                wait = min(self.interval, 1.0)
            await asyncio.sleep(wait)

    async def stop(self, say_goodbye: bool = True) -> None:
        """Stop heartbeating and (`say_goodbye`) tell the router we are gone."""
        self.task.cancel()
        if say_goodbye:
            try:
                await self.stub.Deregister(
                    router_pb2.DeregisterRequest(worker_id=self.info.worker_id), timeout=1.0,
                    metadata=self.metadata)
            except grpc.aio.AioRpcError:
                pass  # the router forgets us after its heartbeat timeout anyway
        await self.channel.close()


class RouterRegistration:
    """Registers `info` with every router `routers_spec` names, and re-registers every
    heartbeat; `token`: the cluster token each Register shows ("" for none)."""

    def __init__(self, routers_spec: str, info: router_pb2.WorkerInfo, interval: float,
                 token: str = ""):
        self.spec, self.info, self.interval, self.token = routers_spec, info, interval, token
        self.links: dict[str, RouterLink] = {}
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        """Begin heartbeating (to every replica) in the background."""
        self.task = asyncio.create_task(self._follow(), name="router-replicas")

    async def _follow(self) -> None:
        dynamic = routers.is_dynamic(self.spec)
        while True:
            try:
                await self._link(await routers.addresses(self.spec))
            except OSError as e:              # a name that does not resolve (yet)
                log.warning("cannot resolve the routers %s: %s", self.spec, e)
            if not dynamic:
                return
            await asyncio.sleep(RESOLVE_SECONDS)

    async def _link(self, addresses: list[str]) -> None:
        for address in addresses:
            if address not in self.links:
                self.links[address] = RouterLink(address, self.info, self.interval, self.token)
        for address in [a for a in self.links if a not in addresses]:
            await self.links.pop(address).stop(say_goodbye=False)   # that replica is gone

    async def stop(self) -> None:
        """Stop heartbeating and tell every router we are gone."""
        if self.task:
            self.task.cancel()
        await asyncio.gather(*(link.stop() for link in self.links.values()))
        self.links.clear()
