"""A worker registers with every router replica `--router` names, showing the cluster
token; a router with a token refuses a Register without it (UNAUTHENTICATED)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve import routers
from pdserve.cluster_token import call_metadata, write_token
from pdserve.config import RouterConfig
from pdserve.rpc import channel
from pdserve.services.router.server import Router
from pdserve.services.worker.registration import RouterRegistration
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc


def _info(worker_id: str = "decode-0") -> router_pb2.WorkerInfo:
    return router_pb2.WorkerInfo(worker_id=worker_id, role=common_pb2.WORKER_ROLE_DECODE,
                                 address="127.0.0.1:1", model="m", serving=True)


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout} s"
        await asyncio.sleep(0.02)


async def test_a_worker_registers_with_every_replica_and_leaves_them_all(tmp_path):
    token_file = write_token(str(tmp_path))
    token = open(token_file).read()
    replicas = [Router(RouterConfig(port=0, cluster_token_file=token_file)) for _ in range(2)]
    for r in replicas:
        await r.start()
    try:
        spec = ",".join(f"127.0.0.1:{r.port}" for r in replicas)
        registration = RouterRegistration(spec, _info(), 0.2, token)
        registration.start()
        await _until(lambda: all("decode-0" in r.service.registry.workers for r in replicas))
        await registration.stop()
        assert not any("decode-0" in r.service.registry.workers for r in replicas)
    finally:
        for r in replicas:
            await r.stop(grace=0)


@pytest.mark.parametrize("shown", ["", "not-the-token"])
async def test_a_register_without_the_token_is_refused(tmp_path, shown):
    router = Router(RouterConfig(port=0, cluster_token_file=write_token(str(tmp_path))))
    await router.start()
    try:
        async with channel(f"127.0.0.1:{router.port}") as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Register(router_pb2.RegisterRequest(worker=_info()), timeout=2,
                                    metadata=call_metadata(shown))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as e:        # nor take one out
                await stub.Deregister(router_pb2.DeregisterRequest(worker_id="decode-0"),
                                      timeout=2, metadata=call_metadata(shown))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert not router.service.registry.workers
    finally:
        await router.stop(grace=0)


async def test_dns_names_every_address_once():
    assert await routers.addresses("127.0.0.1:1,dns:///localhost:2,127.0.0.1:1") == [
        "127.0.0.1:1", *sorted(a for a in await routers.addresses("dns:///localhost:2"))]
    assert "127.0.0.1:2" in await routers.addresses("dns:///localhost:2")


def test_router_values_that_cannot_work_are_refused():
    assert routers.channel_target("10.0.0.1:1,10.0.0.2:1") == "ipv4:10.0.0.1:1,10.0.0.2:1"
    assert routers.channel_target("[::1]:1,[::2]:1") == "ipv6:[::1]:1,[::2]:1"
    assert routers.channel_target("dns:///router:50051") == "dns:///router:50051"
    for bad in ("", "router", "a.example:1,b.example:1", "10.0.0.1:1,[::1]:1"):
        with pytest.raises(ValueError):
            routers.channel_target(bad)
