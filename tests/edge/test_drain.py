"""SIGTERM on a real edge process: /health fails and nothing new is admitted at once,
while the stream in flight runs to its end; then the edge exits 0."""
from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
import urllib.error
import urllib.request

import pytest

from support import http_status, wait_http, Proc, free_port, parse_sse, pdserve_cmd



@pytest.fixture(scope="module")
def router(model_dir):
    """A synthetic decode engine (20 tokens/s) behind a router process: its address."""
    engine_port, router_port = free_port(), free_port()
    procs = [Proc([sys.executable, "-m", "pdserve.bench.synthetic", "--model", str(model_dir),
                   "--port", str(engine_port), "--rate", "20"], name="synthetic")]
    try:
        procs.append(Proc(pdserve_cmd("router", "--port", str(router_port), "--decode-worker",
                                      f"127.0.0.1:{engine_port}"), name="router"))
        yield f"127.0.0.1:{router_port}"
    finally:
        for p in reversed(procs):
            p.stop(timeout=20)


@contextlib.contextmanager
def _edge(model_dir, router: str, drain: float):
    """An edge process on that router, ready: (its URL, its Proc)."""
    edge_port = free_port()
    edge = Proc(pdserve_cmd("edge", "--port", str(edge_port), "--grpc-port", str(free_port()),
                            "--router", router, "--model", str(model_dir),
                            "--min-prefill-workers", "0", "--drain-seconds", str(drain)),
                name="edge")
    try:
        url = f"http://127.0.0.1:{edge_port}"
        wait_http(f"{url}/health", edge, 60)
        yield url, edge
    finally:
        edge.stop(timeout=20)


def _stream(url: str, model_dir, max_tokens: int):
    body = json.dumps({"model": str(model_dir), "prompt": "hello", "max_tokens": max_tokens,
                       "stream": True}).encode()
    return urllib.request.urlopen(urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}),
        timeout=60)


def test_sigterm_drains(model_dir, router):
    with _edge(model_dir, router, 20) as (url, edge):
        body = json.dumps({"model": str(model_dir), "prompt": "hello", "max_tokens": 60,
                           "stream": True}).encode()
        with _stream(url, model_dir, 60) as stream:
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


def test_a_sigtermed_edge_stops_within_its_drain_and_shutdown_budget(model_dir, router):
    """A stream longer than the drain (1 s of a 50 s one) is cut at the drain's end: its
    client gets an end, and the edge exits within the drain plus its shutdown timeouts
    (k8s/base/edge.yaml's grace period is that sum), not after aiohttp's own 30-60 s."""
    from pdserve.services.edge.server import stop_budget

    with _edge(model_dir, router, 1) as (url, edge):
        with _stream(url, model_dir, 1000) as stream:
            first = stream.readline()
            edge.popen.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            rest = stream.read()
        assert edge.popen.wait(timeout=stop_budget(1) + 10) == 0
        took = time.monotonic() - signalled
    events = parse_sse((first + rest).decode())
    assert events[-1][1] == "[DONE]", events[-3:]
    assert "error" in json.loads(events[-2][1]), events[-2:]      # cut, and told so
    assert 1 <= took <= stop_budget(1) + 2, took                   # 2 s: the exit itself
    print(f"edge stopped {took:.1f} s after SIGTERM (drain 1 s, budget {stop_budget(1):g} s)")
