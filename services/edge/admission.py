"""Admission: a bounded priority queue in front of the router that sheds load.

A request is admitted when the decode pool has room for it: the serving
decode engines' capacity (each one's `max_running_requests`; an engine whose
KV cache is full counts none), as the workers report it through the router's
`ListWorkers` (read once a second; 10 times a second while requests wait or
other edges share the pool), minus this edge's requests in flight (admitted,
not yet ended: counted here, exactly, from admission on, through their
prefill), minus what the other edge
replicas have admitted, as each last told the router (each reading reports this
edge's counts; services/router/edges.py). The engines' reported load is not
subtracted: it lags by up to a heartbeat (load records ride on KV-event
batches, which short prompts do not produce), and the router's count of
placements since is an upper bound that held free slots shut (a closed loop at
capacity ran at 40 % of its rate). The other edges' counts lag too, by up to
two readings (0.2 s: edges that share a pool read it 10 times a second): two
replicas that see the same free slot may both take it, and the engine's own
queue holds the extra for that moment. A tenant's share (below) is of this
edge's part of the pool, and the expected wait counts only this edge's slots
freeing (another edge's requests end too, unseen: it errs towards refusing).

Otherwise it waits, in its key's priority class (high before normal before
low) and, within a class, in its tenant's line: the tenant that has used the
pool least goes next (slots held, averaged over the last few seconds; ties take
turns), so one tenant's burst queues behind its own requests, not in front of
another tenant's steady traffic; and each active tenant is guaranteed its
share of the pool (`_may_take`), so a burst cannot hold the slots another
tenant's next request needs. A tenant that has used less than its share on
average may go past it for a peak, taking a slot another tenant is owed: its
peaks then wait for the next slot to end, not for one of its own (max-min
fairness over time, not at each instant). Only a tenant active for
USE_SECONDS has such credit, so a newcomer's burst cannot take what the others
are owed. When the queue is full, a
newcomer takes the place of the newest request of a lower class, or of the
tenant with the longest line in its own class (if that line is longer than its
own tenant's), so a burst fills the queue with its own requests but cannot
shut others out of it.

A slot can also be taken back (`_preempt`): a waiting tenant that has used less
than its share on average (or holds less than its share now) may preempt the
newest running request of a tenant in its class or below that has used the
pool more than it on average (by MARGIN slots or more). Without it, a light
tenant's peak past its share waits for the next slot to end (~0.13 s at p99 on
the tiny model's 32-token requests) while the heavy tenant keeps every other
slot full. The preempted request is not lost: its stream gives the slot
up (its engine request aborted; `Ticket.on_preempt`), waits first in its
tenant's line, never refused (`Ticket.resume`), and goes on from the tokens it
has sent, as a moved generation does (moves.py). vLLM does the same inside
one engine when its KV cache runs out (recompute preemption); this does it
across the pool, for fairness. A request is preempted at most PREEMPT_LIMIT
times; one tenant alone, or tenants that have used the pool alike, never are.
Because slots can be taken back, a tenant past its share may also take the
slots another is owed once that tenant could preempt it (`Shares.past_share`): the
pool stays full instead of holding the light tenant's unused share idle, and
the light tenant's next request takes its slot back. A request is preemptible
once its stream has a decode leg placed (`Ticket.running` wakes the queue
then); one still in its first prefill is not.

The queue is bounded in length and in wait, and a refusal is a 503 with
`Retry-After` (a caller that is refused quickly can go elsewhere; one that
waits past its SLO is served too late to count). The wait bound is the
operator's queueing allowance in the TTFT SLO, applied twice: a newcomer
expected to wait past it is refused on arrival (`expected_wait`: its turns
ahead, in the order the queue serves them, against when the requests running
now should end, from their start and the recent mean hold time; requests of one
size end together, so "capacity per hold time" would be wrong), and one still
waiting when it runs out is refused then. So most refusals cost no waiting.
Draining admits nothing new (a preempted request waiting to resume goes on).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pdserve.config import EdgeConfig

from .keys import APIKey
from .openai_protocol import APIError
from .shares import CREDIT, Shares
from .ticket import Ticket

log = logging.getLogger("pdserve.edge")

KV_FULL = 0.95                      # an engine this full takes nothing more
HOLD_WEIGHT = 0.1                   # how much the last request's hold time moves the mean
HOLD_MARGIN = 4.0                   # deviations of the hold time added to an expected wait
                                    # (as TCP's retransmit timeout adds 4 to its round trip)
PREEMPT_LIMIT = 4                   # times one request may give its slot up to another tenant
MARGIN = CREDIT / 2                 # slots more, on average, a tenant must have used than
                                    # another for it to be preempted for it (hysteresis)


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future
    queued_at: float = field(default_factory=time.monotonic)
    slot: int = -1                  # the slot taken for it, once admitted
    expected: float = 0.0           # its expected wait when it came
    resumed: bool = False           # a preempted request's: never refused


def _granted(waiter: _Waiter) -> bool:
    """The waiter was given a slot (its future says so, whether or not it woke yet)."""
    f = waiter.future
    return f.done() and not f.cancelled() and f.result() is None


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

    def __init__(self, cfg: EdgeConfig, metrics=None):
        self.max_queue = cfg.admission_queue
        self.max_wait = cfg.admission_wait_seconds
        self.metrics = metrics
        self.capacity: float = float("inf")     # until the first reading
        self.in_flight = 0                       # tickets not yet released
        self.elsewhere = 0                       # other edges' admitted, as last reported
        self.shares = Shares()
        self.draining = False
        self.queued = 0
        self.hold: float | None = None            # mean seconds a ticket is held (recent)
        self.hold_dev = 0.0                       # ...and its mean deviation from that
        # Held slots, oldest first: slot -> (when taken, by which tenant).
        self._slots: OrderedDict[int, tuple[float, str]] = OrderedDict()
        self._tickets: dict[int, Ticket] = {}    # slot -> its ticket, while held
        self._slot_ids = itertools.count()
        self._lines: list[OrderedDict[str, deque[_Waiter]]] = [OrderedDict() for _ in range(3)]

    # --- the pool's room -------------------------------------------------
    @property
    def room(self) -> float:
        return self.capacity - self.elsewhere - self.in_flight

    def observe(self, capacity: float, elsewhere: int = 0) -> None:
        """A fresh reading of the pool's capacity, and of the requests other edge
        replicas have admitted into it."""
        self.capacity, self.elsewhere = capacity, elsewhere
        if self.metrics is not None:
            self.metrics.admitted_elsewhere.set(elsewhere)
        self._dispatch()

    def _held(self, seconds: float) -> None:
        """Learn from one ended hold (as TCP learns its round-trip time and variation)."""
        if self.hold is None:
            self.hold, self.hold_dev = seconds, seconds / 2
            return
        error = seconds - self.hold
        self.hold += HOLD_WEIGHT * error
        self.hold_dev += HOLD_WEIGHT * (abs(error) - self.hold_dev)

    def expected_wait(self, key: APIKey) -> float:
        """Seconds a request of `key`'s queued now would wait: until as many slots have
        freed as there are turns served before it (every higher class, then in its own
        the requests of tenants that hold fewer slots, see `_next`) plus its own. A held
        slot is expected to free one mean hold time after it was taken, so the oldest
        free first, and each slot freed is taken again and held as long; the hold
        time's recent deviation, HOLD_MARGIN times, is added for safety. A tenant
        past its share while others are owed theirs (`_may_take`) waits for its own
        slots to free instead (0 while nothing is known)."""
        if self.hold is None or self.capacity == float("inf") or not self._slots:
            return 0.0
        if self._victim(key.tenant, key.priority) is not None:
            return 0.0                          # it takes a slot back (`_preempt`)
        ahead = sum(len(line) for lines in self._lines[:key.priority]
                    for line in lines.values())
        lines = self._lines[key.priority]
        mine = len(lines.get(key.tenant, ()))
        share, owed = self._share(key.tenant)
        now = time.monotonic()
        # Another tenant goes first while it has used the pool less (ties: in turn).
        used = self.use(key.tenant, now)
        for tenant, line in lines.items():
            if tenant != key.tenant:
                other = self.use(tenant, now)
                ahead += (len(line) if other < used else
                          min(len(line), mine + 1) if other == used else 0)
        ahead += mine
        ends = ahead + 1 - max(0, int(self.room))         # slots that must free first
        capped = (owed and self.shares.holding.get(key.tenant, 0) + mine >= share
                  and not self.shares.past_share(key.tenant, share, now))
        slots = [taken for taken, tenant in self._slots.values()
                 if not capped or tenant == key.tenant]
        if capped:
            ends = mine + 1
            slots = slots or [taken for taken, _ in self._slots.values()]
        if ends <= 0:
            return 0.0
        rounds, i = divmod(ends - 1, len(slots))
        return (max(0.0, slots[i] + self.hold - time.monotonic()) + rounds * self.hold
                + HOLD_MARGIN * self.hold_dev)

    def _released(self, tenant: str, slot: int, held: bool = True) -> None:
        self._free(tenant, slot, held)
        self._dispatch()

    def _free(self, tenant: str, slot: int, held: bool) -> None:
        taken = self._slots.pop(slot, None)
        self._tickets.pop(slot, None)
        if held and taken is not None:
            self._held(time.monotonic() - taken[0])
        self.shares.freed(tenant)
        self.in_flight -= 1

    def _may_take(self, tenant: str, fair: tuple[float, float] | None = None) -> bool:
        """Room for `tenant`. Each tenant active now (it asked in the last
        ACTIVE_SECONDS) is guaranteed its share of the pool: below it, a tenant
        takes any free slot; at or above it, only slots that no other active
        tenant is still owed, unless it may go past its share (`Shares.past_share`).
        So a tenant that keeps the pool full leaves the others' unused shares
        free for their next requests instead of making them wait for one to end
        (the price: those slots may idle while their tenant is quiet), until
        they could take them back by preemption. `fair`: `_fair()`, when the
        caller asks for many tenants at one moment."""
        if self.room < 1:
            return False
        share, owed = fair or self._fair()
        # At or past its share, a tenant is owed nothing itself: all of `owed` is others'.
        return (self.shares.holding.get(tenant, 0) < share or self.room - owed >= 1
                or self.shares.past_share(tenant, share, time.monotonic()))

    def use(self, tenant: str, now: float) -> float:
        """`tenant`'s slots held, on average (Shares.use)."""
        return self.shares.use(tenant, now)

    def _fair(self) -> tuple[float, float]:
        """(Each active tenant's share of this edge's part of the pool now, the slots
        the active tenants are still owed of theirs, in all)."""
        return self.shares.fair(max(0.0, self.capacity - self.elsewhere))

    def _share(self, tenant: str) -> tuple[float, float]:
        """(`tenant`'s share of the pool, the slots the other active tenants are still
        owed of theirs)."""
        return self.shares.share_of(tenant, max(0.0, self.capacity - self.elsewhere))

    def _take(self, tenant: str) -> int:
        self.shares.took(tenant)
        self.in_flight += 1
        slot = next(self._slot_ids)
        self._slots[slot] = (time.monotonic(), tenant)
        return slot

    # --- admitting ----------------------------------------------------------
    async def admit(self, key: APIKey) -> Ticket:
        """A ticket once the pool has room for `key`'s request; APIError 503 when
        the queue is full, the wait runs out, or the edge is draining."""
        if self.draining:
            self._reject("draining", "the server is shutting down; retry on another "
                         "replica")
        self.shares.asked(key.tenant)
        if not self.queued and self._may_take(key.tenant):
            return self._ticket(key, self._take(key.tenant), 0.0)
        expected = self.expected_wait(key)
        if expected > self.max_wait:
            self._reject("wait", f"the server is at capacity: room expected in "
                         f"{expected:.2f} s, past the {self.max_wait:g} s wait; retry later")
        if self.queued >= self.max_queue and not self._push_out(key):
            self._reject("queue_full", "the server is at capacity and its queue is full; "
                         "retry later")
        waiter = _Waiter(asyncio.get_running_loop().create_future(), expected=expected)
        line = self._lines[key.priority].setdefault(key.tenant, deque())
        line.append(waiter)
        self.queued += 1
        self._dispatch()                    # the last slot may be this tenant's to take
        try:
            async with asyncio.timeout(self.max_wait):
                refused = await waiter.future       # None: admitted; an APIError: drained
        except TimeoutError:
            if not waiter.future.done() or waiter.future.cancelled():
                self._remove(key, waiter)
                log.info("admission: a request of %s waited %.3f s for room (expected "
                         "%.3f s when it came); refused", key.tenant, self.max_wait,
                         waiter.expected)
                self._reject("wait", f"the server is at capacity: no room within "
                             f"{self.max_wait:g} s; retry later")
            # Decided as the wait ran out: admitted (its slot is taken), or refused.
            refused = waiter.future.result()
        except asyncio.CancelledError:
            self._left(key, waiter)
            raise
        if refused is not None:
            raise refused
        return self._ticket(key, waiter.slot, time.monotonic() - waiter.queued_at)

    def _left(self, key: APIKey | Ticket, waiter: _Waiter) -> None:
        """The waiter's caller went away: its slot back if it was admitted as it left
        (not a hold to learn from), else its place in the line."""
        if _granted(waiter):
            self._released(key.tenant, waiter.slot, held=False)
        else:
            self._remove(key, waiter)

    def _ticket(self, key: APIKey, slot: int, waited: float) -> Ticket:
        if self.metrics is not None:
            self.metrics.queue_wait.observe(waited)
        ticket = self._tickets[slot] = Ticket(self, key.tenant, key.priority, slot, waited)
        return ticket

    async def _resume(self, ticket: Ticket) -> None:
        if self.draining:                       # accepted: it finishes, room or not
            ticket.slot = self._take(ticket.tenant)
            self._tickets[ticket.slot] = ticket
            return
        waiter = _Waiter(asyncio.get_running_loop().create_future(), resumed=True)
        self._lines[ticket.priority].setdefault(ticket.tenant, deque()).appendleft(waiter)
        self.queued += 1
        self._dispatch()
        try:
            await waiter.future
        except asyncio.CancelledError:
            self._left(ticket, waiter)
            raise
        ticket.slot = waiter.slot
        self._tickets[waiter.slot] = ticket

    # --- taking a slot back -------------------------------------------------------
    def _preempt(self) -> bool:
        """Free a slot for a waiting tenant by preempting another's request (see the
        module's docstring). True if a slot was freed."""
        cannot: set[int] = set()
        while (found := self._victim(skip=cannot)) is not None:
            ticket, tenant = found
            if not ticket.on_preempt():
                cannot.add(ticket.slot)         # it cannot give the slot up now (ending)
                continue
            now = time.monotonic()
            log.info("admission: preempted a request of %s (used %.2f slots on average) "
                     "for %s (used %.2f)", ticket.tenant, self.use(ticket.tenant, now),
                     tenant, self.use(tenant, now))
            ticket.preempted += 1
            self._free(ticket.tenant, ticket.slot, held=False)
            ticket.slot = -1
            if self.metrics is not None:
                self.metrics.preemptions.inc()
            return True
        return False

    def _victim(self, waiting: str | None = None, priority: int | None = None,
                skip: set[int] = frozenset()) -> tuple[Ticket, str] | None:
        """(The request to preempt, the tenant it makes room for), or None: the first
        waiting tenant (or `waiting`, of `priority`), by class and then by least use,
        that may go past what it holds (below its share now, or credited), and the
        newest preemptible request of a tenant in its class or below that has used
        the pool more than the waiting tenant, on average, by MARGIN slots or more
        (so two tenants do not take slots back from each other in turn)."""
        holders = self.shares.holders()
        if not self._tickets or holders == [waiting]:
            return None
        share, _ = self._fair()
        now = time.monotonic()
        asking = ([(priority, waiting)] if waiting is not None else
                  [(p, t) for p, lines in enumerate(self._lines)
                   for _, t in sorted((self.use(t, now), t) for t in lines)])
        for p, tenant in asking:
            if holders == [tenant] or not (self.shares.holding.get(tenant, 0) < share
                                           or self.shares.credited(tenant, share, now)):
                continue
            used = self.use(tenant, now)
            heavy = {t for t in holders if t != tenant and self.use(t, now) >= used + MARGIN}
            # Newest first (the least work to redo), those preempted before last.
            victims = [ticket for slot in reversed(self._slots)
                       if (ticket := self._tickets.get(slot)) is not None
                       and ticket.tenant in heavy and ticket.priority >= p
                       and ticket.on_preempt is not None and slot not in skip
                       and ticket.preempted < PREEMPT_LIMIT]
            if victims:
                return min(victims, key=lambda t: t.preempted), tenant
        return None

    def _dispatch(self) -> None:
        """Admit queued requests while there is room, in `_next`'s order (a tenant
        past its share while others are owed theirs waits; another may go)."""
        while self.queued and (self.room >= 1 or self._preempt()):
            pick = self._next()
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
                waiter.slot = self._take(tenant)
                waiter.future.set_result(None)
        self._gauge()

    def _next(self):
        """Whose request goes next: the highest class with a tenant that may take the
        room; in it, the tenant that has used the pool least (so a light tenant's request
        is not queued behind a heavy one's turns), ties in turn."""
        fair = self._fair()                     # once per step, not once per tenant
        now = time.monotonic()
        for lines in self._lines:
            ready = [(self.use(t, now), i, t) for i, t in enumerate(lines)
                     if self._may_take(t, fair)]
            if ready:
                _, _, tenant = min(ready)
                return lines, tenant, lines[tenant]
        return None

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
            if line[-1].resumed:
                continue                        # a preempted request: accepted, never refused
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

    def _remove(self, key: APIKey | Ticket, waiter: _Waiter) -> None:
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
            for tenant, line in lines.items():
                for waiter in line:
                    if waiter.future.done():
                        pass
                    elif waiter.resumed:        # accepted: it finishes, room or not
                        waiter.slot = self._take(tenant)
                        waiter.future.set_result(None)
                    else:
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
