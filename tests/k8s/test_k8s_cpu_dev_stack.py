"""The cpu-dev overlay's containers, run here as plain processes, serve a request end to end.

The pods run as local processes (local_cluster.py says what is translated). Then the probes
are run as the kubelet runs them, one streamed request goes through edge -> router ->
prefill -> (NIXL) -> decode, and SIGTERM must stop each process within its pod's
terminationGracePeriodSeconds.
"""
from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import pytest
from k8s_manifests import keda_metrics
from local_cluster import ORDER, LocalCluster, stream
from support import alive, metric_sum, parse_sse

pytestmark = pytest.mark.engine


def test_cpu_dev_containers_serve_a_stream_end_to_end(tmp_path):
    cluster = LocalCluster(tmp_path)
    stopped = {}
    try:
        cluster.up()
        assert all(cluster.probe(n, "livenessProbe") for n in ORDER)

        edge = f"http://127.0.0.1:{cluster.local_port('edge', 'http')}"
        key = cluster.api_key()
        model = cluster.pods["edge"].main.env["PDSERVE_SERVED_MODEL_NAME"]
        with pytest.raises(urllib.error.HTTPError) as refused:
            stream(edge, "not-a-key", model)
        assert refused.value.code == 401

        status, headers, raw = stream(edge, key, model)
        assert status == 200 and headers["x-pdserve-path"] == "disaggregated"
        events = [data for _, data in parse_sse(raw)]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 16 and usage["prompt_tokens"] >= 32
        text = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in map(json.loads, events[:-1]) if c["choices"])
        assert text

        # The prompt's KV crossed from prefill to decode (UCX over TCP, the transport the
        # overlay sets): the decode engine counts the pulled tokens as external hits.
        metrics = {n: f"http://127.0.0.1:{cluster.local_port(n, 'metrics')}/metrics"
                   for n in ("prefill", "decode", "router")}
        pulled = metric_sum(metrics["decode"], "vllm:external_prefix_cache_hits_total")
        assert usage["prompt_tokens"] - 1 <= pulled <= usage["prompt_tokens"]
        # What the autoscalers query is what each pool's workers serve.
        for pool, names in keda_metrics().items():
            with urllib.request.urlopen(metrics[pool], timeout=10) as r:
                body = r.read().decode()
            missing = {n for n in names if not re.search(rf"^{re.escape(n)}", body, re.MULTILINE)}
            assert not missing, f"{pool} serves none of {missing}"
        with urllib.request.urlopen(metrics["router"], timeout=10) as r:
            assert r.status == 200
    finally:
        stopped = cluster.stop()
    deadline = time.monotonic() + 10          # SIGKILLed stragglers take a moment to go
    while (left := alive(cluster.tree)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left after shutdown: {left}"
    for name, (code, took) in stopped.items():
        assert code == 0, f"{name} exited {code} after {took:.1f} s:\n" + "\n".join(
            cluster.procs[name].lines[-30:])
