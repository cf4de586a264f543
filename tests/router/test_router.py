"""The router over real gRPC: registration, liveness, placement."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2 as common_pb2_smg

from pdserve.config import RouterConfig
from pdserve.rpc import Server, channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.services.router.placement import Policy, place
from pdserve.services.router.registry import WorkerRegistry
from pdserve.services.router.server import RouterService
from pdserve.services.router.keystore import block_keys
from pdserve.services.router.probes import MIN_ROUND_SECONDS, EngineProbes

PREFILL, DECODE = common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE


def _worker(wid: str, role: int, model: str = "m") -> router_pb2.WorkerInfo:
    return router_pb2.WorkerInfo(worker_id=wid, role=role, address=f"127.0.0.1:{hash(wid) % 999 + 1}",
                                 model=model, serving=True)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def router():
    """A real router gRPC server on a free port and a stub to it."""
    service = RouterService(RouterConfig(port=0, local_prefill_below_tokens=32))
    server = Server("127.0.0.1", 0, lambda s: router_pb2_grpc.add_RouterServicer_to_server(
        service, s), ["pdserve.v1.Router"])
    await server.start()
    ch = channel(f"127.0.0.1:{server.port}")
    yield router_pb2_grpc.RouterStub(ch), service
    await ch.close()
    await server.stop(0)


async def test_route_disaggregated_then_local_for_short_prompts(router):
    stub, _ = router
    for w in (_worker("p0", PREFILL), _worker("d0", DECODE)):
        await stub.Register(router_pb2.RegisterRequest(worker=w))
    long = await stub.Route(router_pb2.RouteRequest(request_id="r1", model="m", prompt_tokens=500))
    assert (long.decode.worker_id, long.prefill.worker_id, long.local_prefill) == ("d0", "p0", False)
    short = await stub.Route(router_pb2.RouteRequest(request_id="r2", model="m", prompt_tokens=5))
    assert short.local_prefill and not short.HasField("prefill") and short.decode.worker_id == "d0"


async def test_no_decode_worker_is_unavailable(router):
    stub, _ = router
    await stub.Register(router_pb2.RegisterRequest(worker=_worker("p0", PREFILL)))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Route(router_pb2.RouteRequest(request_id="r", model="m", prompt_tokens=500))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_packed_token_ids_of_a_broken_length_are_invalid(router):
    stub, _ = router
    await stub.Register(router_pb2.RegisterRequest(worker=_worker("d0", DECODE)))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Route(router_pb2.RouteRequest(request_id="r", model="m",
                                                 prompt_token_ids_packed=b"\x01\x00\x00"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "4 bytes" in e.value.details()


async def test_register_rejects_incomplete_worker(router):
    stub, _ = router
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Register(router_pb2.RegisterRequest(worker=router_pb2.WorkerInfo(worker_id="x")))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_deregistered_worker_is_not_routed(router):
    stub, _ = router
    for w in (_worker("d0", DECODE), _worker("d1", DECODE)):
        await stub.Register(router_pb2.RegisterRequest(worker=w))
    await stub.Deregister(router_pb2.DeregisterRequest(worker_id="d0"))
    listed = await stub.ListWorkers(router_pb2.ListWorkersRequest())
    assert [w.worker_id for w in listed.workers] == ["d1"]
    for i in range(5):
        d = await stub.Route(router_pb2.RouteRequest(request_id=str(i), model="m", prompt_tokens=5))
        assert d.decode.worker_id == "d1"


def test_missed_heartbeats_take_a_worker_out_until_it_returns():
    clock = FakeClock()
    reg = WorkerRegistry(timeout=6.0, clock=clock)
    assert reg.register(_worker("d0", DECODE))
    clock.now = 7.0
    assert reg.serving(DECODE) == []
    assert [w.serving for w in reg.snapshot()] == [False]
    assert reg.register(_worker("d0", DECODE))  # back: reported as fresh
    assert [e.info.worker_id for e in reg.serving(DECODE)] == ["d0"]
    clock.now = 7.0 + 61
    assert reg.snapshot() == []  # silent for 10 timeouts: forgotten


def test_sessions_stick_to_one_decode_worker_and_move_only_when_it_goes():
    reg = WorkerRegistry(timeout=6.0, clock=FakeClock())
    for i in range(4):
        reg.register(_worker(f"d{i}", DECODE))
    req = lambda s, ex=(): router_pb2.RouteRequest(session_id=s, model="m", prompt_tokens=5,
                                                   exclude_workers=list(ex))
    first = {s: place(reg, req(s), Policy())[0].decode.worker_id for s in map(str, range(200))}
    again = {s: place(reg, req(s), Policy())[0].decode.worker_id for s in map(str, range(200))}
    assert first == again and len(set(first.values())) == 4
    without = {s: place(reg, req(s, ["d0"]), Policy())[0].decode.worker_id for s in first}
    moved = [s for s in first if first[s] != without[s]]
    assert moved and all(first[s] == "d0" for s in moved)


def test_requests_without_session_spread_over_workers():
    reg = WorkerRegistry(timeout=6.0, clock=FakeClock())
    for i in range(3):
        reg.register(_worker(f"d{i}", DECODE))
    seen = []
    for _ in range(6):
        _, decode, _ = place(reg, router_pb2.RouteRequest(model="m", prompt_tokens=5), Policy())
        decode.routed += 1
        seen.append(decode.info.worker_id)
    assert sorted(seen) == ["d0", "d0", "d1", "d1", "d2", "d2"]


def test_model_mismatch_is_not_routed():
    reg = WorkerRegistry(timeout=6.0, clock=FakeClock())
    reg.register(_worker("d0", DECODE, model="other"))
    assert reg.serving(DECODE, "m") == []


class FakeEngine(vllm_engine_pb2_grpc.VllmEngineServicer):
    """vLLM's engine protocol, health and model info only: a stock engine as the router sees it."""

    def __init__(self):
        self.healthy = True
        self.running, self.waiting = 0, 0

    async def HealthCheck(self, request, context):
        return vllm_engine_pb2.HealthCheckResponse(healthy=self.healthy, message="test")

    async def GetModelInfo(self, request, context):
        return vllm_engine_pb2.GetModelInfoResponse(served_model_name="m", model_path="/m")

    async def GetLoads(self, request, context):
        return vllm_engine_pb2.GetLoadsResponse(loads=[vllm_engine_pb2.SchedulerLoad(
            num_running_reqs=self.running, num_waiting_reqs=self.waiting)])


async def _engine_server(engine, names: Sequence[str] = (), port: int = 0) -> Server:
    """`engine` serving vLLM's engine protocol on loopback (`names` in its health), started."""
    server = Server("127.0.0.1", port, lambda s: vllm_engine_pb2_grpc.
                    add_VllmEngineServicer_to_server(engine, s), list(names))
    await server.start()
    return server


async def test_static_workers_are_probed_into_the_registry_and_age_out():
    engine = FakeEngine()
    server = await _engine_server(engine, ["vllm.grpc.engine.VllmEngine"])
    clock = FakeClock()
    registry = WorkerRegistry(timeout=6.0, clock=clock)
    address = f"127.0.0.1:{server.port}"
    static = EngineProbes(registry, [("decode", address)], interval=2.0)
    try:
        assert await static.probe("decode", address)
        [entry] = registry.serving(DECODE, "m")
        assert entry.info.worker_id == f"decode@{address}" and entry.info.address == address
        engine.healthy = False
        assert not await static.probe("decode", address)
        assert registry.serving(DECODE, "m") == []
        assert [w.serving for w in registry.snapshot()] == [False]
        engine.healthy = True
        assert await static.probe("decode", address)
        await server.stop(0)
        assert not await static.probe("decode", address)   # unreachable: not refreshed
        clock.now += 7.0
        assert registry.serving(DECODE, "m") == []
    finally:
        await static.stop()
        await server.stop(0)


async def test_a_static_decode_worker_says_by_health_whether_it_goes_on_after_a_prefill():
    """pdserve's pull decode workers answer SERVING for CONTINUES_PREFILL; a stock
    engine knows no such name: only the first is offered the prefill's token."""
    from pdserve.transfer.params import CONTINUES_PREFILL
    servers = [await _engine_server(FakeEngine(), ["vllm.grpc.engine.VllmEngine", *names])
               for names in ([CONTINUES_PREFILL], [])]
    registry = WorkerRegistry(timeout=6.0)
    addresses = [f"127.0.0.1:{server.port}" for server in servers]
    static = EngineProbes(registry, [("decode", a) for a in addresses], interval=600.0)
    try:
        for address in addresses:
            assert await static.probe("decode", address)
        got = {e.info.address: e.info.continues_prefill for e in registry.serving(DECODE, "m")}
        assert got == {addresses[0]: True, addresses[1]: False}
        # The first restarts at its address without the capability (push mode, say):
        # once it answers again, it is asked again.
        port = servers[0].port
        await servers[0].stop(0)
        assert not await static.probe("decode", addresses[0])
        servers[0] = await _engine_server(FakeEngine(), ["vllm.grpc.engine.VllmEngine"], port)
        for _ in range(50):                 # the channel reconnects after its backoff
            if await static.probe("decode", addresses[0]):
                break
            await asyncio.sleep(0.2)
        [entry] = [e for e in registry.serving(DECODE, "m") if e.info.address == addresses[0]]
        assert not entry.info.continues_prefill
    finally:
        await static.stop()
        for server in servers:
            await server.stop(0)


def test_static_worker_addresses_are_checked():
    with pytest.raises(ValueError, match="HOST:PORT"):
        RouterConfig(static_workers=(("decode", "no-port"),))
    with pytest.raises(ValueError, match="prefill/decode"):
        RouterConfig(static_workers=(("edge", "127.0.0.1:1"),))


async def test_placement_prefers_the_engine_with_fewer_requests_by_getloads():
    engines = [FakeEngine(), FakeEngine()]
    servers = [await _engine_server(e) for e in engines]
    registry = WorkerRegistry(timeout=6.0)
    static = [("decode", f"127.0.0.1:{s.port}") for s in servers]
    probes = EngineProbes(registry, static, interval=2.0)
    try:
        engines[0].running, engines[0].waiting = 3, 2
        engines[1].running = 1
        await probes.round()
        req = router_pb2.RouteRequest(request_id="r", model="m", prompt_tokens=5)
        for _ in range(3):   # the busy one is never picked while its load stays higher
            decision, decode, _ = place(registry, req, Policy())
            decode.routed += 1
            assert decision.decode.address == static[1][1]
        engines[0].running, engines[0].waiting = 0, 0
        await probes.round()
        assert place(registry, req, Policy())[0].decode.address == static[0][1]
    finally:
        await probes.stop()
        for server in servers:
            await server.stop(0)


class EventingEngine(FakeEngine):
    """Publishes one stored-blocks batch with a load record, like vLLM's servicer."""

    def __init__(self, tokens: list[int]):
        super().__init__()
        self.tokens = tokens

    async def SubscribeKvEvents(self, request, context):
        blocks = [common_pb2_smg.KvBlock(block_hash=100 + i, token_ids=self.tokens[i * 4:i * 4 + 4],
                                         block_size=4) for i in range(len(self.tokens) // 4)]
        yield common_pb2_smg.KvEventBatch(
            sequence_number=1, events=[common_pb2_smg.KvCacheEvent(
                event_id=1, stored=common_pb2_smg.KvBlocksStored(blocks=blocks))],
            load=common_pb2_smg.EngineLoad(running_requests=2, waiting_requests=1))
        await asyncio.sleep(30)


@contextlib.asynccontextmanager
async def _followed(engines, registry_timeout: float):
    """Engines probed and followed until the router knows their block size (from their
    first published blocks, or their server info): (servers, registry, probes)."""
    servers = [await _engine_server(e) for e in engines]
    registry = WorkerRegistry(timeout=registry_timeout)
    probes = EngineProbes(registry, [("decode", f"127.0.0.1:{s.port}") for s in servers],
                          interval=600.0)
    try:
        await probes.round()
        for _ in range(50):
            if probes.index.block_size:
                break
            await asyncio.sleep(0.05)
        yield servers, registry, probes
    finally:
        await probes.stop()
        for server in servers:
            await server.stop(0)


async def test_kv_events_feed_the_prefix_index_and_the_load():
    tokens = list(range(40, 72))
    async with _followed([EventingEngine(tokens)], registry_timeout=6.0) as (_, registry, probes):
        [entry] = registry.serving(DECODE, "m")
        assert entry.load == 3 and probes.index.block_size == 4
        keys = block_keys(tokens + [1, 2], 4)
        assert probes.index.matched_blocks(keys, [entry.info.worker_id]) == {
            entry.info.worker_id: 8}
    assert probes.index.blocks_held(entry.info.worker_id) == 0     # forgotten when it ended


async def test_a_worker_whose_event_stream_breaks_is_dropped_at_once():
    # A registry timeout of 10 minutes: only the broken stream can drop it in time.
    async with _followed([EventingEngine(list(range(40, 72)))], registry_timeout=600.0) as (
            [server], registry, _):
        assert len(registry.serving(DECODE, "m")) == 1
        await server.stop(0)                              # the worker goes away mid-stream
        for _ in range(100):
            if not registry.serving(DECODE, "m"):
                break
            await asyncio.sleep(0.02)
        assert registry.serving(DECODE, "m") == []


class EarlyRecordEngine(FakeEngine):
    """Sends one load record before its publisher's first batch (load-only, numbered 0,
    as `load_records_before_first_batch` asks), and nothing else."""

    async def SubscribeKvEvents(self, request, context):
        assert request.load_records_before_first_batch
        yield common_pb2_smg.KvEventBatch(sequence_number=0, load=common_pb2_smg.EngineLoad(
            running_requests=2, load_only=True))
        await asyncio.sleep(30)


async def test_a_record_before_the_first_batch_counts_but_the_load_is_still_polled():
    async with _followed([EarlyRecordEngine()], registry_timeout=6.0) as (_, registry, _p):
        for _ in range(50):
            [entry] = registry.serving(DECODE, "m")
            if entry.load == 2:
                break
            await asyncio.sleep(0.02)
        # Its placements are covered, but only request ends come this way until the
        # publisher's first batch: GetLoads still reads its load each round.
        assert entry.load == 2 and not entry.load_pushed


class DroppingEngine(FakeEngine):
    """Answers its probes but ends every KV-event stream at once with UNAVAILABLE (a
    connection that broke while the engine stayed up), or only the first `drops`."""

    def __init__(self, drops: int | None = None):
        super().__init__()
        self.drops, self.subscribed = drops, 0

    async def SubscribeKvEvents(self, request, context):
        self.subscribed += 1
        if self.drops is None or self.subscribed <= self.drops:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        await asyncio.sleep(30)
        yield common_pb2_smg.KvEventBatch()


async def _started(engine, registry: WorkerRegistry) -> tuple[Server, EngineProbes]:
    server = await _engine_server(engine)
    probes = EngineProbes(registry, [("decode", f"127.0.0.1:{server.port}")], interval=600.0)
    probes.start()
    return server, probes


async def test_a_named_worker_whose_stream_alone_broke_is_back_at_once():
    """The broken stream drops the worker; it is probed again at once, not at the next
    round (10 minutes here), and serves again while its new stream stays open."""
    engine, registry = DroppingEngine(drops=1), WorkerRegistry(timeout=600.0)
    server, probes = await _started(engine, registry)
    try:
        for _ in range(100):
            if engine.subscribed == 2 and registry.serving(DECODE, "m"):
                break
            await asyncio.sleep(0.02)
        assert engine.subscribed == 2 and len(registry.serving(DECODE, "m")) == 1
    finally:
        await probes.stop()
        await server.stop(0)


async def test_a_stream_that_always_breaks_is_reopened_at_a_bounded_rate():
    engine = DroppingEngine()
    server, probes = await _started(engine, WorkerRegistry(timeout=600.0))
    try:
        await asyncio.sleep(1.0)
        # One round per MIN_ROUND_SECONDS (0.2 s) at most: about 5, never a spin.
        assert 2 <= engine.subscribed <= 1.0 / MIN_ROUND_SECONDS + 2
    finally:
        await probes.stop()
        await server.stop(0)


class QuietEngine(FakeEngine):
    """An engine that has published no block yet, but tells its block size."""

    async def GetServerInfo(self, request, context):
        return vllm_engine_pb2.GetServerInfoResponse(block_size=4)

    async def SubscribeKvEvents(self, request, context):
        await asyncio.sleep(30)
        yield common_pb2_smg.KvEventBatch()


async def test_a_fresh_router_keys_prompts_before_any_block_is_published():
    """Until an engine publishes a block, only `GetServerInfo` tells the block size:
    without it the first requests of a shared prompt were placed blind (by session
    alone) and scattered over the workers."""
    async with _followed([QuietEngine(), QuietEngine()], registry_timeout=60.0) as (
            _, registry, probes):
        assert probes.index.block_size == 4
        shared = list(range(100, 140))
        first, _, _ = place(registry, router_pb2.RouteRequest(
            request_id="r0", model="m", session_id="s0", prompt_token_ids=shared + [1]),
            Policy(), probes.index)
        for i in range(1, 9):       # other sessions, the same system prompt
            d, _, _ = place(registry, router_pb2.RouteRequest(
                request_id=f"r{i}", model="m", session_id=f"s{i}",
                prompt_token_ids=shared + [i, i]), Policy(), probes.index)
            assert d.decode.worker_id == first.decode.worker_id and d.cached_tokens == 40


async def test_two_router_replicas_fed_the_same_reports_decide_alike():
    """What a replica places depends only on the workers' reports (and, until the engines
    report them, on the prompts it placed itself): two replicas following the same
    engines, asked the same requests, give the same answers."""
    published = {"a": list(range(40, 72)), "b": list(range(200, 232))}
    servers = {}
    for name, tokens in published.items():
        servers[name] = await _engine_server(EventingEngine(tokens))
    static = [("decode", f"127.0.0.1:{s.port}") for s in servers.values()]
    replicas = [EngineProbes(WorkerRegistry(timeout=60.0), static, interval=600.0)
                for _ in range(2)]
    try:
        for probes in replicas:
            await probes.round()
            for _ in range(100):
                if all(probes.index.blocks_held(f"decode@{a}") for _, a in static):
                    break
                await asyncio.sleep(0.05)
        requests = ([published["a"] + [1, 2], published["b"] + [3]]
                    + [[i] * 20 + published["a"] for i in range(6)])
        answers = []
        for probes in replicas:
            answers.append([
                (d.decode.worker_id, d.local_prefill, d.reason, d.cached_tokens)
                for d, _, _ in (place(probes.registry, router_pb2.RouteRequest(
                    model="m", prompt_token_ids=ids, session_id=f"s{i % 3}"),
                    Policy(), probes.index) for i, ids in enumerate(requests))])
        assert answers[0] == answers[1]
        assert answers[0][0][0] == f"decode@{static[0][1]}" and answers[0][0][3] == 32
        assert answers[0][1][0] == f"decode@{static[1][1]}"
    finally:
        for probes in replicas:
            await probes.stop()
        for s in servers.values():
            await s.stop(0)
