"""A channel to a peer that went away reaches it again soon after it comes back."""
from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.rpc import Server, channel
from support import free_port


async def test_a_restarted_peer_is_reached_within_a_second_or_so():
    port = free_port()
    ch = channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(ch)

    async def answered() -> bool:
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
            return True
        except grpc.aio.AioRpcError:
            return False

    # Down for 6 s, called all the while: gRPC's own backoff would have grown past 3 s.
    down_until = time.monotonic() + 6
    while time.monotonic() < down_until:
        assert not await answered()
        await asyncio.sleep(0.2)
    server = Server("127.0.0.1", port, lambda s: None, [])
    await server.start()
    up = time.monotonic()
    try:
        while not await answered():
            await asyncio.sleep(0.05)
        assert time.monotonic() - up < 1.5
    finally:
        await server.stop(0)
        await ch.close()
