"""`pdserve bench sessions`: multi-turn chat through pdserve and SMG over one decode pool.

One `pdserve up --decode-workers 2`, and over its workers two Shepherd Model
Gateways: `--policy cache_aware` and `--policy consistent_hashing`. The same
conversations go through each gateway in turn, the engines' prefix caches
flushed before each: sessions share a few long system prompts, each turn sends
the whole conversation so far plus a short new message, several sessions run at
once and each session's turns one after another. Every request carries its
session key both ways a gateway reads one (`x-session-id` for pdserve,
`X-SMG-Routing-Key` for SMG). Reported per gateway: TTFT (to the first text)
p50/p99 over all turns and over later turns, and the decode engines' own prefix-cache hit rate
(`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`, summed over the
decode workers): the share of prompt tokens a decode engine found in its cache
instead of pulling or computing them, which is what keeping a session's decode
where its KV is buys.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import aiohttp
import grpc
import numpy as np
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from pdserve.config import RouterConfig
from pdserve.tiny_model import synthetic_corpus

from .deployments import Hardware, PdserveStack, SmgGateway, metric_sum
from .load import progress

DECODE_WORKERS = 2
POLICIES = ("cache_aware", "consistent_hashing")
REASONS = ("remote", "cached", "short", "no-prefill", "prefill-saturated")


@dataclass(frozen=True, slots=True)
class Conversation:
    """One session: its key, system prompt and user messages, sent turn by turn."""

    key: str
    system: str
    messages: tuple[str, ...]


def conversations(n: int, turns: int, seed: int, system_prompts: int = 3) -> list[Conversation]:
    """`n` sessions of `turns` turns; they share `system_prompts` system prompts of
    ~400 tokens; the first message is ~150 tokens, later ones ~30."""
    rng = random.Random(seed)
    systems = [" ".join(synthetic_corpus(seed * 100 + i, 40)) for i in range(system_prompts)]
    out = []
    for s in range(n):
        first = " ".join(synthetic_corpus(seed * 1000 + s, 15))
        later = [" ".join(synthetic_corpus(seed * 100_000 + s * 100 + t, 3))
                 for t in range(1, turns)]
        out.append(Conversation(f"s{seed}-{s}", systems[rng.randrange(system_prompts)],
                                (first, *later)))
    return out


async def _turn(http: aiohttp.ClientSession, url: str, model: str, key: str,
                messages: list[dict], max_tokens: int) -> tuple[float | None, str]:
    """(ms to the first text or None on failure, the reply) of one streamed turn."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"x-session-id": key, "X-SMG-Routing-Key": key}
    started, first, text = time.perf_counter(), None, []
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            return None, ""
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            piece = choices[0].get("delta", {}).get("content")
            if piece:
                if first is None:
                    first = (time.perf_counter() - started) * 1000
                text.append(piece)
    return first, "".join(text)


async def _run(url: str, model: str, convs: list[Conversation], concurrency: int,
               max_tokens: int) -> dict[str, list]:
    """Every turn's TTFT (None: failed), split into first turns and later turns."""
    got: dict[str, list] = {"first": [], "later": []}
    gate = asyncio.Semaphore(concurrency)

    async def session(http, c: Conversation) -> None:
        async with gate:
            messages = [{"role": "system", "content": c.system}]
            for i, msg in enumerate(c.messages):
                messages.append({"role": "user", "content": msg})
                ttft, reply = await _turn(http, url, model, c.key, messages, max_tokens)
                got["first" if i == 0 else "later"].append(ttft)
                if ttft is None:
                    return
                messages.append({"role": "assistant", "content": reply})

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await asyncio.gather(*(session(http, c) for c in convs))
    return got


def _flush(addresses: list[str]) -> None:
    """Empty every engine's prefix cache, so that each gateway starts cold.

    An engine publishes the flush (`AllBlocksCleared`) with its next scheduler
    step, not at once; an idle engine would leave pdserve's router believing the
    old blocks are still held until the first request of the next run. So each
    engine then runs one 1-token request, and the router gets a moment to hear it.
    """
    for address in addresses:
        with grpc.insecure_channel(address) as ch:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
            stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10), timeout=15)
            step = vllm_engine_pb2.GenerateRequest(
                request_id=f"flush-{address}-{time.monotonic_ns()}",
                tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1, 2]),
                sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=1), stream=False)
            for _ in stub.Generate(step, timeout=60):
                pass
    time.sleep(1.0)


def _decode_cache(urls: list[str]) -> tuple[float, float]:
    """(hits, queries) of the decode engines' prefix caches, summed."""
    return (sum(metric_sum(u, "vllm:prefix_cache_hits_total") for u in urls),
            sum(metric_sum(u, "vllm:prefix_cache_queries_total") for u in urls))


def _placements(edge: str) -> dict[str, float]:
    """pdserve's placements so far, by the router's reason (the edge's counter)."""
    return {r: metric_sum(f"{edge}/metrics", "pdserve:placements_total", f'reason="{r}"')
            for r in REASONS}


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def _figures(runs: list[dict], hits: float, queries: float) -> dict:
    ok = {k: [t for r in runs for t in r[k] if t is not None] for k in ("first", "later")}
    every = ok["first"] + ok["later"]
    failed = sum(t is None for r in runs for k in ("first", "later") for t in r[k])
    return {"turns": len(every), "failed": failed,
            "ttft_p50_ms": _pct(every, 50), "ttft_p99_ms": _pct(every, 99),
            "later_turns_ttft_p50_ms": _pct(ok["later"], 50),
            "first_turns_ttft_p50_ms": _pct(ok["first"], 50),
            "decode_prefix_hit_rate": round(hits / queries, 3) if queries else None}


def compare_sessions(model: str, sessions: int, turns: int, concurrency: int, reps: int,
                     seed: int, hw: Hardware, max_tokens: int = 16, balance: float = 1.25,
                     balance_slack: int = RouterConfig().balance_slack) -> dict:
    """Start the pool and both SMGs, run every gateway `reps` times, stop all."""
    stack = PdserveStack("sessions", model, local_prefill_below=32, hw=hw,
                         decode_workers=DECODE_WORKERS, placement=("--balance", str(balance),
                                    "--balance-slack", str(balance_slack)))
    smgs: dict[str, SmgGateway] = {}
    try:
        progress(f"starting pdserve up --decode-workers {DECODE_WORKERS}")
        gateways = {"pdserve": stack.start()[0]}
        for policy in POLICIES:
            progress(f"starting smg --policy {policy}")
            smgs[policy] = SmgGateway(f"smg-{policy}", model, stack.worker_addresses("prefill"),
                                      stack.worker_addresses("decode"), policy=policy)
            gateways[f"smg_{policy}"] = smgs[policy].start()[0]
        engines = stack.worker_addresses("prefill") + stack.worker_addresses("decode")
        runs: dict[str, list] = {g: [] for g in gateways}
        cache: dict[str, list[float]] = {g: [0.0, 0.0] for g in gateways}
        placed = dict.fromkeys(REASONS, 0.0)           # pdserve's placements, by reason
        for rep in range(reps):
            convs = conversations(sessions, turns, seed + rep)
            order = list(gateways) if rep % 2 == 0 else list(reversed(gateways))
            for name in order:
                progress(f"{name}: rep {rep + 1}/{reps}, {sessions} sessions x {turns} turns")
                _flush(engines)
                h0, q0 = _decode_cache(stack.decode_metrics)
                p0 = _placements(gateways["pdserve"])
                runs[name].append(asyncio.run(_run(gateways[name], model, convs, concurrency,
                                                   max_tokens)))
                h1, q1 = _decode_cache(stack.decode_metrics)
                cache[name][0] += h1 - h0
                cache[name][1] += q1 - q0
                if name == "pdserve":
                    placed = {r: placed[r] + n - p0[r]
                              for r, n in _placements(gateways["pdserve"]).items()}
    finally:
        for smg in smgs.values():
            smg.stop()
        stack.stop()
    out = {name: _figures(runs[name], *cache[name]) for name in runs}
    out["pdserve"]["placements"] = {r: int(n) for r, n in placed.items() if n}
    return {"workload": f"{sessions} sessions x {turns} turns (3 shared ~400-token system "
                        f"prompts, ~150-token first message, ~30-token later ones, "
                        f"{max_tokens} out), {concurrency} sessions at once, {reps} reps, "
                        f"{DECODE_WORKERS} decode workers, pdserve --balance {balance} "
                        f"--balance-slack {balance_slack}",
            "gateways": out, "targets": _targets(out)}


def _targets(out: dict) -> dict:
    """The pools issue's live targets: pdserve against the best SMG policy."""
    smg = [v for k, v in out.items() if k.startswith("smg_")]
    p = out["pdserve"]
    best = lambda key, pick: pick(v[key] for v in smg if v[key] is not None)  # noqa: E731
    return {"decode_hit_rate_ge_best_smg":
            p["decode_prefix_hit_rate"] >= best("decode_prefix_hit_rate", max),
            "ttft_p50_le_best_smg": p["ttft_p50_ms"] <= best("ttft_p50_ms", min),
            "ttft_p99_le_best_smg": p["ttft_p99_ms"] <= best("ttft_p99_ms", min)}


def table(result: dict) -> str:
    """The result as the table the issue asks for."""
    rows = [f"{result['workload']}",
            f"{'gateway':28s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'later p50':>9s} "
            f"{'decode hit':>10s} {'failed':>6s}"]
    for name, g in result["gateways"].items():
        rows.append(f"{name:28s} {g['ttft_p50_ms']:>9} {g['ttft_p99_ms']:>9} "
                    f"{g['later_turns_ttft_p50_ms']:>9} {g['decode_prefix_hit_rate']:>10} "
                    f"{g['failed']:>6}")
    if result["gateways"]["pdserve"].get("placements"):
        rows.append(f"pdserve placements: {result['gateways']['pdserve']['placements']}")
    rows += [f"  target {k}: {'met' if v else 'MISSED'}" for k, v in result["targets"].items()]
    return "\n".join(rows)

