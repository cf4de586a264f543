"""Batched decode calls (`--decode-calls batched`, as the suite's stack runs) on real
engines: past a few open legs, the edge reads decode legs through one
`BatchedGenerate` call per worker.
The reference cases, streamed twice over at once (the first few legs on a worker get
calls of their own, the rest share its call and its messages), give the single
engine's text, and the KV still travels from the prefill worker. (Per-request
calls on real engines: tests/e2e/test_stock_engine_interop.py, whose stock workers
offer no batched calls.)"""
from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from cases import CASES, MAX_TOKENS
from pdserve.services.worker.batched import GENERATION_SPAN
from support import metric_sum, parse_sse


def _stream(url: str, model: str, case) -> tuple[str, dict, str]:
    path = "chat/completions" if case.kind == "chat" else "completions"
    body = case.body(model, True) | {"stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        route = r.headers["x-pdserve-path"]
        events = parse_sse(r.read().decode())
    assert [i for i, _ in events] == [None] * len(events)     # OpenAI's framing: data only
    assert events[-1][1] == "[DONE]", events[-3:]
    text, usage = [], {}
    for _, ev in events[:-1]:
        data = json.loads(ev)
        assert "error" not in data, data
        usage = data.get("usage") or usage
        for choice in data["choices"]:
            text.append(choice["delta"].get("content") or "" if case.kind == "chat"
                        else choice["text"])
    return "".join(text), usage, route


def test_batched_decode_calls_give_the_single_engine_text(stack, reference):
    url, proc = stack.url, stack.proc
    before = metric_sum(f"{url}/metrics", "pdserve:kv_transferred_tokens_total")
    cases = CASES * 2                   # more legs at once than go on calls of their own
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: _stream(url, stack.model, case), cases))
    for case, (text, usage, route) in zip(cases, results):
        assert text == reference[case.name]["text"], case.name
        assert usage["completion_tokens"] == MAX_TOKENS
        assert route in ("disaggregated", "local")
    assert "disaggregated" in [route for _, _, route in results]
    assert metric_sum(f"{url}/metrics", "pdserve:kv_transferred_tokens_total") > before
    assert any("batched decode calls" in line for line in proc.lines), proc.lines[-20:]
    # The first legs on the worker had calls of their own; later ones shared its call,
    # each traced on the worker as a call of its own would be.
    assert any("batched call 1 opened by" in line for line in proc.lines), proc.lines[-20:]
    deadline = time.monotonic() + 10
    while not any(s.service == "pdserve-decode" and s.name == GENERATION_SPAN
                  for s in stack.traces.spans) and time.monotonic() < deadline:
        time.sleep(0.2)
    shared = [s for s in stack.traces.spans if s.name == GENERATION_SPAN]
    assert shared and {s.service for s in shared} == {"pdserve-decode"}
