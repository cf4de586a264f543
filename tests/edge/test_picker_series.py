"""An edge exports what an InferencePool's endpoint picker scores members on, under
vLLM's names: its admission queue, its running generations, the decode pool's KV use."""
from __future__ import annotations

import aiohttp
from prometheus_client import CollectorRegistry

from pdserve.services.edge.picker_series import PickerSeries
from pdserve.v1 import common_pb2, router_pb2
from synthetic_stack import edge_stack


def _value(registry: CollectorRegistry, name: str) -> float:
    return registry.get_sample_value(name, {"model_name": "m"})


def test_the_pool_kv_use_is_the_mean_of_serving_decode_workers():
    registry = CollectorRegistry()
    series = PickerSeries(registry, "m")
    decode, prefill = common_pb2.WORKER_ROLE_DECODE, common_pb2.WORKER_ROLE_PREFILL
    series.update(3, 7, [
        router_pb2.WorkerInfo(worker_id="d0", role=decode, serving=True, kv_usage=0.2),
        router_pb2.WorkerInfo(worker_id="d1", role=decode, serving=True, kv_usage=0.6),
        router_pb2.WorkerInfo(worker_id="d2", role=decode, serving=False, kv_usage=1.0),
        router_pb2.WorkerInfo(worker_id="p0", role=prefill, serving=True, kv_usage=0.9)])
    assert _value(registry, "vllm:num_requests_waiting") == 3
    assert _value(registry, "vllm:num_requests_running") == 7
    assert abs(_value(registry, "vllm:kv_cache_usage_perc") - 0.4) < 1e-9
    series.update(0, 0, [])                                  # no decode worker: nothing used
    assert _value(registry, "vllm:kv_cache_usage_perc") == 0


async def test_an_edge_serves_the_picker_series_on_its_metrics(model_dir):
    async with edge_stack(model_dir) as stack:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{stack.url}/metrics") as r:
                text = await r.text()
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc"):
        assert f'{name}{{model_name="{stack.model}"}}' in text, name
