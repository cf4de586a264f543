"""Keeps a worker registered with the router: register, then heartbeat."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.rpc import channel
from pdserve.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)


class RouterRegistration:
    """Registers `info` with the router and re-registers every heartbeat."""

    def __init__(self, router_address: str, info: router_pb2.WorkerInfo, interval: float):
        self.info = info
        self.interval = interval
        self.channel = channel(router_address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        """Begin heartbeating in the background."""
        self.task = asyncio.create_task(self._beat(), name="router-heartbeat")

    async def _beat(self) -> None:
        registered = False
        while True:
            self.info.last_seen_unix_ms = int(time.time() * 1000)
            try:
                resp = await self.stub.Register(router_pb2.RegisterRequest(worker=self.info),
                                                timeout=2.0)
                if not registered:
                    log.info("registered %s with router", self.info.worker_id)
                registered = True
                wait = resp.heartbeat_interval_ms / 1000 or self.interval
            except grpc.aio.AioRpcError as e:
                if registered:
                    log.warning("router unreachable (%s); retrying", e.code().name)
                registered = False
                wait = min(self.interval, 1.0)
            await asyncio.sleep(wait)

    async def stop(self) -> None:
        """Stop heartbeating and tell the router we are gone."""
        if self.task:
            self.task.cancel()
        try:
            await self.stub.Deregister(
                router_pb2.DeregisterRequest(worker_id=self.info.worker_id), timeout=1.0)
        except grpc.aio.AioRpcError:
            pass  # the router forgets us after its heartbeat timeout anyway
        await self.channel.close()
