"""`pdserve bench compare`: P/D against colocated vLLM, on one machine, in one run.

Every mode serves the same model on the same total cores and gets the same
workloads at the same rates, one mode at a time:
  disaggregated  pdserve, 1 prefill + 1 decode worker, every prompt prefilled remotely
  colocated      stock vLLM: one engine on all the cores, and one engine per half of
                 the cores behind client-side round-robin; per run the better of the
                 two (higher balanced goodput) is the baseline
  conditional    pdserve, prompts under `--conditional-below` tokens prefilled on the
                 decode worker, longer ones remotely
The headline is the long-prompt workload at the headline rate: `modes` in the
JSON. `runs` holds every workload and rate; `tpot_check` compares per-token
latency through pdserve's edge with a stock one-core server.
"""
from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .deployments import Hardware, PdserveStack, StockVllm
from .load import latency_figures, metrics, progress, run, warm_up
from .slo import SLO, goodput
from .workloads import BUILDERS


@dataclass(frozen=True, slots=True)
class Plan:
    """Which workloads run at which rates, with how many requests each."""

    runs: dict[str, tuple[list[float], int]]   # workload -> (rates, requests)
    headline_rate: float
    tpot_check: tuple[float, int] = (1.0, 20)  # random_1024: rate, requests

    def __post_init__(self) -> None:
        if self.headline_rate not in self.runs.get("long_prompts", ([], 0))[0]:
            raise ValueError("headline_rate must be one of long_prompts' rates")


SMOKE = Plan({"long_prompts": ([4.0], 4)}, headline_rate=4.0, tpot_check=(4.0, 2))
QUICK = Plan({"long_prompts": ([2.0], 40)}, headline_rate=2.0)
FULL = Plan({"long_prompts": ([1.0, 2.0, 3.0, 4.0], 60),
             "short_chat": ([2.0, 4.0, 8.0], 60),
             "sessions": ([0.5, 1.0, 2.0], 48)},
            headline_rate=2.0, tpot_check=(1.0, 30))


def _summary(result, tokenizer, mixes: dict[str, SLO]) -> dict:
    m = metrics(result, tokenizer)
    return {
        "completed": m.completed, "failed": m.failed,
        "duration_s": round(result.duration_s, 2),
        "request_throughput": round(float(m.request_throughput), 3),
        **latency_figures(m),
        "goodput": {name: round(goodput(result.outputs, result.duration_s, slo), 3)
                    for name, slo in mixes.items()},
        "samples": {"ttft_ms": [round(float(o.ttft) * 1000, 2)
                                for o in result.outputs if o.success],
                    "itl_ms": [round(float(x) * 1000, 2) for o in result.outputs if o.success
                               for x in o.itl]},
    }


def _deployments(model: str, conditional_below: int, hw: Hardware) -> list:
    lower, upper = hw.halves()
    return [("disaggregated", PdserveStack("disaggregated", model, 0, hw,
                                           placement=("--prefill-saturated", "0"))),
            ("conditional", PdserveStack("conditional", model, conditional_below, hw)),
            ("colocated_1x2", StockVllm("colocated_1x2", model, [list(hw.units)], hw)),
            ("colocated_2x1", StockVllm("colocated_2x1", model, [lower, upper], hw))]


async def _measure(label: str, urls: list[str], model: str, plan: Plan, tokenizer,
                   mixes: dict[str, SLO], seed: int) -> list[dict]:
    await warm_up(urls, model)
    out = []
    for name, (rates, n) in plan.runs.items():
        for i, rate in enumerate(rates):
            # NOTE: new prompts at every rate: a stock engine caches prefixes, and
            # the previous rate's prompts would otherwise come back as cache hits.
            workload = BUILDERS[name](tokenizer, n, seed + 1000 * i)
            progress(f"{label}: {name} at {rate}/s, {n} requests")
            result = await run(workload, urls, model, rate, seed)
            out.append({"deployment": label, "workload": name, "rate": rate,
                        **_summary(result, tokenizer, mixes)})
    # Per-token latency on 1,024-token prompts: pdserve through its edge, and one
    # stock engine on half the units (the first server of the 2x1 setup).
    if label in ("disaggregated", "colocated_2x1"):
        rate, n = plan.tpot_check
        result = await run(BUILDERS["random_1024"](tokenizer, n, seed + 99), urls[:1], model, rate,
                           seed)
        out.append({"deployment": label, "workload": "random_1024", "rate": rate,
                    **_summary(result, tokenizer, mixes)})
    return out


def _pick_colocated(runs: list[dict]) -> list[dict]:
    """Per workload and rate, the better colocated variant, relabelled `colocated`."""
    picked = []
    keys = {(r["workload"], r["rate"]) for r in runs if r["deployment"].startswith("colocated_")}
    for wl, rate in sorted(keys):
        variants = [r for r in runs if r["deployment"] in ("colocated_1x2", "colocated_2x1")
                    and r["workload"] == wl and r["rate"] == rate and wl != "random_1024"]
        if variants:
            best = max(variants, key=lambda r: (r["goodput"]["balanced"], -r["itl_p99_ms"]))
            picked.append({**best, "deployment": "colocated", "variant": best["deployment"]})
    return picked


_HEADLINE_FIELDS = ("itl_p99_ms", "itl_p50_ms", "ttft_p99_ms", "ttft_p50_ms", "tpot_p50_ms",
                    "goodput", "completed", "failed")


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def report(runs: list[dict], plan: Plan, mixes: dict[str, SLO], command: str,
           hw: Hardware) -> dict:
    """The JSON object `compare` prints: headline modes, ratios, targets, every run."""
    runs = runs + _pick_colocated(runs)
    head = {r["deployment"]: r for r in runs
            if r["workload"] == "long_prompts" and r["rate"] == plan.headline_rate}
    modes = {m: {k: head[m][k] for k in _HEADLINE_FIELDS} | ({"variant": head[m]["variant"]}
                                                              if "variant" in head[m] else {})
             for m in ("disaggregated", "colocated", "conditional") if m in head}
    a, b, c = (modes.get(m) for m in ("disaggregated", "colocated", "conditional"))
    ratios, targets = {}, {}
    if a and b:
        ratios["itl_p99_disaggregated_over_colocated"] = _ratio(a["itl_p99_ms"], b["itl_p99_ms"])
        ratios["ttft_p99_disaggregated_over_colocated"] = _ratio(a["ttft_p99_ms"], b["ttft_p99_ms"])
        for mix in mixes:
            ratios[f"goodput_{mix}_disaggregated_over_colocated"] = _ratio(
                a["goodput"][mix], b["goodput"][mix])
        targets["itl_p99_a_le_half_b"] = a["itl_p99_ms"] <= 0.5 * b["itl_p99_ms"]
        targets["goodput_itl_strict_a_ge_1.5x_b"] = (
            a["goodput"]["itl_strict"] >= 1.5 * b["goodput"]["itl_strict"])
    if a and b and c:
        for mix in mixes:
            best = max(a["goodput"][mix], b["goodput"][mix])
            ratios[f"goodput_{mix}_conditional_over_best"] = _ratio(c["goodput"][mix], best)
            targets[f"goodput_{mix}_c_ge_best"] = c["goodput"][mix] >= best
    tpot = {r["deployment"]: r["tpot_p50_ms"] for r in runs if r["workload"] == "random_1024"}
    tpot_check = {}
    if {"disaggregated", "colocated_2x1"} <= tpot.keys():
        tpot_check = {"pdserve_edge_tpot_p50_ms": tpot["disaggregated"],
                      "stock_one_core_tpot_p50_ms": tpot["colocated_2x1"],
                      "ratio": _ratio(tpot["disaggregated"], tpot["colocated_2x1"])}
        targets["tpot_pdserve_le_1.1x_stock_one_core"] = (tpot_check["ratio"] or 9) <= 1.1
    return {"command": command, "workload": "long_prompts", "rate": plan.headline_rate,
            "cores": len(os.sched_getaffinity(0)), "device": hw.device, "units": list(hw.units),
            "slo_mixes": {k: {"ttft_ms": v.ttft_ms, "itl_ms": v.itl_ms} for k, v in mixes.items()},
            "modes": modes, "ratios": ratios, "targets": targets, "tpot_check": tpot_check,
            "runs": [{k: v for k, v in r.items() if k != "samples"} for r in runs]}


def samples(runs: list[dict], plan: Plan) -> dict:
    """Raw TTFT and ITL samples of the headline runs (for the CDF plots)."""
    return {r["deployment"]: r["samples"] for r in runs
            if r["workload"] == "long_prompts" and r["rate"] == plan.headline_rate}


def compare(model: str, plan: Plan, mixes: dict[str, SLO], conditional_below: int,
            seed: int, only: list[str] | None, command: str, hw: Hardware) -> tuple[dict, dict]:
    """Start each deployment in turn, measure it, stop it; return (report, samples)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    runs: list[dict] = []
    for label, dep in _deployments(model, conditional_below, hw):
        if only and label not in only:
            continue
        progress(f"{label}: starting")
        try:
            urls = dep.start()
            runs += asyncio.run(_measure(label, urls, model, plan, tokenizer, mixes, seed))
        finally:
            dep.stop()
            progress(f"{label}: stopped")
    all_runs = runs + _pick_colocated(runs)
    return report(runs, plan, mixes, command, hw), samples(all_runs, plan)


def write(result: dict, raw: dict, out_dir: Path) -> list[Path]:
    """`compare.json`, `samples.json` and the plots under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "samples.json").write_text(json.dumps(raw) + "\n")
    from .plots import plot_all
    return [out_dir / "compare.json", *plot_all(result, raw, out_dir)]
