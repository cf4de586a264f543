"""Lease bookkeeping over a connector worker's `_reqs_to_send`, step by step (the
engine-backed path is in tests/e2e/test_leases.py)."""
from __future__ import annotations

from pdserve.transfer.leases import Leases


class _Worker:
    """The part of vLLM's NIXL worker that leases touch: lease id -> expiry, and
    the reaping of expired ones into the step's finished-sending set."""

    def __init__(self, clock):
        self.clock = clock
        self._reqs_to_send: dict[str, float] = {}
        self._lease_extension = 4

    def _reap_expired_send_leases(self, done: set[str]) -> None:
        for rid in [r for r, at in self._reqs_to_send.items() if self.clock() >= at]:
            del self._reqs_to_send[rid]
            done.add(rid)

    def step(self, leases: Leases, notified: set[str] = frozenset()) -> None:
        """One engine step: decoders' notifications, then expiry, then the books."""
        done = set()
        for rid in notified:
            self._reqs_to_send.pop(rid, None)
            done.add(rid)
        self._reap_expired_send_leases(done)
        leases.step(done)


def _setup():
    now = [0.0]
    worker = _Worker(lambda: now[0])
    return now, worker, Leases(worker, clock=lambda: now[0])


def test_each_lease_ends_once_with_its_outcome():
    now, worker, leases = _setup()
    worker._reqs_to_send |= {"a": 6.0, "b": 6.0, "c": 6.0}
    worker.step(leases)
    assert leases.stats() == {"open": 3, "opened": 3, "released": 0, "aborted": 0, "expired": 0}
    assert leases.end("b")                            # aborted: ends at the next step
    assert not leases.end("b")                        # idempotent
    worker.step(leases, notified={"a"})               # a decoder read "a"
    now[0] = 7.0
    worker.step(leases)                               # nobody came for "c"
    assert leases.stats() == {"open": 0, "opened": 3, "released": 1, "aborted": 1, "expired": 1}
    assert not leases.end("a") and not leases.end("c") and leases.claim("a") == "ended"


def test_a_claim_extends_the_lease_for_the_pull():
    now, worker, leases = _setup()
    worker._reqs_to_send["a"] = 6.0
    worker.step(leases)
    now[0] = 5.0
    assert leases.claim("a") == "held"                # held until at least 5 + 4
    now[0] = 8.0
    worker.step(leases)
    assert leases.stats()["open"] == 1
    assert leases.claim("unknown") == "unknown"       # the servicer decides


def test_an_abort_that_comes_before_the_worker_knows_the_lease_still_ends_it():
    now, worker, leases = _setup()
    assert not leases.end("early")                    # not held (yet): found=false
    worker._reqs_to_send["early"] = 6.0               # the scheduler's news arrives
    worker.step(leases)
    worker.step(leases)
    assert leases.stats() == {"open": 0, "opened": 1, "released": 0, "aborted": 1, "expired": 0}


def test_a_lease_opened_and_released_within_one_step_is_counted():
    now, worker, leases = _setup()
    worker._reqs_to_send["quick"] = 6.0
    worker.step(leases, notified={"quick"})
    assert leases.stats() == {"open": 0, "opened": 1, "released": 1, "aborted": 0, "expired": 0}


def test_the_request_id_ends_its_lease_before_and_after_the_worker_knows_it():
    now, worker, leases = _setup()
    worker._reqs_to_send["req-1-0a1b2c3d"] = 6.0       # vLLM's id: <request id>-<8 hex>
    worker.step(leases)
    assert leases.end("req-1")                         # a caller knows only its own id
    assert not leases.end("req-2")                     # not there yet: remembered
    worker._reqs_to_send["req-2-deadbeef"] = 6.0
    worker.step(leases)
    worker.step(leases)
    assert leases.stats() == {"open": 0, "opened": 2, "released": 0, "aborted": 2, "expired": 0}
