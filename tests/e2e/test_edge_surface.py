"""/v1/models, /health, /metrics, and what a client that goes away leaves behind."""
from __future__ import annotations

import json
import re
import socket
import time
import urllib.request

from conftest import _post


def _get(stack, path: str) -> tuple[int, str, dict]:
    with urllib.request.urlopen(f"{stack.url}{path}", timeout=10) as r:
        return r.status, r.read().decode(), dict(r.headers)


def test_models_lists_the_model_with_root(stack):
    status, body, _ = _get(stack, "/v1/models")
    data = json.loads(body)
    assert status == 200 and data["object"] == "list"
    (entry,) = data["data"]
    assert entry["id"] == stack.model and entry["root"] == stack.model
    assert entry["object"] == "model"


def test_health_reports_every_worker_serving(stack):
    status, body, _ = _get(stack, "/health")
    data = json.loads(body)
    assert status == 200 and data["status"] == "ok"
    roles = sorted(w["role"] for w in data["workers"])
    assert roles == ["WORKER_ROLE_DECODE", "WORKER_ROLE_PREFILL"]
    assert all(w["serving"] for w in data["workers"])


def test_metrics_are_prometheus_text(stack):
    # One request first: a histogram has no buckets until something is observed,
    # and this test may be the first of the session to touch the stack.
    # (_post raises on any status but 2xx.)
    assert _post(f"{stack.url}/v1/completions",
                 {"model": stack.model, "prompt": "the dog", "max_tokens": 2})["choices"]
    status, body, headers = _get(stack, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for name in ("pdserve:requests_total", "pdserve:time_to_first_token_seconds_bucket",
                 "pdserve:e2e_request_latency_seconds_count", "pdserve:num_requests_running"):
        assert name in body


def _running(stack) -> float:
    _, body, _ = _get(stack, "/metrics")
    return sum(float(v) for v in re.findall(r"^pdserve:num_requests_running\{[^}]*\} (\S+)$",
                                            body, re.M))


def test_client_disconnect_mid_stream_ends_the_request(stack):
    """Read a few SSE events of a long generation, hang up; once the resume window
    (1 s on this stack) passes with nobody back, the edge must end the request (and
    cancel decode) instead of generating on for nobody."""
    host, port = stack.url.removeprefix("http://").split(":")
    body = json.dumps({"model": stack.model, "prompt": "the dog " * 40, "max_tokens": 1500,
                       "ignore_eos": True, "stream": True}).encode()
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while got.count(b"data: ") < 3:
            got += s.recv(4096)
    assert b"200 OK" in got
    rid = re.search(rb"x-request-id: (\S+)", got, re.I).group(1).decode()
    deadline = time.monotonic() + 20
    while _running(stack) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running(stack) == 0
    # The decode worker saw the cancellation and aborted the engine request
    # long before its 1500 tokens; the edge also sent it an Abort.
    pattern = re.compile(rf"generate {rid} on decode\S* cancelled after (\d+) tokens")
    while not (hits := [m for line in stack.proc.lines if (m := pattern.search(line))]) \
            or not any(f"abort {rid} on decode" in line for line in stack.proc.lines):
        assert time.monotonic() < deadline, "decode worker never logged the cancellation/abort:\n" \
            + "\n".join(line for line in stack.proc.lines if rid in line)
        time.sleep(0.2)
    assert 3 <= int(hits[0].group(1)) < 1500
    assert time.monotonic() - started < 20
    _, body, _ = _get(stack, "/metrics")
    assert re.search(r'pdserve:requests_total\{[^}]*status="499"\} 1\.0', body)
