"""Admission: a bounded priority queue in front of the router that sheds load.

A request is admitted when the decode pool has room for it: the serving
decode engines' capacity (each one's `max_running_requests`; an engine whose
KV cache is full counts none), as the workers report it through the router's
`ListWorkers` (read once a second, 10 times a second while requests wait),
minus this edge's requests in flight (admitted, not yet ended: counted here,
exactly, from admission on, through their prefill). The engines' reported
load is not subtracted: it lags by up to a heartbeat (load records ride on
KV-event batches, which short prompts do not produce), and the router's count
of placements since is an upper bound that held free slots shut (a closed
loop at capacity ran at 40 % of its rate). So with several edge replicas each admits up to the whole pool, and
the engines' own queues take the excess (see the README). Otherwise it waits,
in its key's priority class (high before normal before low) and, within a
class, in its tenant's line: tenants take turns, so one tenant's burst
queues behind its own requests, not in front of another tenant's steady
traffic. When the queue is full, a newcomer takes the place of the newest
request of a lower class, or of the tenant with the longest line in its own
class (if that line is longer than its own tenant's), so a burst fills the
queue with its own requests but cannot shut others out of it. The queue is
bounded in length and in wait: past either, 503 with
`Retry-After` at once (a caller that is refused quickly can go elsewhere; one
that waits past its SLO is served too late to count). Draining admits
nothing more.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from .keys import APIKey
from .openai_protocol import APIError

KV_FULL = 0.95                      # an engine this full takes nothing more
ACTIVE_SECONDS = 5.0                # a tenant that asked this recently shares the pool


@dataclass(slots=True)
class Ticket:
    """One admitted request's hold on the pool; `release()` once it ends."""

    admission: "Admission"
    tenant: str
    waited: float                   # seconds in the queue
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission._released(self.tenant)


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future
    queued_at: float = field(default_factory=time.monotonic)


def pool_capacity(workers, decode_role: int) -> float:
    """Requests the serving decode workers whose KV cache has room run at once
    (inf: one reports no bound). No decode worker at all is not a full pool:
    requests go on, and the router answers at once that no worker serves."""
    serving = [w for w in workers if w.serving and w.role == decode_role]
    decode = [w for w in serving if w.kv_usage < KV_FULL]
    if not serving or any(w.capacity == 0 for w in decode):
        return float("inf")
    return sum(w.capacity for w in decode)


class Admission:
    """Counts room in the pool and queues whatever does not fit."""

    def __init__(self, max_queue: int, max_wait: float, metrics=None):
        self.max_queue = max_queue
        self.max_wait = max_wait
        self.metrics = metrics
        self.capacity: float = float("inf")     # until the first reading
        self.in_flight = 0                       # tickets not yet released
        self._holding: dict[str, int] = {}       # tenant -> its tickets not yet released
        self._seen: dict[str, float] = {}        # tenant -> when it last asked
        self.draining = False
        self.queued = 0
        self._lines: list[OrderedDict[str, deque[_Waiter]]] = [OrderedDict() for _ in range(3)]

    # --- the pool's room -------------------------------------------------
    @property
    def room(self) -> float:
        return self.capacity - self.in_flight

    def observe(self, capacity: float) -> None:
        """A fresh reading of the pool's capacity."""
        self.capacity = capacity
        self._dispatch()

    def _released(self, tenant: str) -> None:
        self.in_flight -= 1
        self._holding[tenant] -= 1
        self._dispatch()

    def _may_take(self, tenant: str) -> bool:
        """Room for `tenant`: any free slot but the last, which goes only to a tenant
        holding less than its share of the pool among the tenants active now. So
        a tenant that keeps the pool full still leaves one slot free for another
        tenant's next request, instead of making it wait for one to end."""
        if self.room < 1:
            return False
        if self.room >= 2:
            return True
        now = time.monotonic()
        for t in [t for t, at in self._seen.items() if now - at > ACTIVE_SECONDS]:
            del self._seen[t]
        active = max(1, len(self._seen))
        return active == 1 or self._holding.get(tenant, 0) < self.capacity / active

    def _take(self, tenant: str) -> None:
        self.in_flight += 1
        self._holding[tenant] = self._holding.get(tenant, 0) + 1

    # --- admitting ----------------------------------------------------------
    async def admit(self, key: APIKey) -> Ticket:
        """A ticket once the pool has room for `key`'s request; APIError 503 when
        the queue is full, the wait runs out, or the edge is draining."""
        if self.draining:
            self._reject("draining", "the server is shutting down; retry on another "
                         "replica")
        self._seen[key.tenant] = time.monotonic()
        if not self.queued and self._may_take(key.tenant):
            self._take(key.tenant)
            return self._ticket(key, 0.0)
        if self.queued >= self.max_queue and not self._push_out(key):
            self._reject("queue_full", "the server is at capacity and its queue is full; "
                         "retry later")
        waiter = _Waiter(asyncio.get_running_loop().create_future())
        line = self._lines[key.priority].setdefault(key.tenant, deque())
        line.append(waiter)
        self.queued += 1
        self._dispatch()                    # the last slot may be this tenant's to take
        try:
            async with asyncio.timeout(self.max_wait):
                refused = await waiter.future       # None: admitted; an APIError: drained
        except TimeoutError:
            self._remove(key, waiter)
            self._reject("wait", f"the server is at capacity: no room within "
                         f"{self.max_wait:g} s; retry later")
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() \
                    and waiter.future.result() is None:
                self._released(key.tenant)      # admitted as the caller left: give it back
            else:
                self._remove(key, waiter)
            raise
        if refused is not None:
            raise refused
        return self._ticket(key, time.monotonic() - waiter.queued_at)

    def _ticket(self, key: APIKey, waited: float) -> Ticket:
        if self.metrics is not None:
            self.metrics.queue_wait.observe(waited)
        return Ticket(self, key.tenant, waited)

    def _dispatch(self) -> None:
        """Admit queued requests while there is room: by class, tenants in turn
        (a tenant the last slot is not for waits; the next one may take it)."""
        while self.room >= 1 and self.queued:
            pick = next(((lines, tenant, line) for lines in self._lines
                         for tenant, line in lines.items() if self._may_take(tenant)), None)
            if pick is None:
                break
            lines, tenant, line = pick
            waiter = line.popleft()
            if line:
                lines.move_to_end(tenant)       # the next tenant's turn
            else:
                del lines[tenant]
            self.queued -= 1
            if not waiter.future.done():
                self._take(tenant)
                waiter.future.set_result(None)
        self._gauge()

    def _push_out(self, key: APIKey) -> bool:
        """Make room in a full queue for `key`'s request by refusing the newest
        request of a lower class, or of a longer line in its class; False if none."""
        mine = len(self._lines[key.priority].get(key.tenant, ()))
        for priority in range(len(self._lines) - 1, key.priority - 1, -1):
            lines = self._lines[priority]
            if not lines:
                continue
            tenant, line = max(lines.items(), key=lambda item: len(item[1]))
            if priority == key.priority and len(line) <= mine + 1:
                return False
            victim = line.pop()
            if not line:
                del lines[tenant]
            self.queued -= 1
            if not victim.future.done():
                victim.future.set_result(self._error(
                    "queue_full", "the server is at capacity and its queue is full; "
                    "retry later"))
            return True
        return False

    def _remove(self, key: APIKey, waiter: _Waiter) -> None:
        line = self._lines[key.priority].get(key.tenant)
        if line is not None and waiter in line:
            line.remove(waiter)
            self.queued -= 1
            if not line:
                del self._lines[key.priority][key.tenant]
        self._gauge()

    def drain(self) -> None:
        """Admit nothing more; everyone queued gets 503 now."""
        self.draining = True
        for lines in self._lines:
            for line in lines.values():
                for waiter in line:
                    if not waiter.future.done():
                        waiter.future.set_result(self._error(
                            "draining", "the server is shutting down; retry on another "
                            "replica"))
                    self.queued -= 1
            lines.clear()
        self._gauge()

    def _error(self, reason: str, message: str) -> APIError:
        if self.metrics is not None:
            self.metrics.rejections.labels(reason).inc()
        return APIError(503, message, type="server_overloaded", code=reason)

    def _reject(self, reason: str, message: str):
        raise self._error(reason, message)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_length.set(self.queued)
