"""Which workers exist and whether they are serving.

Workers register and then re-register every heartbeat; a worker that misses
heartbeats for `timeout` seconds stops being offered to requests but stays
listed (so /health can say what is missing).
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque

from pdserve import native
from pdserve.v1 import common_pb2, router_pb2

PENDING_SECONDS = 1.0
# No engine runs or queues this many requests: a larger count (or a negative one, which
# `GetLoads`' signed fields allow) is a broken report, and counts as this, a worker full
# to the brim. Placement then sends it nothing while another worker has room, and the
# count still fits `WorkerInfo.load` (uint32) in the router's snapshot.
LOAD_LIMIT = 1 << 20

log = logging.getLogger("pdserve.router")


class PyWorker:
    """A worker's load as the router accounts it: the Python reference of the C
    `_placement.Worker` (what runs where pdserve.native picks the Python), and
    `WorkerEntry`'s base either way. Plain fields, so that a native decision reads
    them without Python."""

    __slots__ = ("_worker_id", "seed", "model", "role", "serving", "load_pushed",
                 "last_seen", "load", "routed", "_placed_at")

    def __init__(self) -> None:
        self.worker_id, self.model, self.role, self.serving = "", "", 0, False
        self.load_pushed, self.last_seen, self.load, self.routed = False, 0.0, 0, 0
        self._placed_at: deque[float] = deque()      # when each pending one was placed

    @property
    def worker_id(self) -> str:
        return self._worker_id

    @worker_id.setter
    def worker_id(self, value: str) -> None:
        self._worker_id, self.seed = value, name_hash(value)

    @property
    def pending(self) -> int:
        """Placements not yet in a load report."""
        return len(self._placed_at)

    def placed(self, now: float) -> None:
        """One more request placed here, not yet in a load report."""
        self._placed_at.append(now)
        self.routed += 1

    def clear_pending(self) -> None:
        """A load report covers every placement so far."""
        self._placed_at.clear()

    def decay(self, now: float, horizon: float) -> None:
        """Placements older than `horizon` stop counting."""
        placed = self._placed_at
        while placed and now - placed[0] > horizon:
            placed.popleft()


def name_hash(name: str) -> int:
    """FNV-1a over the UTF-8 bytes: a worker's rendezvous seed, a session's hash."""
    h = 0xCBF29CE484222325
    for b in name.encode():
        h = (h ^ b) * 0x100000001B3 & 0xFFFFFFFFFFFFFFFF
    return h


_C = native.load("placement")
Worker = PyWorker if _C is None else _C.Worker


class WorkerEntry(Worker):
    """One registered worker: its `info` as it registered, and its load."""

    __slots__ = ("info", "capacity", "kv_usage", "_warned")

    def __init__(self, info: router_pb2.WorkerInfo, last_seen: float):
        super().__init__()
        self.last_seen = last_seen
        self.capacity = 0                # requests its engine runs at once; 0 unknown
        self.kv_usage = 0.0              # fraction of its KV cache in use
        self._warned = False             # about a broken load report, once
        self.set_info(info)

    def __repr__(self) -> str:
        return (f"WorkerEntry({self.worker_id!r}, role={self.role}, load={self.load}"
                f"+{self.pending}, routed={self.routed})")

    def set_info(self, info: router_pb2.WorkerInfo) -> None:
        # What placement reads of `info` is copied out of it: a protobuf field costs
        # several attribute reads per worker and request, more so with cold caches.
        self.info = info
        self.worker_id, self.role, self.model, self.serving = (
            info.worker_id, info.role, info.model, info.serving)

    def reported(self, load: int, capacity: int | None = None,
                 kv_usage: float | None = None) -> None:
        """The engine's own count of its requests: it covers every placement so far.
        What no engine can report is bounded, once warned about: a load below 0 or over
        LOAD_LIMIT counts as LOAD_LIMIT (full); a capacity outside those bounds as
        unknown (0); a KV usage that is not a number, or below 0, is ignored, and one
        over 1 counts as 1 (full)."""
        broken = []
        if not 0 <= load <= LOAD_LIMIT:
            broken.append(f"load {load}")
            load = LOAD_LIMIT
        if capacity is not None and not 0 <= capacity <= LOAD_LIMIT:
            broken.append(f"capacity {capacity}")
            capacity = 0
        if kv_usage is not None and not (math.isfinite(kv_usage) and 0 <= kv_usage <= 1):
            broken.append(f"KV usage {kv_usage}")
            kv_usage = 1.0 if math.isfinite(kv_usage) and kv_usage > 1 else None
        if broken and not self._warned:
            self._warned = True
            log.warning("worker %s reports %s: taken as bounded (warned once)",
                        self.worker_id, ", ".join(broken))
        self.load = load
        self.clear_pending()
        if capacity is not None:
            self.capacity = capacity
        if kv_usage is not None:
            self.kv_usage = kv_usage


class WorkerRegistry:
    """Workers by id; liveness from heartbeats."""

    def __init__(self, timeout: float, clock=time.monotonic):
        self.timeout = timeout
        self.clock = clock
        self.workers: dict[str, WorkerEntry] = {}
        self._entries: tuple[WorkerEntry, ...] | None = None     # workers' values, cached

    def register(self, info: router_pb2.WorkerInfo) -> bool:
        """Add or refresh a worker; True when it is new (or came back)."""
        now = self.clock()
        entry = self.workers.get(info.worker_id)
        fresh = entry is None or not self._alive(entry, now) or entry.info.address != info.address
        if entry is None or entry.info.address != info.address:
            self.workers[info.worker_id] = WorkerEntry(info=info, last_seen=now)
            self._entries = None
        else:
            entry.set_info(info)
            entry.last_seen = now
        return fresh

    def placed(self, entry: WorkerEntry) -> None:
        """One more request placed on `entry`, not yet in any report of its load."""
        entry.placed(self.clock())

    def deregister(self, worker_id: str) -> bool:
        """Forget a worker (it is shutting down)."""
        self._entries = None
        return self.workers.pop(worker_id, None) is not None

    def entries(self) -> tuple[WorkerEntry, ...]:
        """Every worker, registered or not serving, in registration order."""
        if self._entries is None:
            self._entries = tuple(self.workers.values())
        return self._entries

    def serving(self, role: int, model: str = "", exclude: set[str] | frozenset = frozenset()
                ) -> list[WorkerEntry]:
        """Live workers of `role` for `model`, minus `exclude`."""
        now, entries = self.clock(), self.entries()
        for e in entries:
            # A placement counts until a report covers it, or for PENDING_SECONDS: an
            # engine reports within a tick when its load changes, so one older than that
            # has finished already (a request that starts and ends between two ticks
            # changes nothing) or its worker's reports stalled. Either way it must not
            # keep the worker out of placement.
            e.decay(now, PENDING_SECONDS)
        return live(entries, role, model, exclude, now, self.timeout)

    def snapshot(self) -> list[router_pb2.WorkerInfo]:
        """Every worker with `serving` set from its heartbeat.

        A worker silent for 10 heartbeat timeouts is forgotten: it was replaced
        or removed without deregistering, and should not hold /health down.
        """
        now = self.clock()
        for wid in [w for w, e in self.workers.items() if now - e.last_seen > 10 * self.timeout]:
            del self.workers[wid]
            self._entries = None
        out = []
        for e in self.workers.values():
            info = router_pb2.WorkerInfo()
            info.CopyFrom(e.info)
            info.serving = self._alive(e, now)
            info.load, info.capacity, info.kv_usage = e.load + e.pending, e.capacity, e.kv_usage
            out.append(info)
        return sorted(out, key=lambda w: (w.role, w.worker_id))

    def _alive(self, entry: WorkerEntry, now: float) -> bool:
        return alive(entry, now, self.timeout)


def alive(entry, now: float, timeout: float) -> bool:
    """Serving, and heard from within `timeout` of `now`."""
    return entry.serving and now - entry.last_seen <= timeout


def live(entries, role: int, model: str, exclude, now: float, timeout: float) -> list:
    """The live entries (`alive`) of `role` that serve `model` (any model if empty) and
    are not in `exclude`."""
    return [e for e in entries if e.role == role and alive(e, now, timeout)
            and e.worker_id not in exclude and (not model or e.model == model)]


ROLE_NAMES = {common_pb2.WORKER_ROLE_PREFILL: "prefill", common_pb2.WORKER_ROLE_DECODE: "decode"}
