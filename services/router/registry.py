"""Which workers exist and whether they are serving.

Workers register and then re-register every heartbeat; a worker that misses
heartbeats for `timeout` seconds stops being offered to requests but stays
listed (so /health can say what is missing).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.v1 import common_pb2, router_pb2

PENDING_SECONDS = 1.0


@dataclass(slots=True)
class WorkerEntry:
    """One registered worker and its load as the router accounts it."""

    info: router_pb2.WorkerInfo
    last_seen: float
    routed: int = 0                  # requests placed here (spreads load round-robin)
    load: int = 0                    # running + waiting on its engine, as last reported
    pending: int = 0                 # requests placed here since that report
    load_pushed: bool = False        # `load` comes from the engine's event stream (fresh)
    placed_at: deque = field(default_factory=deque)    # when each pending one was placed
    capacity: int = 0                # requests its engine runs at once; 0 unknown
    kv_usage: float = 0.0            # fraction of its KV cache in use
    # What placement reads of `info`, per worker and request, copied out of it: a
    # protobuf field costs several attribute reads, more so with cold caches.
    worker_id: str = field(init=False)
    role: int = field(init=False)
    model: str = field(init=False)
    serving: bool = field(init=False)

    def __post_init__(self) -> None:
        self.set_info(self.info)

    def set_info(self, info: router_pb2.WorkerInfo) -> None:
        self.info = info
        self.worker_id, self.role, self.model, self.serving = (
            info.worker_id, info.role, info.model, info.serving)

    def reported(self, load: int, capacity: int | None = None,
                 kv_usage: float | None = None) -> None:
        """The engine's own count of its requests: it covers every placement so far."""
        self.load = load
        self.pending = 0
        self.placed_at.clear()
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

    def register(self, info: router_pb2.WorkerInfo) -> bool:
        """Add or refresh a worker; True when it is new (or came back)."""
        now = self.clock()
        entry = self.workers.get(info.worker_id)
        fresh = entry is None or not self._alive(entry, now) or entry.info.address != info.address
        if entry is None or entry.info.address != info.address:
            self.workers[info.worker_id] = WorkerEntry(info=info, last_seen=now)
        else:
            entry.set_info(info)
            entry.last_seen = now
        return fresh

    def placed(self, entry: WorkerEntry) -> None:
        """One more request placed on `entry`, not yet in any report of its load."""
        entry.routed += 1
        entry.pending += 1
        entry.placed_at.append(self.clock())

    def deregister(self, worker_id: str) -> bool:
        """Forget a worker (it is shutting down)."""
        return self.workers.pop(worker_id, None) is not None

    def serving(self, role: int, model: str = "", exclude: set[str] | frozenset = frozenset()
                ) -> list[WorkerEntry]:
        """Live workers of `role` for `model`, minus `exclude`."""
        now, out = self.clock(), []
        for e in self.workers.values():
            # A placement counts until a report covers it, or for PENDING_SECONDS: an
            # engine reports within a tick when its load changes, so one older than that
            # has finished already (a request that starts and ends between two ticks
            # changes nothing) or its worker's reports stalled. Either way it must not
            # keep the worker out of placement.
            placed = e.placed_at
            while placed and now - placed[0] > PENDING_SECONDS:
                placed.popleft()
                e.pending = len(placed)
            if (e.role == role and self._alive(e, now) and e.worker_id not in exclude
                    and (not model or e.model == model)):
                out.append(e)
        return out

    def snapshot(self) -> list[router_pb2.WorkerInfo]:
        """Every worker with `serving` set from its heartbeat.

        A worker silent for 10 heartbeat timeouts is forgotten: it was replaced
        or removed without deregistering, and should not hold /health down.
        """
        now = self.clock()
        for wid in [w for w, e in self.workers.items() if now - e.last_seen > 10 * self.timeout]:
            del self.workers[wid]
        out = []
        for e in self.workers.values():
            info = router_pb2.WorkerInfo()
            info.CopyFrom(e.info)
            info.serving = self._alive(e, now)
            info.load, info.capacity, info.kv_usage = e.load + e.pending, e.capacity, e.kv_usage
            out.append(info)
        return sorted(out, key=lambda w: (w.role, w.worker_id))

    def _alive(self, entry: WorkerEntry, now: float) -> bool:
        return entry.serving and now - entry.last_seen <= self.timeout


ROLE_NAMES = {common_pb2.WORKER_ROLE_PREFILL: "prefill", common_pb2.WORKER_ROLE_DECODE: "decode"}
