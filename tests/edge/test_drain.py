"""SIGTERM on a real edge process: /health fails and nothing new is admitted at once,
while the stream in flight runs to its end; then the edge exits 0."""
from __future__ import annotations

import json
import signal
import sys
import time
import urllib.error
import urllib.request

from support import http_status, wait_http, Proc, free_port, parse_sse, pdserve_cmd



def test_sigterm_drains(model_dir):
    engine_port, router_port, edge_port = free_port(), free_port(), free_port()
    procs = [Proc([sys.executable, "-m", "pdserve.bench.synthetic", "--model", str(model_dir),
                   "--port", str(engine_port), "--rate", "20"], name="synthetic")]
    try:
        procs.append(Proc(pdserve_cmd("router", "--port", str(router_port), "--decode-worker",
                                      f"127.0.0.1:{engine_port}"), name="router"))
        edge = Proc(pdserve_cmd("edge", "--port", str(edge_port), "--grpc-port",
                                str(free_port()), "--router", f"127.0.0.1:{router_port}",
                                "--model", str(model_dir), "--min-prefill-workers", "0",
                                "--drain-seconds", "20"), name="edge")
        procs.append(edge)
        url = f"http://127.0.0.1:{edge_port}"
        wait_http(f"{url}/health", edge, 60)
        body = json.dumps({"model": str(model_dir), "prompt": "hello", "max_tokens": 60,
                           "stream": True}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as stream:
            first = stream.readline()                  # the stream is under way (3 s long)
            edge.popen.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            assert http_status(f"{url}/health") == 503
            try:
                urllib.request.urlopen(urllib.request.Request(
                    f"{url}/v1/completions", data=body,
                    headers={"Content-Type": "application/json"}), timeout=5)
                raise AssertionError("a new request was admitted while draining")
            except urllib.error.HTTPError as e:
                assert e.code == 503 and e.headers["Retry-After"]
                assert json.loads(e.read())["error"]["code"] == "draining"
            rest = stream.read()
        events = parse_sse((first + rest).decode())
        assert events[-1][1] == "[DONE]"
        assert json.loads(events[-2][1])["choices"][0]["finish_reason"] == "length"
        assert edge.popen.wait(timeout=30) == 0
    finally:
        for p in reversed(procs):
            p.stop(timeout=20)
