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

Each live worker is also followed over `SubscribeKvEvents` (the engines' block
size asked first with `GetServerInfo`, while the index has none): its engine's
stored/evicted blocks keep the router's prefix index, and the load record on
every batch (running + waiting requests, sent at each scheduler step, when a
request ends on a pdserve worker, and as a heartbeat when idle) keeps its load
current and tells the router when requests finish. A worker whose feed has not
sent a load record (no events published: UNIMPLEMENTED, or not yet) has its load
read with `GetLoads` once per round.
A feed that breaks (UNAVAILABLE) takes its worker out of the registry at once:
a dead worker stops being offered within milliseconds, not a heartbeat timeout,
and the next round runs at once (a named worker that is still up is back as soon
as it answers its probe).
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from pdserve.rpc import channel
from pdserve.v1 import router_pb2
from pdserve.transfer.params import CONTINUES_PREFILL

from .prefix_index import PrefixIndex
from .registry import ROLE_NAMES, WorkerEntry, WorkerRegistry

log = logging.getLogger("pdserve.router")

ROLES = {name: role for role, name in ROLE_NAMES.items()}
MIN_ROUND_SECONDS = 0.2         # the least time between two rounds' starts


class EngineProbes:
    """Probes static workers into the registry and refreshes every worker's load."""

    def __init__(self, registry: WorkerRegistry, static: list[tuple[str, str]],
                 interval: float, index: PrefixIndex | None = None):
        self.registry = registry
        self.static = static
        self.interval = interval
        self.index = index if index is not None else PrefixIndex()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._models: dict[str, str] = {}
        self._continues: dict[str, bool] = {}     # address -> WorkerInfo.continues_prefill
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._feeds: dict[str, asyncio.Task] = {}          # worker id -> its event stream
        self._no_events: set[str] = set()                   # workers that publish none

    def _stub(self, address: str) -> vllm_engine_pb2_grpc.VllmEngineStub:
        if address not in self._channels:
            self._channels[address] = channel(address)
        return vllm_engine_pb2_grpc.VllmEngineStub(self._channels[address])

    def start(self) -> None:
        """Begin probing in the background."""
        self._task = asyncio.create_task(self._run(), name="engine-probes")

    def wake(self) -> None:
        """Run the next round now (a worker joined: follow its events from its first
        request on, not from the next round)."""
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            self._wake.clear()
            await self.round()
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
            # Woken rounds are spaced too: a feed that breaks as soon as it opens on a
            # worker that answers its probe must not spin the loop.
            await asyncio.sleep(max(0.0, began + MIN_ROUND_SECONDS - loop.time()))

    async def round(self) -> None:
        """Probe every static worker; follow every live worker's events (or read its load)."""
        await asyncio.gather(*(self.probe(role, address) for role, address in self.static))
        live = {e.info.worker_id: e for role in ROLE_NAMES for e in self.registry.serving(role)}
        for wid in [w for w in self._feeds if w not in live]:
            self._feeds.pop(wid).cancel()               # gone: its cache is no use to anyone
            self.index.forget(wid)
        for wid, entry in live.items():
            if wid not in self._feeds and wid not in self._no_events:
                self._feeds[wid] = asyncio.create_task(self._follow(entry),
                                                       name=f"kv-events-{wid}")
        await asyncio.gather(*(self.read_load(e) for e in live.values()
                               if not e.load_pushed))

    async def _follow(self, entry: WorkerEntry) -> None:
        """Apply one worker's KV events and load records until its stream ends."""
        wid = entry.info.worker_id
        stub = self._stub(entry.info.address)
        if not self.index.block_size:
            await self._learn_block_size(stub, wid)
        call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
            load_records_before_first_batch=True))
        log.info("following the KV events of %s", wid)
        try:
            async for batch in call:
                if batch.HasField("load"):
                    entry.reported(batch.load.running_requests + batch.load.waiting_requests,
                                   batch.load.max_running_requests, batch.load.token_usage)
                    # Once the publisher has sent a batch, records come at every change;
                    # before it (load-only, numbered 0) only as requests end: polled still.
                    if batch.events or batch.sequence_number or not batch.load.load_only:
                        entry.load_pushed = True
                for event in batch.events:
                    self._apply(wid, event)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("worker %s publishes no KV events; polling GetLoads", wid)
                self._no_events.add(wid)
            elif e.code() == grpc.StatusCode.UNAVAILABLE:
                # The connection broke: the worker died or its host went away. Stop
                # offering it now rather than after its heartbeat timeout; a worker that
                # is still alive registers again with its next heartbeat.
                if self.registry.deregister(wid):
                    log.warning("worker gone: %s (its KV-event stream broke)", wid)
                # The next round runs now, not an interval later: a named worker whose
                # connection alone broke (a proxy dropped it, it restarted in place)
                # answers its probe and serves again within milliseconds; until then
                # requests find no worker there.
                self.wake()
            else:
                log.warning("KV events of %s ended: %s", wid, e.code().name)
        finally:
            entry.load_pushed = False
            self.index.forget(wid)          # the next subscription starts from its state
            if self._feeds.get(wid) is asyncio.current_task():
                del self._feeds[wid]

    async def _learn_block_size(self, stub, wid: str) -> None:
        """The engines' block size from a worker's `GetServerInfo`, so that prompts are
        keyed from the first request on (the first stored block would tell it too, but
        only once a prompt has filled one: until then a fresh router's first requests,
        a shared system prompt's among them, were placed blind and scattered)."""
        try:
            info = await stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as e:
            log.debug("no server info from %s: %s", wid, e.code().name)
            return
        if info.block_size > 0 and not self.index.block_size:
            self.index.block_size = info.block_size
            log.info("block size %d (from %s)", info.block_size, wid)

    def _apply(self, worker: str, event: common_pb2.KvCacheEvent) -> None:
        kind = event.WhichOneof("data")
        if kind == "stored":
            s = event.stored
            self.index.stored(worker, s.parent_block_hash if s.HasField("parent_block_hash")
                              else None, [(b.block_hash, list(b.token_ids), block_salt(b))
                                          for b in s.blocks])
        elif kind == "removed":
            self.index.removed(worker, event.removed.block_hashes)
        elif kind == "cleared":
            self.index.forget(worker)

    async def probe(self, role: str, address: str) -> bool:
        """One health probe; True when the worker answered healthy (and is routable)."""
        stub = self._stub(address)
        try:
            health = await stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=2.0)
            if address not in self._models:
                info = await stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=2.0)
                self._continues[address] = role == "decode" and await self._continues_prefill(
                    address)
                self._models[address] = info.served_model_name or info.model_path
        except grpc.aio.AioRpcError as e:
            log.debug("probe of %s worker %s failed: %s", role, address, e.code().name)
            # What it serves and can do is asked again once it answers: a worker restarted
            # at this address may serve another model or move KV another way.
            self._models.pop(address, None)
            return False
        worker = router_pb2.WorkerInfo(worker_id=f"{role}@{address}", role=ROLES[role],
                                       address=address, model=self._models[address],
                                       serving=health.healthy,
                                       continues_prefill=self._continues[address])
        if self.registry.register(worker) and health.healthy:
            log.info("worker up: %s %s (static) model=%s", role, address, worker.model)
        elif not health.healthy:
            log.warning("%s worker %s reports unhealthy: %s", role, address, health.message)
        return health.healthy

    async def _continues_prefill(self, address: str) -> bool:
        """Whether the decode worker says, by gRPC health, that its engine goes on past a
        prefill's KV (pdserve's workers do; a stock engine has no such name)."""
        try:
            resp = await health_pb2_grpc.HealthStub(self._channels[address]).Check(
                health_pb2.HealthCheckRequest(service=CONTINUES_PREFILL), timeout=2.0)
        except grpc.aio.AioRpcError:
            return False                    # NOT_FOUND, or no health service at all
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def read_load(self, entry: WorkerEntry) -> None:
        """Requests running + waiting on the worker's engine (unchanged when unreadable)."""
        try:
            resp = await self._stub(entry.info.address).GetLoads(
                vllm_engine_pb2.GetLoadsRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return
        if entry.load_pushed:
            return                          # its event stream reported meanwhile: newer
        entry.reported(sum(s.num_running_reqs + s.num_waiting_reqs for s in resp.loads),
                       sum(s.max_running_requests for s in resp.loads),
                       max((s.token_usage for s in resp.loads), default=0.0))

    async def stop(self) -> None:
        """Stop probing and following, and close the channels."""
        for task in [self._task, *self._feeds.values()]:
            if task:
                task.cancel()
        for ch in self._channels.values():
            await ch.close()


def block_salt(block: common_pb2.KvBlock) -> str:
    """The cache salt the engine folded into a stored block's hash, or "": vLLM
    publishes a block's extra keys untagged, and a pdserve worker's only text one is
    the salt (it serves no LoRA adapters)."""
    texts = [k.text for k in block.extra_keys if k.WhichOneof("key") == "text"]
    return texts[-1] if texts else ""
