"""Each tenant's share of this edge's part of the decode pool, and its use of it over time:
what admission (admission.py) weighs when it picks whose request goes next, whether a tenant
may take a slot another is owed, and whom a slot is taken back from.

A tenant is active while it asked within ACTIVE_SECONDS; the active tenants share the pool
equally. A tenant's use is the slots it held, averaged exponentially over USE_SECONDS; one
that has used CREDIT slots less than its share, over at least USE_SECONDS, is credited: it
may go past its share for a peak.
"""
from __future__ import annotations

import math
import time

ACTIVE_SECONDS = 5.0                # a tenant that asked this recently shares the pool
USE_SECONDS = ACTIVE_SECONDS        # time constant of a tenant's mean use of the pool
CREDIT = 0.25                       # slots below its share, on average, a tenant must be to
                                    # go past its share (a moment below it earns nothing)


class Shares:
    """The tenants' slots held now, when each last asked, and each one's mean use."""

    def __init__(self) -> None:
        self.holding: dict[str, int] = {}       # tenant -> its tickets not yet released
        self.seen: dict[str, float] = {}        # tenant -> when it last asked
        # tenant -> (mean slots held, as of when, active since when)
        self._use: dict[str, tuple[float, float, float]] = {}

    def asked(self, tenant: str) -> None:
        """`tenant` asked for a slot: it is active (for ACTIVE_SECONDS)."""
        self.seen[tenant] = time.monotonic()

    def took(self, tenant: str) -> None:
        """`tenant` took a slot."""
        self._touch(tenant)
        self.holding[tenant] = self.holding.get(tenant, 0) + 1

    def freed(self, tenant: str) -> None:
        """`tenant` gave a slot up."""
        self._touch(tenant)
        self.holding[tenant] -= 1
        if not self.holding[tenant] and tenant not in self.seen:
            self._use.pop(tenant, None)         # gone quiet while it held slots

    def holders(self) -> list[str]:
        """The tenants holding a slot now."""
        return [t for t, n in self.holding.items() if n]

    def use(self, tenant: str, now: float) -> float:
        """`tenant`'s slots held, averaged exponentially over USE_SECONDS (0 before its
        first slot; see `_touch` for where it starts)."""
        record = self._use.get(tenant)
        if record is None:
            return 0.0
        mean, at, _ = record
        held = self.holding.get(tenant, 0)
        return held + (mean - held) * math.exp((at - now) / USE_SECONDS)

    def credited(self, tenant: str, share: float, now: float) -> bool:
        """`tenant` has used at least CREDIT slots less than its share on average, over
        at least USE_SECONDS: it may go past its share for a peak."""
        record = self._use.get(tenant)
        return (record is not None and now - record[2] >= USE_SECONDS
                and self.use(tenant, now) <= share - CREDIT)

    def past_share(self, tenant: str, share: float, now: float) -> bool:
        """`tenant` may take a slot another active tenant is owed: it is credited, or
        every tenant still owed its share could take the slot back (by preemption: it
        has used the pool CREDIT slots less than `tenant`). Then a burst keeps the pool
        full instead of leaving the others' shares idle, and their next requests
        preempt it."""
        if self.credited(tenant, share, now):
            return True
        used = self.use(tenant, now) - CREDIT
        return all(self.use(t, now) <= used for t in self.seen
                   if t != tenant and self.holding.get(t, 0) < share)

    def _touch(self, tenant: str) -> None:
        """Bring `tenant`'s mean up to now; called before its holdings change (they are
        constant in between, so the mean is exact). A tenant's first slot starts its
        mean at the least any other active tenant has used (as start-time fair queueing
        starts a new flow at the current virtual time): a newcomer does not go before
        the others for a while merely because it has no history."""
        now = time.monotonic()
        if tenant in self._use:
            mean, since = self.use(tenant, now), self._use[tenant][2]
        else:
            mean = min((self.use(t, now) for t in self._use if t in self.seen), default=0.0)
            since = now
        self._use[tenant] = (mean, now, since)

    def fair(self, pool: float) -> tuple[float, float]:
        """(Each active tenant's share of the pool, the slots the active tenants are
        still owed of theirs, in all)."""
        now = time.monotonic()
        for t in [t for t, at in self.seen.items() if now - at > ACTIVE_SECONDS]:
            del self.seen[t]
            if not self.holding.get(t):
                self._use.pop(t, None)          # back later: it starts anew, no credit
        if len(self.seen) <= 1:
            return pool, 0.0
        share = pool / len(self.seen)
        return share, sum(max(0.0, share - self.holding.get(t, 0)) for t in self.seen)

    def share_of(self, tenant: str, pool: float) -> tuple[float, float]:
        """(`tenant`'s share of the pool, the slots the other active tenants are still
        owed of theirs)."""
        share, owed = self.fair(pool)
        if owed and tenant in self.seen:
            owed = max(0.0, owed - max(0.0, share - self.holding.get(tenant, 0)))
        return share, owed
