"""`pdserve up` (1 prefill + 1 decode) when a worker goes away, by crash or by SIGTERM.

A SIGKILLed prefill worker costs no request (the decode worker prefills
locally meanwhile) and is restarted by the supervisor; a SIGTERMed decode
worker leaves the router at once but finishes the stream it is running before
it exits (then it is restarted too).
"""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import psutil
import pytest

from cases import CASES
from support import Proc, free_port, free_port_run, pdserve_cmd

STREAM_TOKENS = 400                     # ~5 s of decoding, well inside max_model_len


@pytest.fixture(scope="module")
def up(model_dir):
    ports = {k: free_port() for k in ("edge", "grpc", "router", "prefill", "decode")}
    proc = Proc(pdserve_cmd("up", "--port", str(ports["edge"]), "--grpc-port", str(ports["grpc"]),
                            "--router-port", str(ports["router"]),
                            "--prefill-port", str(ports["prefill"]),
                            "--decode-port", str(ports["decode"]),
                            "--kv-port", str(free_port_run(2)), "--model", str(model_dir)),
                name="pdserve-up")
    tree = []
    try:
        proc.wait_for("pdserve ready", timeout=400)
        yield {"url": f"http://127.0.0.1:{ports['edge']}", "model": str(model_dir), "proc": proc}
    finally:
        tree = proc.descendants()
        code = proc.stop(timeout=90)
        deadline = time.monotonic() + 10
        while (alive := [p for p in tree if psutil.pid_exists(p)
                         and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, f"processes left after shutdown: {alive}"
        assert code == 0, "\n".join(proc.lines[-40:])


def _worker(up, role: str) -> psutil.Process:
    """The worker process itself (a child of `pdserve up`), not its engine's."""
    return next(c for c in psutil.Process(up["proc"].popen.pid).children()
                if role in c.cmdline())


def _health(up) -> int:
    try:
        with urllib.request.urlopen(f"{up['url']}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _wait_healthy(up, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _health(up) != 200:
        assert time.monotonic() < deadline, "\n".join(up["proc"].lines[-40:])
        time.sleep(0.5)


def _chat(up, messages: list[dict]) -> tuple[int, dict, dict]:
    body = {"model": up["model"], "messages": messages, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    req = urllib.request.Request(f"{up['url']}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())


def test_a_killed_prefill_worker_is_restarted_and_no_request_fails(up):
    _wait_healthy(up)
    os.kill(_worker(up, "prefill").pid, signal.SIGKILL)     # its engine: the supervisor's
    status, _, body = _chat(up, CASES[2].payload["messages"])  # long: a remote prefill
    assert status == 200 and body["usage"]["completion_tokens"] == 16
    up["proc"].wait_for("pdserve: prefill-0 exited (code -9); restarting it in 0.5 s",
                        timeout=10)
    _wait_healthy(up)                                         # back, and registered
    # The edge dials it again within a second or so (its channel's reconnect backoff);
    # meanwhile a request is prefilled locally. Each prompt is new: none is cached.
    paths = []
    deadline = time.monotonic() + 5
    while "disaggregated" not in paths and time.monotonic() < deadline:
        messages = [{"role": "user", "content": f"Question {len(paths)}: "
                     + CASES[3].payload["messages"][0]["content"]}]
        status, headers, body = _chat(up, messages)
        assert status == 200 and body["usage"]["completion_tokens"] == 16
        paths.append(headers["x-pdserve-path"])
        time.sleep(0.25)
    why = [line for line in up["proc"].lines[-60:] if "route " in line or "prefill" in line]
    assert paths[-1] == "disaggregated", "\n".join(why)      # through the new prefill worker
    assert not any("stopping the stack" in line for line in up["proc"].lines)


def test_a_sigtermed_decode_worker_finishes_its_stream_then_exits(up):
    """Runs last: the decode worker it stops is being restarted at teardown."""
    _wait_healthy(up)
    body = {"model": up["model"], "prompt": "Once upon a time", "max_tokens": STREAM_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{up['url']}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    worker = _worker(up, "decode")
    events, signalled = [], None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                break
            events.append(json.loads(line[6:]))
            if len(events) == 1:
                signalled = time.monotonic()
                worker.send_signal(signal.SIGTERM)             # the worker alone, as k8s does
    finished = time.monotonic()
    assert signalled, "the stream ended before the worker was signalled"
    assert not any("error" in e for e in events), [e for e in events if "error" in e]
    reasons = [c["finish_reason"] for e in events for c in e.get("choices", [])
               if c.get("finish_reason")]
    assert reasons == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == STREAM_TOKENS
    worker.wait(timeout=30)                                    # then it stops on its own
    lines = up["proc"].lines
    assert any("decode-0 draining: 1 Generate calls in flight" in line for line in lines)
    assert any("decode-0 drained in" in line for line in lines)
    up["proc"].wait_for("pdserve: decode-0 exited (code 0); restarting it", timeout=10)
    print(f"stream ran {finished - signalled:.1f} s past the SIGTERM")
