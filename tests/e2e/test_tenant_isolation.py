"""Tenants never read each other's KV, on the real engines: an edge with two tenants'
keys in front of the session stack's router and workers (no engine of its own).
Tenant A's repeated prompt hits the prefix cache; tenant B's identical prompt hits
nothing on any engine (vLLM's own counters, and B's usage.cached_tokens). A system
prompt the operator declared shared is reused across them, and only it."""
from __future__ import annotations

import json
import secrets
import time
import urllib.request

import pytest

from pdserve.bench.deployments import metric_sum
from support import Proc, free_port, pdserve_cmd, wait_http

ALICE, BOB = "sk-alice-" + secrets.token_hex(16), "sk-bob-" + secrets.token_hex(16)
# Over 5 blocks of the CPU engines' 128 tokens; no other test sends these.
LONG = " ".join(f"Ledger line {i}: account {i * 7919 % 1009} moved {i * 31 % 97} units."
                for i in range(60))
SYSTEM = " ".join(f"Rule {i}: answer politely about topic {i * 13 % 101}." for i in range(40))


@pytest.fixture(scope="module")
def keyed_edge(stack, tmp_path_factory):
    """A second edge on the stack's router, with keys for tenants alice and bob."""
    d = tmp_path_factory.mktemp("tenants")
    (d / "keys").write_text(f"{ALICE} alice normal\n{BOB} bob normal\n")
    (d / "salt").write_text(secrets.token_hex(32))
    (d / "shared.json").write_text(json.dumps([{"text": SYSTEM, "tenants": ["alice", "bob"]}]))
    port = free_port()
    proc = Proc(pdserve_cmd("edge", "--model", stack.model, "--port", str(port),
                            "--grpc-port", str(free_port()), "--router", stack.router,
                            "--api-keys-file", str(d / "keys"),
                            "--tenant-salt-file", str(d / "salt"),
                            "--shared-prefixes-file", str(d / "shared.json")),
                name="keyed-edge")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", proc, 120)
        yield url
    finally:
        assert proc.stop(timeout=30) == 0, "\n".join(proc.lines[-30:])


def _send(url: str, model: str, key: str, prompt: str) -> tuple[float, int]:
    """Stream one completion: (seconds to its first token, usage's cached_tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Authorization": f"Bearer {key}",
                                  "Content-Type": "application/json"})
    started, first, usage = time.perf_counter(), None, None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    return first, usage["prompt_tokens_details"]["cached_tokens"]


def _hits(stack) -> dict[str, float]:
    return {role: metric_sum(url, "vllm:prefix_cache_hits_total")
            for role, url in (("prefill", stack.prefill_metrics),
                              ("decode", stack.decode_metrics))}


def _rise(stack, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in _hits(stack).items()}


def test_a_tenant_hits_its_own_cache_and_never_anothers(stack, keyed_edge):
    h0 = _hits(stack)
    cold, cached = _send(keyed_edge, stack.model, ALICE, LONG)
    h1 = _hits(stack)
    warm, cached_again = _send(keyed_edge, stack.model, ALICE, LONG)
    a = _rise(stack, h1)
    assert cached_again >= 256 and a["prefill"] >= 256, (cached_again, a)
    h2 = _hits(stack)
    other, cached_b = _send(keyed_edge, stack.model, BOB, LONG)
    b = _rise(stack, h2)
    print(f"\nTTFT: A cold {cold * 1000:.1f} ms ({cached} cached, "
          f"hits {_delta(h0, h1)}), A again {warm * 1000:.1f} ms ({cached_again} cached, "
          f"hits {a}), B same prompt {other * 1000:.1f} ms ({cached_b} cached, hits {b})")
    assert cached_b == 0 and b == {"prefill": 0, "decode": 0}, (cached_b, b)
    assert other > warm             # B computes the prompt: slower than A's cache hit


def test_a_declared_shared_prefix_is_reused_across_tenants_and_only_it(stack, keyed_edge):
    prompt = SYSTEM + " Question: which rule covers refunds?"
    _send(keyed_edge, stack.model, ALICE, prompt)
    h0 = _hits(stack)
    _, cached = _send(keyed_edge, stack.model, BOB, prompt)
    b = _rise(stack, h0)
    shared_tokens = len(_tokens(keyed_edge, stack.model, SYSTEM)) // 128 * 128
    assert shared_tokens >= 256
    # B reuses the shared system prompt's whole blocks, nothing of A's question.
    assert cached == shared_tokens and b["prefill"] == shared_tokens, (cached, b, shared_tokens)


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def _tokens(url: str, model: str, text: str) -> list[int]:
    req = urllib.request.Request(f"{url}/tokenize", json.dumps(
        {"model": model, "prompt": text}).encode(), {"Authorization": f"Bearer {ALICE}",
                                                     "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["tokens"]
