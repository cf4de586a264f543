"""A pool of two decode workers behind the router: sessions stay with their KV.

`pdserve up --decode-workers 2` (both decode engines share one core here). Turn 2
of a conversation lands on the decode worker that served turn 1; the prefill
engine holds the history in its prefix cache, so its prefix-cache hits rise (it
computes only the new tokens) and the first token comes sooner. Different
sessions spread over both workers.
"""
from __future__ import annotations

import pytest

from cases import CASES
from pdserve.bench.chat_turn import chat_turn
from support import Proc, free_port, free_port_run, metric_sum, pdserve_cmd


@pytest.fixture(scope="module")
def pool(model_dir, reference):
    ports = {k: free_port() for k in ("edge", "grpc", "router")}
    metrics = free_port_run(3)
    proc = Proc(pdserve_cmd("up", "--decode-workers", "2", "--port", str(ports["edge"]),
                            "--grpc-port", str(ports["grpc"]), "--router-port", str(ports["router"]),
                            "--prefill-port", str(free_port()), "--decode-port",
                            str(free_port_run(2)),
                            "--kv-port", str(free_port_run(6)), "--model", str(model_dir),
                            "--worker-metrics-port", str(metrics)), name="pdserve-pool")
    try:
        proc.wait_for("pdserve ready", timeout=400)
        yield {"url": f"http://127.0.0.1:{ports['edge']}", "model": str(model_dir),
               "prefill_metrics": f"http://127.0.0.1:{metrics}/metrics", "proc": proc}
    finally:
        assert proc.stop(timeout=90) == 0


def _chat(pool, messages, session: str) -> tuple[dict, str, float]:
    return chat_turn(pool["url"], pool["model"], messages, session)


def test_turn_two_follows_the_session_and_prefills_from_its_cache(pool):
    history = CASES[3].payload["messages"]                 # the long multi-turn case
    h1, reply, ttft1 = _chat(pool, history, "session-a")
    worker = h1["x-pdserve-worker"]
    hits = pool["prefill_metrics"]
    before = metric_sum(hits, "vllm:prefix_cache_hits_total")
    turn2 = history + [{"role": "assistant", "content": reply},
                       {"role": "user", "content": "And then?"}]
    h2, _, ttft2 = _chat(pool, turn2, "session-a")
    assert h2["x-pdserve-worker"] == worker
    assert metric_sum(hits, "vllm:prefix_cache_hits_total") - before >= 256
    assert ttft2 < ttft1, (ttft1, ttft2)


def test_sessions_spread_over_both_decode_workers(pool):
    seen = {_chat(pool, [{"role": "user", "content": f"Tell me about the number {i}."}],
                  f"spread-{i}")[0]["x-pdserve-worker"] for i in range(8)}
    assert seen == {"decode-0", "decode-1"}
