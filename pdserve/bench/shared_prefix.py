"""`pdserve bench external --shared-prefix`: inference-perf's shared-prefix workload (the one
llm-d published its prefix-routing results with) through pdserve and through SMG
`cache_aware`, over the same prefill worker and 2 decode workers.

One `pdserve up --decode-workers 2` with its router's defaults, and one SMG
(`--policy cache_aware`) over its workers. inference-perf, unmodified, sends groups
of prompts that share a long system prompt, each with a question of its own, through
each gateway in turn (the engines' prefix caches flushed before each, the order
alternating between reps). Reported per gateway: inference-perf's own TTFT, ITL and
throughput, and the engines' prefix-cache hit rates (`vllm:prefix_cache_hits` /
`vllm:prefix_cache_queries`): the prefill worker's, the decode workers' summed, and all
three summed (pdserve's router prefills a prompt whose prefix a decode worker holds on
that worker, so its prefill worker sees mostly misses; SMG prefills every prompt on the
prefill worker). pdserve's placements by the router's reason come with its runs.
"""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from pdserve.config import RouterConfig

from .deployments import Hardware, PdserveStack, SmgGateway
from .external import cache_counts, hit_rate, run_tool
from .load import progress
from .sessions import _flush, _placements
from .third_party import Shape, inference_perf

DECODE_WORKERS = 2
GROUPS, PER_GROUP, SYSTEM_TOKENS, QUESTION_TOKENS = 8, 8, 512, 128


def data(shape: Shape) -> dict:
    """inference-perf's `data:` section for this comparison."""
    return inference_perf.shared_prefix(shape, GROUPS, PER_GROUP, SYSTEM_TOKENS,
                                        QUESTION_TOKENS)


def _one(name: str, url: str, shape: Shape, model: str, stack: PdserveStack,
         out: Path) -> dict:
    """One gateway's run from cold caches: inference-perf's figures and the hit rates."""
    engines = stack.worker_addresses("prefill") + stack.worker_addresses("decode")
    _flush(engines)
    cached = {"prefill": [stack.prefill_metrics], "decode": stack.decode_metrics,
              "all": [stack.prefill_metrics, *stack.decode_metrics]}
    before = {role: cache_counts(urls) for role, urls in cached.items()}
    placed = _placements(stack.urls[0])
    progress(f"{name}: inference-perf shared_prefix, {shape.requests} requests at {shape.rate}/s")
    figures, cpu = run_tool("inference-perf", shape, url, model, model, out, data=data(shape))
    after = {role: cache_counts(urls) for role, urls in cached.items()}
    result = {**asdict(figures), "client_cpu_s": cpu, **{f"{role}_prefix_hit_rate":
                                    hit_rate(before[role], after[role]) for role in cached}}
    if name == "pdserve":
        result["placements"] = {r: int(n - placed[r])
                                for r, n in _placements(stack.urls[0]).items() if n - placed[r]}
    return result


def compare_shared_prefix(shape: Shape, model: str, out: Path, reps: int = 2) -> dict:
    """Start the pool and SMG, run inference-perf through each, stop all; the result."""
    hw = Hardware(device="cpu", units=tuple(sorted(os.sched_getaffinity(0))))
    stack = PdserveStack("shared-prefix", model,
                         local_prefill_below=RouterConfig().local_prefill_below_tokens,
                         hw=hw, decode_workers=DECODE_WORKERS)
    smg = None
    runs: dict[str, list[dict]] = {}
    try:
        progress(f"starting pdserve up --decode-workers {DECODE_WORKERS}")
        gateways = {"pdserve": stack.start()[0]}
        progress("starting smg --policy cache_aware")
        smg = SmgGateway("smg-cache_aware", model, stack.worker_addresses("prefill"),
                         stack.worker_addresses("decode"), policy="cache_aware")
        gateways["smg_cache_aware"] = smg.start()[0]
        for rep in range(reps):
            order = list(gateways) if rep % 2 == 0 else list(reversed(gateways))
            for name in order:
                runs.setdefault(name, []).append(
                    _one(name, gateways[name], shape, model, stack, out / f"{name}-{rep}"))
    finally:
        if smg:
            smg.stop()
        stack.stop()
    return {"workload": f"inference-perf shared_prefix: {GROUPS} groups x {PER_GROUP} prompts, "
                        f"{SYSTEM_TOKENS}-token system prompt + {QUESTION_TOKENS}-token "
                        f"question, {shape.output_tokens} out, Poisson {shape.rate}/s for "
                        f"{shape.requests / shape.rate:g} s, {DECODE_WORKERS} decode workers",
            "shape": asdict(shape), "gateways": runs}


def table(result: dict) -> str:
    """Each gateway's runs, one row each."""
    rows = [result["workload"],
            f"{'gateway':<18}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
            f"{'req/s':>8}{'tok/s':>8}{'ok':>5}{'err':>5}{'decode hit':>12}{'prefill hit':>12}"
            f"{'all hit':>9}"]
    for name, runs in result["gateways"].items():
        for r in runs:
            rows.append(f"{name:<18}{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>10.1f}"
                        f"{r['itl_p50_ms']:>9.2f}{r['itl_p99_ms']:>9.2f}"
                        f"{r['request_throughput']:>8.2f}{r['output_token_throughput']:>8.1f}"
                        f"{r['completed']:>5}{r['failed']:>5}"
                        f"{r['decode_prefix_hit_rate']!s:>12}{r['prefill_prefix_hit_rate']!s:>12}"
                        f"{r['all_prefix_hit_rate']!s:>9}  {r.get('placements', '')}")
    return "\n".join(rows)
