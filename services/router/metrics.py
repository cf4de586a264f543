"""The router's Prometheus series: its decisions by reason and its view of each worker.

Served over HTTP on the router's `--metrics-port`. The per-worker
gauges are read from the registry at scrape time, so they say what the router
believed when it last placed: `worker_id` and `role` labels tell the workers
apart on one dashboard.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from .registry import ROLE_NAMES, WorkerRegistry

# The placement reasons (placement.py): the part of a decision's reason before ":".
REASONS = ("remote", "short", "cached", "no-prefill", "prefill-saturated")


class RouterMetrics:
    """One registry per router; the workers' gauges are collected from `registry`."""

    def __init__(self, workers: WorkerRegistry):
        r = self.registry = CollectorRegistry()
        self.workers = workers
        self.decisions = Counter("pdserve:router_decisions", "Route answers by the placement "
                                 "reason", ["reason"], registry=r)
        for reason in REASONS:
            self.decisions.labels(reason)
        self.unplaced = Counter("pdserve:router_unplaced", "Route calls no worker could take "
                                "(answered UNAVAILABLE)", registry=r)
        self.route_seconds = Histogram("pdserve:router_route_seconds", "Time to answer Route",
                                       buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                                0.01, 0.025, 0.1), registry=r)
        r.register(self)

    def routed(self, reason: str, started: float) -> None:
        self.decisions.labels(reason.split(":")[0]).inc()
        self.route_seconds.observe(time.perf_counter() - started)

    def collect(self):
        """Per worker, as the router sees it now: serving, load, capacity, KV usage."""
        labels = ["worker_id", "role"]
        serving = GaugeMetricFamily("pdserve:router_worker_serving", "1 when the router offers "
                                    "the worker requests (heartbeat or probe fresh)", labels=labels)
        load = GaugeMetricFamily("pdserve:router_worker_load", "Requests running and waiting on "
                                 "the worker's engine, plus those placed since its last report",
                                 labels=labels)
        capacity = GaugeMetricFamily("pdserve:router_worker_capacity", "Requests the worker's "
                                     "engine runs at once (0: unknown)", labels=labels)
        kv = GaugeMetricFamily("pdserve:router_worker_kv_usage_perc", "Fraction of the "
                               "worker's KV cache in use, as last reported", labels=labels)
        for w in self.workers.snapshot():
            key = [w.worker_id, ROLE_NAMES.get(w.role, "unknown")]
            serving.add_metric(key, float(w.serving))
            load.add_metric(key, w.load)
            capacity.add_metric(key, w.capacity)
            kv.add_metric(key, w.kv_usage)
        yield from (serving, load, capacity, kv)
