"""`pdserve bench gateways`: pdserve's edge and SMG in front of the same workers.

One `pdserve up` (every prompt prefilled remotely) and one SMG
(`smg launch --pd-disaggregation`) over its prefill and decode workers. The same kind of
chat workload goes through each gateway in turn, `reps` times, alternating the
order, so both see the same workers, engines and machine state; every gateway and
rep gets prompts of its own (none is in an engine's prefix cache). Reports vLLM's
TTFT / TPOT / ITL figures and the CPU seconds the gateway processes spent per
request (pdserve: edge + router; SMG: its router process).
"""
from __future__ import annotations

import asyncio


from .deployments import (EmbeddedEdge, Hardware, PdserveStack, SmgGateway, cpu_seconds,
                          metrics_page, samples_sum)
from .load import RunResult, latency_figures, metrics, progress, run, warm_up
from .workloads import random_1024


# vLLM's own histograms on the workers' /metrics (the engine's view of each request):
# arrival to first token, time queued (the decode's wait for its KV included), and the
# time per output token after the first.
ENGINE_HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds",
                     "queue": "vllm:request_queue_time_seconds",
                     "tpot": "vllm:request_time_per_output_token_seconds"}


def _engine_sums(engines: dict[str, str]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each ENGINE_HISTOGRAMS series, per engine role (its /metrics URL)."""
    pages = {role: metrics_page(url) for role, url in engines.items()}
    return {f"{role}_{key}": (samples_sum(page, f"{name}_sum"),
                              samples_sum(page, f"{name}_count"))
            for role, page in pages.items() for key, name in ENGINE_HISTOGRAMS.items()}


async def _runs(gateways: dict, model: str, tokenizer, n: int, rate: float, reps: int,
                seed: int, workers: dict[str, list[int]], engines: dict[str, str]) -> dict:
    got = {name: {"requests": [], "outputs": [], "duration": 0.0, "cpu": 0.0,
                  "workers": dict.fromkeys(workers, 0.0), "engines": {}}
           for name in gateways}
    for name, (urls, _) in gateways.items():
        await warm_up(urls, model, chat=True)
    names = list(gateways)
    for rep in range(reps):
        order = names if rep % 2 == 0 else list(reversed(names))
        for name in order:
            # NOTE: prompts of their own for every gateway and rep. The engines cache
            # prefixes: the same prompts again would be prefilled from the first
            # gateway's cache, and whichever went second would measure cache hits.
            workload = random_1024(tokenizer, n, seed + rep * len(names) + names.index(name))
            urls, pids = gateways[name]
            progress(f"{name}: rep {rep + 1}/{reps}, {n} requests at {rate}/s")
            cpu = cpu_seconds(pids)
            behind = {part: cpu_seconds(p) for part, p in workers.items()}
            sums = _engine_sums(engines)
            result = await run(workload, urls, model, rate, seed, chat=True)
            g = got[name]
            g["cpu"] += cpu_seconds(pids) - cpu
            for part, p in workers.items():
                g["workers"][part] += cpu_seconds(p) - behind[part]
            for key, (total, count) in _engine_sums(engines).items():
                was = g["engines"].get(key, (0.0, 0.0))
                g["engines"][key] = (was[0] + total - sums[key][0], was[1] + count - sums[key][1])
            g["requests"] += result.requests
            g["outputs"] += result.outputs
            g["duration"] += result.duration_s
    out = {}
    for name, g in got.items():
        m = metrics(RunResult(g["requests"], g["outputs"], g["duration"]), tokenizer)
        # The whole request's latency too: TTFT and TPOT trade the KV handover between them
        # (the edge's --first-token); the end-to-end time says what the whole answer took.
        e2el = dict(m.percentiles_e2el_ms)
        out[name] = {"completed": m.completed, "failed": m.failed, **latency_figures(m),
                     "e2el_p50_ms": round(float(e2el[50]), 2),
                     "e2el_p99_ms": round(float(e2el[99]), 2),
                     "gateway_cpu_ms_per_request": round(1000 * g["cpu"] / max(1, m.completed), 2),
                     # The same workers behind every gateway: what each gateway's requests
                     # cost them (the worker's servicer process; its engine's processes).
                     "worker_cpu_ms_per_request": {
                         part: round(1000 * cpu / max(1, m.completed), 2)
                         for part, cpu in g["workers"].items()},
                     # The engines' means over this gateway's requests (ms).
                     "engine_mean_ms": {key: round(1000 * total / count, 2) if count else None
                                        for key, (total, count) in g["engines"].items()}}
    return out


def measure(gateways: dict[str, tuple[list[str], list[int]]], model: str, n: int,
            rate: float, reps: int, seed: int, workers: dict[str, list[int]] | None = None,
            engines: dict[str, str] | None = None) -> dict:
    """The workload through each running gateway (name -> (urls, the PIDs of its
    processes)), `reps` times in alternating order, prompts of its own each time; the
    result object. `workers`: the PIDs of the workers behind them, by part; `engines`:
    their /metrics URLs by role."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    res = asyncio.run(_runs(gateways, model, tokenizer, n, rate, reps, seed, workers or {},
                            engines or {}))
    b = res["smg"]
    ratios = {f"{k}_{name}_over_smg": round(res[name][k] / b[k], 3) if b[k] else None
              for name in res if name != "smg"
              for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p99_ms",
                        "e2el_p50_ms", "gateway_cpu_ms_per_request")}
    by_gateway = {name: _targets(res[name], b) for name in res if name != "smg"}
    return {"workload": f"random 1,024-token chat prompts, 64 out, {rate} req/s, "
                        f"{n} requests x {reps} alternating reps",
            "gateways": res, "ratios": ratios, "targets": by_gateway["pdserve"],
            "targets_by_gateway": by_gateway}


def _targets(a: dict, b: dict) -> dict:
    """Issue 6's targets for one pdserve gateway `a` against SMG's figures `b`."""
    return {"ttft_p50_le_smg": a["ttft_p50_ms"] <= b["ttft_p50_ms"],
            "ttft_p99_le_smg": a["ttft_p99_ms"] <= b["ttft_p99_ms"],
            "tpot_le_1.05x_smg": a["tpot_p50_ms"] <= 1.05 * b["tpot_p50_ms"],
            "cpu_le_1.5x_smg": (a["gateway_cpu_ms_per_request"]
                                <= 1.5 * b["gateway_cpu_ms_per_request"])}


def compare_gateways(model: str, n: int, rate: float, reps: int, seed: int,
                     hw: Hardware, router_in_edge: bool = False,
                     first_token: str = "prefill") -> dict:
    """Start the stack and SMG, measure both, stop both; the result object.
    `router_in_edge`: a third gateway, `pdserve_router_in_edge`, a pdserve edge running
    its router in-process in front of the same workers. `first_token`: the pdserve
    edges' `--first-token`."""
    # Every prompt prefilled remotely, as SMG does: the same path through both.
    edge_flags = ("--first-token", first_token)
    stack = PdserveStack("gateways", model, local_prefill_below=0, hw=hw,
                         placement=("--prefill-saturated", "0", *edge_flags))
    others: list = []
    try:
        progress("starting pdserve up")
        edge = stack.start()
        workers = stack.worker_addresses("prefill"), stack.worker_addresses("decode")
        gateways = {"pdserve": (edge, stack.gateway_pids())}
        if router_in_edge:
            progress("starting a pdserve edge with its router inside")
            others.append(EmbeddedEdge("router-in-edge", model, *workers, hw.max_model_len,
                                       edge_flags))
            gateways["pdserve_router_in_edge"] = (others[-1].start(), others[-1].pids())
        progress("starting smg")
        others.append(SmgGateway("smg", model, *workers))
        gateways["smg"] = (others[-1].start(), others[-1].pids())
        result = measure(gateways, model, n, rate, reps, seed, stack.worker_pids(),
                         stack.worker_metrics())
        result["first_token"] = first_token
        return result
    finally:
        for gateway in others:
            gateway.stop()
        stack.stop()
