"""`pdserve up --host ::1`: the whole stack on IPv6 loopback, workers registered as
[::1]:PORT, the KV handed over on an IPv6 side channel, a completion streamed
through the edge at http://[::1]:PORT."""
from __future__ import annotations

import json
import urllib.request

import psutil
import pytest

from cases import CASES
from support import (Proc, free_port, free_port_run, ipv6_loopback, metric_sum, parse_sse,
                     pdserve_cmd)

pytestmark = pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback (::1) here")


def _listening(proc: Proc) -> dict[int, str]:
    """port -> address of every TCP listener in the stack's process tree."""
    out = {}
    for pid in proc.descendants():
        try:
            for c in psutil.Process(pid).net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    out[c.laddr.port] = c.laddr.ip
        except psutil.NoSuchProcess:
            pass
    return out


def test_the_stack_on_ipv6_loopback_streams_a_disaggregated_completion(model_dir):
    ports = {k: free_port() for k in ("edge", "grpc", "router", "prefill", "decode")}
    kv, metrics = free_port_run(2), free_port_run(2)
    proc = Proc(pdserve_cmd("up", "--host", "::1", "--port", str(ports["edge"]),
                            "--grpc-port", str(ports["grpc"]),
                            "--router-port", str(ports["router"]),
                            "--prefill-port", str(ports["prefill"]),
                            "--decode-port", str(ports["decode"]), "--kv-port", str(kv),
                            "--worker-metrics-port", str(metrics), "--model", str(model_dir),
                            # On the P/D path whatever the decode worker holds.
                            "--local-cached-fraction", "1", "--prefill-saturated", "0"),
                name="pdserve-up-ipv6")
    url = f"http://[::1]:{ports['edge']}"
    try:
        proc.wait_for(f"pdserve ready: {url} (router [::1]:{ports['router']}", timeout=400)
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            workers = json.loads(r.read())["workers"]
        assert {w["address"] for w in workers} == {
            f"[::1]:{ports['prefill']}", f"[::1]:{ports['decode']}"}
        ours = [*ports.values(), kv, kv + 1, metrics, metrics + 1]
        listening = _listening(proc)
        assert {p: listening.get(p) for p in ours} == {p: "::1" for p in ours}

        body = CASES[0].body(str(model_dir), True)
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
            assert r.headers["x-pdserve-path"] == "disaggregated"
            events = parse_sse(r.read().decode())
        assert events[-1][1] == "[DONE]"
        text = "".join(json.loads(data)["choices"][0]["text"] for _, data in events[:-1])
        assert text.strip()
        # The prompt's KV came over NIXL (its handshake on [::1]:kv), not recomputed.
        assert metric_sum(f"http://[::1]:{metrics + 1}/metrics",
                          "vllm:external_prefix_cache_hits_total") > 0
    finally:
        assert proc.stop(timeout=90) == 0, "\n".join(proc.lines[-40:])
