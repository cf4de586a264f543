"""The edge replicas' admission reports: how many requests each has let into the pool.

Each edge admits while the decode pool has room (services/edge/admission.py).
The engines' own load reports lag too much to see another edge's admissions in
time, so each edge tells the router its count whenever it reads the pool (once
a second, ten times a second while any edge has requests waiting), and hears
back the others' sum: with several replicas the pool is shared out, not
admitted once per replica. A report is kept REPORT_SECONDS; an edge that stops
reporting (it died, or lost the router) stops counting then.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

REPORT_SECONDS = 3.0        # an edge reports at least once a second


@dataclass(frozen=True, slots=True)
class Elsewhere:
    admitted: int = 0
    waiting: int = 0


class EdgeReports:
    def __init__(self) -> None:
        self._last: dict[str, tuple[int, int, float]] = {}   # edge -> (admitted, waiting, at)

    def report(self, edge_id: str, admitted: int, waiting: int) -> Elsewhere:
        """Record `edge_id`'s counts; the other live edges' sums. No edge_id: only read."""
        now = time.monotonic()
        if edge_id:
            self._last[edge_id] = (admitted, waiting, now)
        for gone in [e for e, (_, _, at) in self._last.items() if now - at > REPORT_SECONDS]:
            del self._last[gone]
        others = [(a, w) for e, (a, w, _) in self._last.items() if e != edge_id]
        return Elsewhere(sum(a for a, _ in others), sum(w for _, w in others))
