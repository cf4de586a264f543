"""The edge's last known view of the pool, and the readiness it gives.

The edge reads the router's worker list in the background (app.py's `_read_pool`,
once a second, ten times while other edges share the pool); `/health` answers
from the last reading and never calls the router itself. A probe therefore costs
nothing, and an edge stays ready through a router's restart (or the loss of one
replica) for as long as its view is younger than TRUST_SECONDS and shows the
minimum of serving workers: the streams it runs go straight to the workers, and
new requests are placed by another replica or once the router is back.
"""
from __future__ import annotations

import time

from pdserve.v1 import common_pb2, router_pb2

# A reading older than this no longer vouches for the pool: long enough for a router
# pod to be rescheduled and start, short enough that an edge cut off from every
# router leaves its Service.
TRUST_SECONDS = 120.0

_ROLES = (common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE)


class PoolView:
    """The workers as the router last listed them, and when that was."""

    def __init__(self) -> None:
        self.workers: list[router_pb2.WorkerInfo] = []
        self.read_at: float | None = None         # time.monotonic() of the last reading
        self.router_error = ""                    # why the last attempt failed, if it did

    def observe(self, workers, now: float | None = None) -> None:
        """A reading: `workers` as the router lists them."""
        self.workers = list(workers)
        self.read_at = time.monotonic() if now is None else now
        self.router_error = ""

    def failed(self, error: str) -> None:
        """A reading that failed (`error`: the router call's status): the view is kept."""
        self.router_error = error

    def readiness(self, min_prefill: int, min_decode: int,
                  now: float | None = None) -> tuple[int, dict]:
        """(HTTP status, body) of `/health`: 200 while the view is trusted and the minimum
        prefill and decode workers serve in it ("degraded" when some worker it lists
        does not: one dead worker must not take every edge out of its Service)."""
        now = time.monotonic() if now is None else now
        if self.read_at is None:
            return 503, {"status": "unavailable",
                         "reason": f"router: {self.router_error or 'not read yet'}"}
        age = now - self.read_at
        listed = [{"worker_id": w.worker_id, "role": common_pb2.WorkerRole.Name(w.role),
                   "address": w.address, "serving": w.serving} for w in self.workers]
        body = {"workers": listed, "view_age_seconds": round(age, 3)}
        if self.router_error:
            body["router"] = self.router_error
        if age > TRUST_SECONDS:
            return 503, {"status": "unavailable", **body,
                         "reason": f"router: no reading for {age:.0f} s"}
        serving = {r: sum(1 for w in self.workers if w.serving and w.role == r) for r in _ROLES}
        ok = (serving[common_pb2.WORKER_ROLE_PREFILL] >= min_prefill
              and serving[common_pb2.WORKER_ROLE_DECODE] >= min_decode)
        status = ("unavailable" if not ok else
                  "ok" if all(w.serving for w in self.workers) else "degraded")
        return (200 if ok else 503), {"status": status, **body}
