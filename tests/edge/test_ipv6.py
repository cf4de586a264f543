"""Real edge, router and engine processes on IPv6: gRPC between them to [::1]:PORT,
and an edge on `::` that takes IPv4 clients too, as its gRPC port does."""
from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

import pytest

from support import http_status, wait_http, Proc, free_port, ipv6_loopback, parse_sse, pdserve_cmd, stop_all

pytestmark = pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback (::1) here")



def test_an_edge_on_all_addresses_streams_from_an_engine_on_ipv6_loopback(model_dir):
    engine_port, router_port, edge_port = free_port(), free_port(), free_port()
    procs = [Proc([sys.executable, "-m", "pdserve.bench.synthetic", "--model", str(model_dir),
                   "--host", "::1", "--port", str(engine_port)], name="synthetic")]
    try:
        procs.append(Proc(pdserve_cmd("router", "--host", "::1", "--port", str(router_port),
                                      "--decode-worker", f"[::1]:{engine_port}"), name="router"))
        edge = Proc(pdserve_cmd("edge", "--host", "::", "--port", str(edge_port),
                                "--grpc-port", str(free_port()),
                                "--router", f"[::1]:{router_port}", "--model", str(model_dir),
                                "--min-prefill-workers", "0"), name="edge")
        procs.append(edge)
        url = f"http://[::1]:{edge_port}"
        wait_http(f"{url}/health", edge, 60)
        assert http_status(f"http://127.0.0.1:{edge_port}/health") == 200
        body = json.dumps({"model": str(model_dir), "prompt": "hello", "max_tokens": 8,
                           "stream": True}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
            events = parse_sse(r.read().decode())
        assert events[-1][1] == "[DONE]"
        assert "".join(json.loads(data)["choices"][0]["text"] for _, data in events[:-1])
        assert any(f"http://[::]:{edge_port}" in line for line in edge.lines)
    finally:
        stop_all(procs, timeout=20)
