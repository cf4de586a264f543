"""The edge's Prometheus metrics. vLLM-compatible names where vLLM has one."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EdgeMetrics:
    """One registry per edge app, so tests can run several apps in one process."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdserve_requests", "Completed requests",
                                ["endpoint", "path", "status"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests streaming now",
                             ["model_name"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              ["model_name", "path"], buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency",
                             ["model_name", "path"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", ["model_name"],
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens",
                                         ["model_name"], registry=r)
        self.kv_external_tokens = Counter(
            "pdserve_kv_transferred_tokens", "Prompt tokens of P/D requests whose KV the "
            "decode worker did not compute: pulled from the prefill worker, or held already "
            "in its prefix cache (its vllm:external_prefix_cache_hits counts the pulled part)",
            ["model_name"], registry=r)
        self.placements = Counter(
            "pdserve_placements", "Requests by the router's placement reason (remote, short, "
            "cached, no-prefill, prefill-saturated)", ["model_name", "reason"], registry=r)
        self.prefill_fallbacks = Counter(
            "pdserve_prefill_fallbacks", "Requests prefilled locally because remote prefill "
            "failed", ["model_name"], registry=r)
        self.prefill_failovers = Counter(
            "pdserve_prefill_failovers", "Prefill legs retried on another prefill worker",
            ["model_name"], registry=r)
        self.migrations = Counter(
            "pdserve_migrations", "Generations moved to another decode worker mid-stream "
            "(its worker died, stalled or drained)", ["model_name"], registry=r)
        self.migration_seconds = Histogram(
            "pdserve_migration_seconds", "From a decode leg's failure to the next leg placed",
            ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_length = Gauge("pdserve_queue_length", "Requests waiting for admission",
                                  registry=r)
        self.queue_wait = Histogram("pdserve_queue_wait_seconds", "Time each admitted request "
                                    "waited in the admission queue", buckets=(
                                        0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                    registry=r)
        self.rejections = Counter("pdserve_rejections", "Requests refused at admission "
                                  "(queue_full, wait, draining)", ["reason"], registry=r)
        self.streams_open = Gauge("pdserve_streams_open", "Generations streaming on this edge",
                                  registry=r)
        self.streams_ended = Counter(
            "pdserve_streams_ended", "Streamed generations by how they ended (finished, "
            "cancelled, abandoned: no reader came back in the resume window, failed)",
            ["outcome"], registry=r)
        self.stream_resumes = Counter("pdserve_stream_resumes", "Readers that joined or "
                                      "resumed a stream by its id", ["transport"], registry=r)
        self.streams_cut = Counter("pdserve_streams_cut", "Readers cut off for not reading "
                                   "(they may resume from the log)", ["transport"], registry=r)
