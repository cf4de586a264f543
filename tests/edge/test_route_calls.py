"""The edge's Route over one open call to a real router (services/edge/route_calls.py)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve import telemetry
from pdserve.config import RouterConfig
from pdserve.rpc import Server, channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.services.edge.route_calls import RouteCalls
from pdserve.services.router.server import RouterService

DECODE = common_pb2.WORKER_ROLE_DECODE


class CountingRouter(RouterService):
    """The real service, counting the calls it is asked."""

    def __init__(self):
        super().__init__(RouterConfig(port=0, local_prefill_below_tokens=32))
        self.unary = self.streams = self.messages = 0

    async def Route(self, request, context):
        self.unary += 1
        return await super().Route(request, context)

    async def RouteStream(self, request_iterator, context):
        self.streams += 1

        async def counted():
            async for batch in request_iterator:
                self.messages += 1
                yield batch
        async for answers in super().RouteStream(counted(), context):
            yield answers


class SilentRouter(CountingRouter):
    """Takes the requests and never answers."""

    async def RouteStream(self, request_iterator, context):
        self.streams += 1
        async for _ in request_iterator:
            pass
        if False:                           # an async generator that yields nothing
            yield


async def _serve(service: RouterService, port: int = 0) -> Server:
    server = Server("127.0.0.1", port, lambda s: router_pb2_grpc.add_RouterServicer_to_server(
        service, s), ["pdserve.v1.Router"])
    await server.start()
    return server


def _without_route_stream(service: RouterService, server: grpc.aio.Server) -> None:
    """The Router service as a router from before RouteStream serves it: Route only."""
    route = grpc.unary_unary_rpc_method_handler(
        service.Route, request_deserializer=router_pb2.RouteRequest.FromString,
        response_serializer=router_pb2.RouteDecision.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "pdserve.v1.Router", {"Route": route}),))


async def _with_decode_worker(service: RouterService) -> None:
    await service.Register(router_pb2.RegisterRequest(worker=router_pb2.WorkerInfo(
        worker_id="d0", role=DECODE, address="127.0.0.1:1", model="m", serving=True)), None)


def _request(rid: str, **kw) -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(request_id=rid, model="m", prompt_tokens=8, **kw)


@pytest.fixture
async def routed():
    """A real router on a free port, with one decode worker, and RouteCalls to it."""
    service = CountingRouter()
    await _with_decode_worker(service)
    server = await _serve(service)
    ch = channel(f"127.0.0.1:{server.port}")
    calls = RouteCalls(ch)
    yield calls, service, server
    await calls.close()
    await ch.close()
    await server.stop(0)


async def test_concurrent_routes_share_one_call_and_each_gets_its_answer(routed):
    calls, service, _ = routed
    # Every fifth asks for a model no worker serves: it alone fails, in its place.
    requests = [router_pb2.RouteRequest(request_id=f"r{i}", model="other" if i % 5 == 0
                                        else "m", prompt_tokens=8) for i in range(50)]
    got = await asyncio.gather(*(calls.Route(r, timeout=5) for r in requests),
                               return_exceptions=True)
    assert [type(g).__name__ for g in got] == [
        "AioRpcError" if i % 5 == 0 else "RouteDecision" for i in range(50)]
    assert {g.code() for g in got[::5]} == {grpc.StatusCode.UNAVAILABLE}
    assert (service.streams, service.unary) == (1, 0)
    # Requests queued together went in one message (a write each costs a call's worth).
    assert service.messages <= 5
    # Each was counted as a placement on the worker, as a unary Route is.
    assert service.registry.workers["d0"].pending == 40


async def test_a_request_that_cannot_be_placed_fails_alone(routed):
    calls, service, _ = routed
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await calls.Route(router_pb2.RouteRequest(request_id="x", model="other"), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "other" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await calls.Route(_request("y", prompt_token_ids_packed=b"\x01\x00\x00"), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "4 bytes" in e.value.details()
    ok = await calls.Route(_request("z"), timeout=5)
    assert ok.decode.worker_id == "d0" and service.streams == 1


async def test_a_router_without_route_stream_gets_a_call_per_request():
    service = CountingRouter()
    await _with_decode_worker(service)
    server = Server("127.0.0.1", 0, lambda s: _without_route_stream(service, s),
                    ["pdserve.v1.Router"])
    await server.start()
    ch = channel(f"127.0.0.1:{server.port}")
    calls = RouteCalls(ch)
    try:
        first = await asyncio.gather(*(calls.Route(_request(f"r{i}"), timeout=5)
                                       for i in range(3)))
        later = await calls.Route(_request("later"), timeout=5)
        assert [d.decode.worker_id for d in [*first, later]] == ["d0"] * 4
        assert not calls.streamed and service.unary == 4
    finally:
        await calls.close()
        await ch.close()
        await server.stop(0)


async def test_an_unanswered_route_ends_at_its_deadline():
    service = SilentRouter()
    server = await _serve(service)
    ch = channel(f"127.0.0.1:{server.port}")
    calls = RouteCalls(ch)
    try:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await calls.Route(_request("r"), timeout=0.3)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.25 < loop.time() - began < 2.0
        assert calls._call is not None and not calls._call.waiting
    finally:
        await calls.close()
        await ch.close()
        await server.stop(0)


async def test_a_router_that_restarts_fails_the_waiting_and_serves_the_next(routed):
    calls, service, server = routed
    await calls.Route(_request("before"), timeout=5)
    port = server.port
    await server.stop(0)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await calls.Route(_request("while-down"), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    again = CountingRouter()
    await _with_decode_worker(again)
    restarted = await _serve(again, port)
    try:
        for attempt in range(50):           # the channel reconnects with its backoff
            try:
                decision = await calls.Route(_request(f"after{attempt}"), timeout=5)
                break
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                await asyncio.sleep(0.1)
        assert decision.decode.worker_id == "d0" and again.streams == 1
    finally:
        await restarted.stop(0)


async def test_with_tracing_on_each_route_is_a_call_of_its_own(routed, monkeypatch):
    calls, service, _ = routed
    monkeypatch.setattr(telemetry, "enabled", lambda: True)
    decision = await calls.Route(_request("traced"), timeout=5)
    assert decision.decode.worker_id == "d0" and (service.unary, service.streams) == (1, 0)


async def test_a_router_bug_on_one_request_fails_that_request_alone(routed, monkeypatch):
    calls, service, _ = routed
    decide = service.decide

    def broken(request):
        if request.request_id == "bad":
            raise RuntimeError("a bug")
        return decide(request)
    monkeypatch.setattr(service, "decide", broken)
    got = await asyncio.gather(calls.Route(_request("bad"), timeout=5),
                               calls.Route(_request("good"), timeout=5), return_exceptions=True)
    assert isinstance(got[0], grpc.aio.AioRpcError) and got[0].code() == grpc.StatusCode.INTERNAL
    assert got[1].decode.worker_id == "d0" and service.streams == 1


@pytest.mark.parametrize("traced", [False, True], ids=["open-call", "unary"])
async def test_routes_under_load_survive_a_replica_stopping(traced, monkeypatch):
    """Two replicas, the edge's channel on the first; it stops gracefully (as on SIGTERM)
    under a steady load of Routes: every Route gets its decision, the later ones from the
    second replica. A stopping gRPC server cancels the calls it takes as it stops (seen as
    CANCELLED by ~6 in 1,500 unary Routes here before they were asked again)."""
    if traced:
        monkeypatch.setattr(telemetry, "enabled", lambda: True)
    first, second = CountingRouter(), CountingRouter()
    servers = []
    for service in (first, second):
        await _with_decode_worker(service)
        servers.append(await _serve(service))
    ch = channel("ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers))
    calls, stopped, failed, done = RouteCalls(ch), asyncio.Event(), [], [0]

    async def client(n: int):
        for i in range(10_000):
            if stopped.is_set() and second.unary + second.messages >= 50:
                return
            try:
                await calls.Route(_request(f"{n}-{i}"), timeout=5)
                done[0] += 1
            except grpc.aio.AioRpcError as e:
                failed.append(e.code().name)

    async def stop():
        while done[0] < 200:
            await asyncio.sleep(0.01)
        await servers[0].stop(2.0)
        stopped.set()

    try:
        await asyncio.wait_for(asyncio.gather(*[client(n) for n in range(8)], stop()), 30)
        assert not failed, failed[:5]
        assert done[0] >= 250 and second.unary + second.messages >= 50
    finally:
        await calls.close()
        await ch.close()
        for server in servers:
            await server.stop(0)
