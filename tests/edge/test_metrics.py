"""The edge's metrics: a generation's inter-token gaps observed in one pass."""
from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from pdserve.services.edge.metrics import _ITL_BUCKETS, observe_all


def _samples(registry: CollectorRegistry) -> dict:
    """Bucket counts and counts exactly, sums to rounding (one addition against many);
    creation times left out."""
    out = {}
    for metric in registry.collect():
        for s in metric.samples:
            if not s.name.endswith("_created"):
                key = (s.name, tuple(sorted(s.labels.items())))
                out[key] = (pytest.approx(s.value, rel=1e-12, nan_ok=True)
                            if s.name.endswith("_sum") else s.value)
    return out


def _histograms():
    one, bulk = CollectorRegistry(), CollectorRegistry()
    return ([Histogram("itl_seconds", "gaps", ["path"], buckets=_ITL_BUCKETS, registry=r)
             for r in (one, bulk)], one, bulk)


def test_observe_all_exposes_what_observing_one_by_one_does():
    (by_one, at_once), one, bulk = _histograms()
    rng = random.Random(7)
    for n in (0, 1, 400, 3):
        # gaps around and on every bucket bound, past the last one, zero and +inf
        amounts = ([rng.choice(_ITL_BUCKETS) for _ in range(n // 4)]
                   + [rng.uniform(0, 6) for _ in range(n - n // 4)]
                   + ([0.0, math.inf] if n == 3 else []))
        for path in ("local", "disaggregated"):
            for a in amounts:
                by_one.labels(path).observe(a)
            observe_all(at_once.labels(path), amounts)
    assert _samples(one) == _samples(bulk)
    assert _samples(bulk)[("itl_seconds_count", (("path", "local"),))] == 406


def test_a_nan_counts_in_the_sum_and_no_bucket_as_observe_has_it():
    (by_one, at_once), one, bulk = _histograms()
    for h in (by_one, at_once):
        h.labels("local").observe(0.01)
    by_one.labels("local").observe(math.nan)
    observe_all(at_once.labels("local"), [math.nan])
    assert _samples(one) == _samples(bulk)
    assert _samples(bulk)[("itl_seconds_count", (("path", "local"),))] == 1


def test_a_histogram_kept_otherwise_is_observed_one_by_one():
    class Plain:                                    # no bucket list of its own
        def __init__(self):
            self.seen = []

        def observe(self, amount):
            self.seen.append(amount)

    h = Plain()
    observe_all(h, [0.5, 0.25])
    assert h.seen == [0.5, 0.25]
