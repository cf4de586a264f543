"""The series an InferencePool's endpoint picker scores its members on, from an edge.

In the inference-extension overlay the pool's members are the edges (an engine speaks
vLLM's gRPC engine protocol, not the OpenAI HTTP the gateway forwards, and the choice
of prefill and decode worker is the router's). The extension's picker scores members
on vLLM's own series (its model-server protocol): queued requests, running requests,
KV-cache use. Each edge exports them under those names for what it is: its own
admission queue and the generations it runs, and the decode pool's mean KV-cache use
as its last view of the pool shows it (the same on every edge). The picker then sends
a request to the edge with the shortest queue, which is the one that admits it soonest.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from pdserve.v1 import common_pb2


class PickerSeries:
    """`vllm:num_requests_waiting`, `vllm:num_requests_running` and
    `vllm:kv_cache_usage_perc` of one edge, labelled by model as vLLM labels them."""

    def __init__(self, registry: CollectorRegistry, model: str):
        labels = ["model_name"]
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests this edge holds for "
                             "admission (for an InferencePool's picker)", labels,
                             registry=registry).labels(model)
        self.running = Gauge("vllm:num_requests_running", "Generations this edge admitted "
                             "and runs (for an InferencePool's picker)", labels,
                             registry=registry).labels(model)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Mean KV-cache use of the serving "
                              "decode workers, as this edge last read the pool (1 = full)",
                              labels, registry=registry).labels(model)

    def update(self, queued: int, in_flight: int, workers) -> None:
        """Called after each reading of the pool (`workers`: the router's list)."""
        self.waiting.set(queued)
        self.running.set(in_flight)
        decode = [w.kv_usage for w in workers
                  if w.serving and w.role == common_pb2.WORKER_ROLE_DECODE]
        self.kv_usage.set(sum(decode) / len(decode) if decode else 0.0)
