"""The edge replicas' admission reports: how many requests each has let into the pool.

Each edge admits while the decode pool has room (services/edge/admission.py).
The engines' own load reports lag too much to see another edge's admissions in
time, so each edge tells the router its count whenever it reads the pool (ten
times a second while other edges report too: what one admits or frees reaches
the others within two readings; once a second for a lone edge), and hears
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
    admitted: int = 0           # the other edges' admitted requests
    edges: int = 0              # edges reporting, the asking one included


class EdgeReports:
    def __init__(self) -> None:
        self._last: dict[str, tuple[int, float]] = {}     # edge -> (admitted, when)

    def report(self, edge_id: str, admitted: int) -> Elsewhere:
        """Record `edge_id`'s count; the other live edges' sum. No edge_id: only read."""
        now = time.monotonic()
        if edge_id:
            self._last[edge_id] = (admitted, now)
        for gone in [e for e, (_, at) in self._last.items() if now - at > REPORT_SECONDS]:
            del self._last[gone]
        others = sum(a for e, (a, _) in self._last.items() if e != edge_id)
        return Elsewhere(others, len(self._last))
