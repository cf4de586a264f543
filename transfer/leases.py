"""Leases: a prefill's blocks, held for a decoder, end exactly once.

A lease is what vLLM's NIXL connector keeps on the prefill side after a request
finishes with `do_remote_decode`: its blocks stay allocated until a decoder
says it has read them, or until the lease's expiry (the connector's worker
keeps `lease id -> expiry` in `_reqs_to_send`; the lease id is the request id
the prefill returned as `remote_request_id`). This module lives beside the
connector in vLLM's model worker (in the engine core's process on one CPU rank,
pdserve's default; in a process per rank otherwise) and adds what vLLM lacks:

- **ending a lease at once**, by id: `end(id, "aborted")` sets its expiry to
  now, so the connector frees its blocks at its next step (the same path an
  expiry takes, through the scheduler: no block is freed twice or behind its
  back). A lease the worker has not heard of yet (the scheduler tells it a
  step after the prefill) is remembered and ended when it appears;
- **claiming a lease** before a pull: `claim(id)` answers whether its blocks
  are still held (and extends its expiry), have been freed, or are not known
  here yet, so a decoder never reads blocks that were freed and reused (a
  one-sided READ cannot tell);
- **one outcome per lease**, counted: `released` (the decoder's notification
  came), `aborted` (ended by id), `expired` (nobody came in time).

Every call runs on the worker's thread between engine steps (vLLM's
`collective_rpc`, see `WorkerLeases`), as the connector's own bookkeeping does.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict

OUTCOMES = ("released", "aborted", "expired")
_REMEMBER = 100_000           # ended lease ids kept, so a second end answers found=false


def request_of(lease_id: str) -> str:
    """The caller's request id in a lease id (vLLM appends `-<8 hex>` to it)."""
    return lease_id.rsplit("-", 1)[0]


class Leases:
    """Outcome bookkeeping over one NIXL connector worker (`_reqs_to_send`)."""

    def __init__(self, worker, clock=time.perf_counter):
        self.worker = worker
        self.clock = clock
        self.opened = 0
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self._open: set[str] = set()
        self._ending: dict[str, str] = {}             # id -> outcome asked for
        self._early: dict[str, float] = {}            # ended before the worker knew it
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._expired_now: set[str] = set()
        reap = worker._reap_expired_send_leases

        def reap_and_note(done_sending: set[str]) -> None:
            now = self.clock()
            self._expired_now = {r for r, at in worker._reqs_to_send.items() if now >= at}
            reap(done_sending)
        worker._reap_expired_send_leases = reap_and_note

    def _held(self) -> dict[str, float]:
        return self.worker._reqs_to_send

    def end(self, lease_id: str, outcome: str = "aborted") -> bool:
        """Free the lease's blocks at the next step; False if it had ended or is unknown.

        `lease_id` is the lease's own id or the request id the caller gave the prefill
        (vLLM makes the lease id `<request id>-<8 hex>`): a caller cancelled before the
        prefill answered knows only the latter."""
        if lease_id in self._ended or lease_id in self._ending:
            return False
        held = self._held()
        ids = [lease_id] if lease_id in held else [
            i for i in held if request_of(i) == lease_id and i not in self._ending]
        for i in ids:
            held[i] = -math.inf
            self._ending[i] = outcome
        if not ids:
            # Not known yet (or never will be): end it if it shows up within a lease.
            self._early[lease_id] = self.clock() + self.worker._lease_extension * 1.5 + 1
        return bool(ids)

    def claim(self, lease_id: str) -> str:
        """'held' (and extended for the pull that follows), 'ended', or 'unknown': the
        worker hears of a lease a step after the prefill answers, so a claim can come
        first (the servicer, which handed the lease out, knows it then)."""
        held = self._held()
        if lease_id in held and lease_id not in self._ending:
            held[lease_id] = max(held[lease_id], self.clock() + self.worker._lease_extension)
            return "held"
        return "ended" if lease_id in self._ended or lease_id in self._ending else "unknown"

    def step(self, done_sending: set[str]) -> None:
        """After the connector's step: note new leases, count the ended ones."""
        held = self._held()
        now = self.clock()
        for lease_id in held.keys() - self._open:
            self._open.add(lease_id)
            self.opened += 1
            if (self._early.pop(lease_id, None) is not None
                    or self._early.pop(request_of(lease_id), None) is not None):
                held[lease_id] = -math.inf
                self._ending[lease_id] = "aborted"
        for lease_id in done_sending:
            if lease_id in self._ended:
                continue
            if lease_id not in self._open:        # opened and ended within one step
                self.opened += 1
            asked = self._ending.pop(lease_id, None)
            outcome = asked or ("expired" if lease_id in self._expired_now else "released")
            self._open.discard(lease_id)
            self.outcomes[outcome] += 1
            self._ended[lease_id] = outcome
            if len(self._ended) > _REMEMBER:
                self._ended.popitem(last=False)
        self._expired_now = set()
        for lease_id in [i for i, until in self._early.items() if until < now]:
            del self._early[lease_id]

    def stats(self) -> dict[str, int]:
        return {"open": len(self._open), "opened": self.opened, **self.outcomes}


class WorkerLeases:
    """vLLM worker extension (`worker_extension_cls`): the engine's `collective_rpc`
    reaches the connector's leases through these methods."""

    def pdserve_leases(self, op: str, lease_ids: list[str]) -> dict:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        leases = getattr(get_kv_transfer_group(), "leases", None) \
            if has_kv_transfer_group() else None
        if leases is None:
            return {"found": [False] * len(lease_ids), "stats": None}
        if op == "claim":
            found = [leases.claim(i) for i in lease_ids]
        elif op in ("release", "abort"):
            found = [leases.end(i, "released" if op == "release" else "aborted")
                     for i in lease_ids]
        elif op == "stats":
            found = []
        else:
            raise ValueError(f"unknown lease operation {op!r}")
        return {"found": found, "stats": leases.stats()}
