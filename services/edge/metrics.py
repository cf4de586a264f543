"""The edge's Prometheus metrics: the end-to-end view, under `pdserve:`.

Where vLLM has a series for the same quantity the edge's keeps vLLM's suffix and
unit (`pdserve:time_to_first_token_seconds` beside each engine's
`vllm:time_to_first_token_seconds`), so one scrape of both never mixes the
edge's whole-request view with an engine's part of it. Latency series carry
`path` (disaggregated or local).
"""
from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 2.5, 5.0)


class EdgeMetrics:
    """One registry per edge app, so tests can run several apps in one process."""

    def __init__(self, model: str = "") -> None:
        r = self.registry = CollectorRegistry()
        self._generation_series(r)
        self._path_series(r)
        self._admission_series(r)
        self._stream_series(r)
        self._every_series(model)

    def _generation_series(self, r: CollectorRegistry) -> None:
        """Requests, their latencies and tokens."""
        self.requests = Counter("pdserve:requests", "Requests answered, by endpoint, path and "
                                "HTTP status",
                                ["endpoint", "path", "status"], registry=r)
        self.running = Gauge("pdserve:num_requests_running", "Generations running now",
                             ["model_name"], registry=r)
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "Time to first token",
                              ["model_name", "path"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve:inter_token_latency_seconds", "Time between two "
                             "consecutive outputs of a generation, as the edge received them",
                             ["model_name", "path"], buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "From arrival to the last "
                             "token",
                             ["model_name", "path"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens", ["model_name"],
                                     registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Generated tokens",
                                         ["model_name"], registry=r)
        self.kv_external_tokens = Counter(
            "pdserve:kv_transferred_tokens", "Prompt tokens of P/D requests whose KV the "
            "decode worker did not compute: pulled from the prefill worker, or held already "
            "in its prefix cache (its vllm:external_prefix_cache_hits counts the pulled part)",
            ["model_name"], registry=r)

    def _path_series(self, r: CollectorRegistry) -> None:
        """Where requests went: placements, fallbacks, failovers, migrations."""
        self.placements = Counter(
            "pdserve:placements", "Requests by the router's placement reason (remote, short, "
            "cached, no-prefill, prefill-saturated)", ["model_name", "reason"], registry=r)
        self.prefill_fallbacks = Counter(
            "pdserve:prefill_fallbacks", "Requests prefilled locally because remote prefill "
            "failed", ["model_name"], registry=r)
        self.prefill_first_tokens = Counter(
            "pdserve:prefill_first_tokens", "Generations whose first token was the prefill "
            "worker's, sent before the KV handover (--first-token prefill)", ["model_name"],
            registry=r)
        self.prefill_failovers = Counter(
            "pdserve:prefill_failovers", "Prefill legs retried on another prefill worker",
            ["model_name"], registry=r)
        self.migrations = Counter(
            "pdserve:migrations", "Generations moved to another decode worker mid-stream "
            "(its worker died, stalled or drained)", ["model_name"], registry=r)
        self.migration_seconds = Histogram(
            "pdserve:migration_seconds", "From a decode leg's failure to the next leg placed",
            ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)

    def _admission_series(self, r: CollectorRegistry) -> None:
        """The admission queue: its length, waits, preemptions and refusals."""
        self.queue_length = Gauge("pdserve:queue_length", "Requests waiting for admission",
                                  registry=r)
        self.admitted_elsewhere = Gauge("pdserve:admitted_elsewhere", "Requests the other "
                                        "edge replicas hold in the decode pool, as the router "
                                        "last reported them (no room for them here)", registry=r)
        self.queue_wait = Histogram("pdserve:request_queue_time_seconds", "Time each admitted "
                                    "request waited in the admission queue", buckets=(
                                        0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                    registry=r)
        self.preemptions = Counter("pdserve:preemptions", "Running requests that gave their "
                                   "slot up to a tenant owed it, and went on once admitted "
                                   "again", registry=r)
        self.rejections = Counter("pdserve:rejections", "Requests refused at admission "
                                  "(queue_full, wait, draining)", ["reason"], registry=r)

    def _stream_series(self, r: CollectorRegistry) -> None:
        """Resumable streams and their readers."""
        self.streams_open = Gauge("pdserve:streams_open", "Generations streaming on this edge",
                                  registry=r)
        self.streams_ended = Counter(
            "pdserve:streams_ended", "Streamed generations by how they ended (finished, "
            "cancelled, abandoned: no reader came back in the resume window, failed)",
            ["outcome"], registry=r)
        self.stream_resumes = Counter("pdserve:stream_resumes", "Readers that joined or "
                                      "resumed a stream by its id", ["transport"], registry=r)
        self.streams_cut = Counter("pdserve:streams_cut", "Readers cut off for not reading "
                                   "(they may resume from the log)", ["transport"], registry=r)

    def _every_series(self, model: str) -> None:
        """Create each labelled series at 0 before its first event, so a rate() over it
        reads 0 instead of nothing (dashboards and alerts see a quiet edge as quiet)."""
        for counter in (self.prefill_fallbacks, self.prefill_failovers, self.migrations,
                        self.prompt_tokens, self.generation_tokens, self.kv_external_tokens):
            counter.labels(model)
        self.running.labels(model)
        for reason in ("remote", "short", "cached", "no-prefill", "prefill-saturated"):
            self.placements.labels(model, reason)
        for reason in ("queue_full", "wait", "draining"):
            self.rejections.labels(reason)
        for outcome in ("finished", "cancelled", "abandoned", "failed"):
            self.streams_ended.labels(outcome)
        for transport in ("sse", "ws"):
            self.stream_resumes.labels(transport)
            self.streams_cut.labels(transport)


def observe_all(histogram: Histogram, amounts: list[float]) -> None:
    """`histogram.observe(a)` for every `a` of `amounts` (a labelled child), each bucket
    and the sum incremented once. A generation's inter-token gaps are observed when it
    ends: one by one, 400 cost 0.34 ms, and 1,000 generations ending within a second
    spent a third of the edge's CPU there while the others' last tokens waited
    (docs/design/2026-12-05-itl-histogram-in-one-pass.md). A bucket is the first whose
    bound is >= the amount, as `observe` has it; where the client library keeps its
    buckets some other way, `observe` one by one."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for amount in amounts:
            histogram.observe(amount)
        return
    histogram._raise_if_not_observable()
    # The first bound >= each amount; a NaN sorts past the last bound, so it lands in
    # no bucket, as in observe (it is <= none).
    at = np.searchsorted(bounds, np.array(amounts, dtype=float), side="left")
    counts = np.bincount(at, minlength=len(bounds) + 1)
    for i in np.flatnonzero(counts[:len(bounds)]):
        buckets[i].inc(int(counts[i]))
    total.inc(sum(amounts))
