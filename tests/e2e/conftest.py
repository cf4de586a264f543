"""The real stack for end-to-end tests, and a single vLLM engine as the reference.

Both are session-scoped and run one after the other (never together: two
engines plus a third would share 2 cores): first a stock vLLM OpenAI server
answers every reference case and stops, then `pdserve up` starts and stays
up for the session. Teardown checks that no process of the stack survives.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

from cases import CASES
from parity import CASES as PARITY
from pdserve.bench.otlp_collector import Collector
from support import Proc, alive, free_port, free_port_run, up_cmd, wait_http

def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def post_any(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    """(status, JSON body) of a POST, errors included."""
    try:
        return 200, _post(url, body, timeout)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _output(kind: str, resp: dict) -> str:
    choice = resp["choices"][0]
    return choice["message"]["content"] if kind == "chat" else choice["text"]


@pytest.fixture(scope="session")
def reference(model_dir) -> dict[str, dict]:
    """Each case answered by one stock vLLM engine serving the same model directory."""
    port = free_port()
    proc = Proc([sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                 "--model", str(model_dir), "--dtype", "float32", "--enforce-eager",
                 "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port),
                 "--no-enable-prefix-caching",
                 # tool_choice "required" and named need one (the tiny model's template
                 # has no tool syntax: only forced calls are compared).
                 "--tool-call-parser", "hermes", "--enable-auto-tool-choice"],
                # The model in the engine core's process, as pdserve's workers run it
                # (no worker process behind it: one vllm import fewer to start).
                env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "1",
                     "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                     # Forced tool calls as JSON (vLLM's tool-schema mode, pdserve's), not
                     # in the parser's own syntax under a structural tag.
                     "VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"},
                name="vllm-reference")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, 300)
        out = {}
        for case in CASES:
            path = "chat/completions" if case.kind == "chat" else "completions"
            resp = _post(f"http://127.0.0.1:{port}/v1/{path}", case.body(str(model_dir), False))
            out[case.name] = {"text": _output(case.kind, resp), "usage": resp["usage"]}
        # Gateways that tokenize completions without the tokenizer's special tokens
        # (SMG) send these ids: the reference answers them too, as token-id prompts.
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir)
        for case in CASES:
            if case.kind == "completion":
                ids = tok.encode(case.payload["prompt"], add_special_tokens=False)
                resp = _post(f"http://127.0.0.1:{port}/v1/completions",
                             case.body(str(model_dir), False) | {"prompt": ids})
                out[f"{case.name}/no-special-tokens"] = {"text": _output(case.kind, resp),
                                                         "usage": resp["usage"]}
        # Each parameter's answer (tests/e2e/test_parameters.py).
        for name, (kind, body) in PARITY.items():
            path = "chat/completions" if kind == "chat" else "completions"
            out[f"parity/{name}"] = post_any(f"http://127.0.0.1:{port}/v1/{path}",
                                             {"model": str(model_dir), **body})
        return out
    finally:
        proc.stop(timeout=60)


ROUTERS = 2                             # router replicas of the session's stack


@dataclass
class Stack:
    """A running `pdserve up` and where to reach its parts."""

    proc: Proc
    url: str
    model: str
    inference: str
    router: str                         # the first router replica (the edge's while it is up)
    routers: list[str]                  # every replica: ports counting up from the first
    prefill: str
    decode: str
    decode_metrics: str                 # the decode engine's own vllm:* series
    prefill_metrics: str                # the prefill worker's vllm:* and pdserve:kv_* series
    router_metrics: str                 # the first replica's pdserve:router_* series
    routers_metrics: list[str]          # every replica's, in `routers`' order
    traces: Collector                   # every process exports its spans here (OTLP)


@pytest.fixture(scope="session")
def stack(model_dir, reference) -> Stack:
    """`pdserve up` on free loopback ports; stopped (and checked) at session end."""
    ports = {k: free_port() for k in ("edge", "grpc", "prefill", "decode")}
    # Two router replicas (light processes), so that one can be stopped under load
    # (tests/e2e/test_router_failover.py): ports and metrics ports counting up.
    ports["router"], router_metrics = free_port_run(ROUTERS), free_port_run(ROUTERS)
    metrics = free_port_run(2)
    traces = Collector()
    # Tracing on, as an operator turns it on: the standard OTEL_* variables. Spans
    # leave in batches every 200 ms, so a test sees a request's trace soon after it.
    tracing = {"OTEL_EXPORTER_OTLP_ENDPOINT": traces.http_endpoint,
               "OTEL_BSP_SCHEDULE_DELAY": "200"}
    proc = Proc(up_cmd(ports, model_dir, free_port_run(2), metrics,
                       "--routers", str(ROUTERS),
                       "--router-metrics-port", str(router_metrics),
                       # Equality tests repeat prompts, and send 8 at once: keep them
                       # on the P/D path even when the decode worker holds them or the
                       # prefill worker is busy (placement has tests of its own).
                       "--local-cached-fraction", "1", "--prefill-saturated", "0",
                       # Batched decode calls (the default, named here because
                       # tests/e2e/test_batched_decode.py checks them on this stack).
                       "--decode-calls", "batched",
                       # A client that drops keeps its generation for this long in
                       # case it resumes (5 s by default). 1 s, so that the
                       # disconnect test sees the abort well before its long
                       # generation ends: 1,500 tokens take about 4 s here.
                       "--stream-resume-seconds", "1",
                       # As the reference reads tool calls (its template has none).
                       "--tool-call-parser", "hermes"),
                env=tracing, name="pdserve-up")
    stack = Stack(proc=proc, url=f"http://127.0.0.1:{ports['edge']}", model=str(model_dir),
                  inference=f"127.0.0.1:{ports['grpc']}", router=f"127.0.0.1:{ports['router']}",
                  routers=[f"127.0.0.1:{ports['router'] + i}" for i in range(ROUTERS)],
                  prefill=f"127.0.0.1:{ports['prefill']}", decode=f"127.0.0.1:{ports['decode']}",
                  decode_metrics=f"http://127.0.0.1:{metrics + 1}/metrics",
                  prefill_metrics=f"http://127.0.0.1:{metrics}/metrics",
                  router_metrics=f"http://127.0.0.1:{router_metrics}/metrics",
                  routers_metrics=[f"http://127.0.0.1:{router_metrics + i}/metrics"
                                   for i in range(ROUTERS)],
                  traces=traces)
    try:
        proc.wait_for("pdserve ready", timeout=400)
        tree = proc.descendants()
        assert len(tree) >= 3 + ROUTERS, f"expected routers, prefill, decode, edge; got {tree}"
        yield stack
    finally:
        tree = proc.descendants()
        code = proc.stop(timeout=90)
        traces.stop()
        # SIGKILL is asynchronous: give the kernel a moment to finish the stragglers.
        deadline = time.monotonic() + 10
        while (left := alive(tree)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"processes left after shutdown: {left}"
        assert code == 0, f"pdserve up exited {code}:\n" + "\n".join(proc.lines[-40:])
