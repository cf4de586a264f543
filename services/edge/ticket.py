"""A ticket: one admitted request's hold on a slot of the decode pool (admission.py), held
by its generation (admitted.py) until it ends, given up when another tenant takes the slot
back and waited for again."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .admission import Admission


@dataclass(slots=True)
class Ticket:
    """One admitted request's hold on the pool; `release()` once it ends."""

    admission: "Admission"
    tenant: str
    priority: int
    slot: int                       # its slot in Admission._slots; -1 while preempted
    waited: float                   # seconds in the queue
    released: bool = False
    # Set by the generation that holds it (admitted.py): asked to give the slot up, its
    # stream stops its engine request and answers True (False: it cannot now, e.g. it
    # is ending). Only a held slot is taken back (`slot` >= 0).
    on_preempt: Callable[[], bool] | None = None
    preempted: int = 0              # times it gave its slot up

    def release(self) -> None:
        self.on_preempt = None                  # admission lets go of the stream
        if not self.released:
            self.released = True
            if self.slot >= 0:
                self.admission._released(self.tenant, self.slot)

    def running(self) -> None:
        """Its stream has a leg running (so it can give the slot up now): a request
        waiting for one may take it (`Admission._preempt`)."""
        if self.admission.queued and self.slot >= 0:
            self.admission._dispatch()

    async def resume(self) -> None:
        """After a preemption: wait for a slot again, first in its tenant's line and
        never refused (the request was accepted); the caller bounds the wait by the
        request's deadline."""
        await self.admission._resume(self)
