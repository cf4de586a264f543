"""`pdserve plan check`: the planner's pick against measured runs of it and of its rival.

For each benchmark workload, recommend (over this machine's units) picks a deployment
per SLO mix (`slo.DEFAULT_MIXES`) at each rate of a small grid (the workload's base
rate x STEPS), and the best-predicted deployment of another family (colocated_2x1,
colocated_1x2, disaggregated, conditional) is its alternative. The workload is checked
at the rate where the picks stand furthest from their alternatives (the mean predicted
gap over the mixes), among the rates at which every pick is predicted to meet its SLO
for at least ATTAINMENT of the requests: where the plan decides something, not where
every deployment keeps up. Each deployment any case needs is sent each workload
`--runs` times, run k with prompts and arrivals of seed + k (a run never repeats a
prompt an engine already cached) on a start of its own (`measure`), and every mix's
goodput is computed from each run (`compare._summary`). The prediction is the mean over the same seeds simulated,
the measurement the runs' mean; a case's `error` is (predicted - measured) / measured.

A case's `outcome`: `won` when the pick measured at least its alternative, `tie` when it
measured less by no more than the runs of either deployment differed among themselves
(the machine's own noise, measured), else `lost`.

Measurements are kept as JSON files under `--measured` (one per deployment, workload,
rate and seed), so a check can be split into several shorter commands (`--deployments`)
and combined by a last one that measures nothing new.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from statistics import mean

from .recommend import Setting, Workload, best, host_knobs, recommend
from .candidates import candidates
from .profile import Profile
from .sim import Deployment
from ..slo import DEFAULT_MIXES

# workload -> (base rate, requests at it): `pdserve bench compare`'s highest rates
QUICK = {"long_prompts": (4.0, 60), "short_chat": (8.0, 80), "sessions": (2.0, 64)}
FULL = {"long_prompts": (4.0, 120), "short_chat": (8.0, 160), "sessions": (2.0, 128)}
STEPS = (1.0, 1.25, 1.5, 1.75, 2.0)     # the rates tried: base x these
ATTAINMENT = 0.85       # a check rate has every pick meeting its SLO for this share
TURNS = 4               # a sessions run's requests come in whole sessions of 4 turns


def family(name: str) -> str:
    """colocated_2x1 / colocated_1x2 / disaggregated / conditional."""
    return name if name.startswith("colocated") else name.split("_")[0]


def cases_for(result: dict, workload: str, rate: float, at: int = 0) -> list[dict]:
    """Per SLO mix, at `result`'s `at`th rate: the pick, its prediction, and the best
    other family's."""
    rows = result["candidates"]
    out = []
    for slo in DEFAULT_MIXES:
        pick = best(rows, slo, True, at)
        others = [r for r in rows if family(r["name"]) != family(pick["name"])]
        alt = max(others, key=lambda r: r["at"][at]["goodput"][slo])
        out.append({"workload": workload, "slo": slo, "rate": rate,
                    "recommended": pick["name"],
                    "predicted_goodput": pick["at"][at]["goodput"][slo],
                    "predicted_attainment": pick["at"][at]["attainment"][slo],
                    "alternative": alt["name"],
                    "alternative_predicted_goodput": alt["at"][at]["goodput"][slo]})
    return out


def separation(cases: list[dict]) -> float:
    """How far the picks stand from their alternatives: the mean predicted gap."""
    return sum(c["predicted_goodput"] / c["alternative_predicted_goodput"] - 1
               for c in cases) / len(cases)


def check_rate(by_rate: list[list[dict]]) -> int:
    """The index of the rate to check (module docstring); the first if none qualifies."""
    ok = [i for i, cases in enumerate(by_rate)
          if all(c["predicted_attainment"] >= ATTAINMENT for c in cases)]
    return max(ok or [0], key=lambda i: (separation(by_rate[i]), -i))


def requests_at(workload: str, base: tuple[float, int], rate: float) -> int:
    """Requests for a run at `rate`: the base run's length in time."""
    n = round(base[1] * rate / base[0])
    return max(TURNS, round(n / TURNS) * TURNS) if workload == "sessions" else n


def stack_for(dep: Deployment, model: str, hw):
    """The `pdserve bench compare` deployment that runs `dep` on `hw`."""
    from ..deployments import PdserveStack, StockVllm
    units = list(hw.units)
    if not dep.prefill:
        k = dep.units_per_engine
        return StockVllm(dep.name, model, [units[i * k:(i + 1) * k] for i in range(dep.decode)],
                         hw)
    placement = ("--prefill-saturated", str(dep.prefill_saturated),
                 "--local-cached-fraction", f"{dep.local_cached_fraction:g}")
    return PdserveStack(dep.name, model, dep.local_prefill_below, hw, dep.decode, placement,
                        prefill_workers=dep.prefill)


def _cache_path(folder: Path, dep: str, workload: str, rate: float, n: int, seed: int) -> Path:
    return folder / f"{dep}__{workload}__r{rate:g}_n{n}_s{seed}.json"


def measure(deps: list[Deployment], needs: dict[str, list[str]], plan: dict, model: str,
            seed: int, folder: Path, only: set[str], runs: int) -> None:
    """Run each workload each deployment of `deps` `needs` (with `only`: the deployments
    named there, every workload) `runs` times, but the runs `folder` holds: in `runs`
    passes, pass k starting every deployment afresh for its runs of seed + k, so that a
    deployment's runs lie minutes apart and one noisy spell of the shared machine does
    not fall on all of them."""
    import asyncio

    from transformers import AutoTokenizer

    from ..deployments import Hardware
    from ..load import progress, warm_up
    tokenizer = AutoTokenizer.from_pretrained(model)
    hw = Hardware("cpu", tuple(sorted(os.sched_getaffinity(0))))
    for run_seed in range(seed, seed + runs):
        for dep in deps:
            wanted = (list(plan) if dep.name in only else []) if only else needs.get(dep.name, [])
            todo = [w for w in wanted
                    if not _cache_path(folder, dep.name, w, *plan[w], run_seed).exists()]
            if not todo:
                continue
            stack = stack_for(dep, model, hw)
            progress(f"{dep.name}: starting")
            try:
                urls = stack.start()
                asyncio.run(warm_up(urls, model))
                for w in todo:
                    rate, n = plan[w]
                    progress(f"{dep.name}: {w} at {rate:g}/s, {n} requests, seed {run_seed}")
                    summary = _measured_run(tokenizer, w, n, rate, run_seed, urls, model)
                    _cache_path(folder, dep.name, w, rate, n, run_seed).write_text(
                        json.dumps(summary))
            finally:
                stack.stop()
                progress(f"{dep.name}: stopped")


def _measured_run(tokenizer, workload: str, n: int, rate: float, seed: int, urls: list[str],
                  model: str) -> dict:
    """One run's summary, with the machine's load average before and after and the CPU
    seconds each kind of process took over it (the shared machine's noise, and the
    host's share of the cores, on the record)."""
    import asyncio

    from ..compare import _summary
    from ..load import run
    from ..workloads import BUILDERS
    load0, cpu0 = os.getloadavg()[0], cpu_seconds()
    result = asyncio.run(run(BUILDERS[workload](tokenizer, n, seed), urls, model, rate, seed))
    cpu1 = cpu_seconds()
    summary = _summary(result, tokenizer, DEFAULT_MIXES)
    summary.pop("samples")
    summary["loadavg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    summary["cpu_s"] = {k: round(cpu1.get(k, 0.0) - cpu0.get(k, 0.0), 2)
                        for k in sorted(cpu1) if cpu1.get(k, 0.0) - cpu0.get(k, 0.0) >= 0.01}
    return summary


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process (the load's client) and of every process it
    started, summed by kind: engine cores, pdserve's services, stock vLLM servers."""
    import psutil

    from ..deployments import cpu_seconds as seconds
    me = psutil.Process()
    kinds: dict[str, list[int]] = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            kinds.setdefault(_kind(p, me), []).append(p.pid)
        except psutil.Error:            # gone in between
            continue
    return {kind: seconds(pids) for kind, pids in kinds.items()}


def _kind(p, me) -> str:
    if p.pid == me.pid:
        return "client"
    args = p.cmdline()
    if "EngineCore" in p.name() or any("EngineCore" in a for a in args):
        return "engine_core"
    if "vllm.entrypoints.openai.api_server" in args:
        return "vllm_api_server"
    for service in ("edge", "router", "prefill", "decode"):
        if service in args:
            return service
    return "other"


def _error(predicted: float, measured: float | None) -> float | None:
    return round((predicted - measured) / measured, 3) if measured else None


def _measured(folder: Path, dep: str, c: dict, plan: dict, seed: int, runs: int
              ) -> list[float]:
    rate, n = plan[c["workload"]]
    paths = [_cache_path(folder, dep, c["workload"], rate, n, seed + k) for k in range(runs)]
    return [json.loads(p.read_text())["goodput"][c["slo"]] for p in paths if p.exists()]


def outcome(rec: list[float], alt: list[float]) -> str | None:
    """won / tie / lost (module docstring); None without measurements of both."""
    if not rec or not alt:
        return None
    gap = mean(alt) - mean(rec)
    noise = max(max(rec) - min(rec), max(alt) - min(alt))
    return "won" if gap <= 0 else "tie" if gap <= noise else "lost"


def settle(cases: list[dict], plan: dict, seed: int, folder: Path, runs: int) -> list[dict]:
    """Fill each case's measured goodputs (None where not measured), errors and outcome."""
    out = []
    for c in cases:
        rec = _measured(folder, c["recommended"], c, plan, seed, runs)
        alt = _measured(folder, c["alternative"], c, plan, seed, runs)
        m_rec = round(mean(rec), 3) if rec else None
        m_alt = round(mean(alt), 3) if alt else None
        result = outcome(rec, alt)
        out.append({**c, "measured_goodput": m_rec, "alternative_measured_goodput": m_alt,
                    "measured_runs": rec, "alternative_measured_runs": alt,
                    "error": _error(c["predicted_goodput"], m_rec),
                    "alternative_error": _error(c["alternative_predicted_goodput"], m_alt),
                    "recommended_won": None if result is None else result == "won",
                    "outcome": result})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="a profile JSON (`pdserve plan profile`)")
    p.add_argument("--quick", action="store_true",
                   help="base rates " + ", ".join(f"{w} {r:g}/s x {n}"
                                                  for w, (r, n) in QUICK.items())
                   + " (without it, twice the requests); each checked at one rate of base x "
                   + ", ".join(f"{k:g}" for k in STEPS))
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--workloads", default="", help="comma-separated subset of the workloads")
    p.add_argument("--deployments", default="",
                   help="only measure these (comma-separated candidate names) on every "
                        "workload into --measured, and print no cases")
    p.add_argument("--measured", default="bench/results/plan_check_runs",
                   help="folder of measurements, reused across commands")
    p.add_argument("--predict-only", action="store_true",
                   help="print the cases from the measurements held, start nothing")
    p.add_argument("--model", default="", help="model dir (default: the tiny model)")
    p.add_argument("--runs", type=int, default=3,
                   help="runs per deployment and workload, run k with seed + k, measured "
                        "and simulated alike (their spread is the noise a tie is judged by)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the first run's prompts and arrivals, measured and "
                        "simulated")


def plan_cases(profile: Profile, base: dict, seed: int, runs: int
               ) -> tuple[list, dict, dict]:
    """(cases without measurements, the candidates each workload needs measured, the
    plan: each workload's check rate and requests)."""
    engines = len(os.sched_getaffinity(0)) // profile.units_per_engine
    cases, needs, plan = [], {}, {}
    for w, (rate, n) in base.items():
        rates = [rate * k for k in STEPS]
        s = Setting(profile, Workload(w), n, runs, seed, host_knobs(profile))
        result = recommend(s, engines, dict(DEFAULT_MIXES), rates)
        at = check_rate([cases_for(result, w, r, i) for i, r in enumerate(rates)])
        plan[w] = (rates[at], requests_at(w, (rate, n), rates[at]))
        if plan[w][1] != n:         # predicted again over the measured run's requests
            s = Setting(profile, Workload(w), plan[w][1], runs, seed, host_knobs(profile))
            result = recommend(s, engines, dict(DEFAULT_MIXES), [rates[at]])
            at = 0
        cases += cases_for(result, w, plan[w][0], at)
    for c in cases:
        for role in ("recommended", "alternative"):
            needs.setdefault(c[role], [])
            if c["workload"] not in needs[c[role]]:
                needs[c[role]].append(c["workload"])
    return cases, needs, plan


def table(cases: list[dict]) -> str:
    lines = [f"{'workload':13s} {'slo':11s} {'recommended':34s} {'pred':>6s} {'meas':>6s} "
             f"{'err':>7s}  {'alternative':34s} {'meas':>6s} outcome"]
    for c in cases:
        err = f"{c['error']:+.1%}" if c["error"] is not None else "-"
        lines.append(f"{c['workload']:13s} {c['slo']:11s} {c['recommended']:34s} "
                     f"{c['predicted_goodput']:6.2f} {c['measured_goodput'] or 0:6.2f} {err:>7s}  "
                     f"{c['alternative']:34s} {c['alternative_measured_goodput'] or 0:6.2f} "
                     f"{c['outcome']}")
    return "\n".join(lines)


def _model(given: str) -> str:
    from ..cli import _model as model
    return model(given)


def main(a: argparse.Namespace) -> int:
    base = QUICK if a.quick else FULL
    try:
        profile = Profile.load(Path(a.profile))
        wanted = a.workloads.split(",") if a.workloads else list(base)
        base = {w: base[w] for w in wanted}
    except KeyError as e:
        print(f"pdserve plan check: --workloads: no workload {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError, TypeError) as e:
        print(f"pdserve plan check: --profile {a.profile}: {e}", file=sys.stderr)
        return 2
    folder = Path(a.measured)
    folder.mkdir(parents=True, exist_ok=True)
    only = set(a.deployments.split(",")) if a.deployments else set()
    engines = len(os.sched_getaffinity(0)) // profile.units_per_engine
    if a.runs < 1:
        print("pdserve plan check: --runs must be >= 1", file=sys.stderr)
        return 2
    cases, needs, plan = plan_cases(profile, base, a.seed, a.runs)
    if only:                # measure only: cases come from a later command
        measure([d for d in candidates(engines) if d.name in only], {}, plan,
                _model(a.model), a.seed, folder, only, a.runs)
        print(json.dumps({"measured": sorted(str(p) for p in folder.glob("*.json"))}))
        return 0
    if not a.predict_only:
        measure([d for d in candidates(engines) if d.name in needs], needs, plan,
                _model(a.model), a.seed, folder, only, a.runs)
    cases = settle(cases, plan, a.seed, folder, a.runs)
    errors = [abs(c["error"]) for c in cases if c["error"] is not None]
    out = {"command": "pdserve plan check " + shlex.join(sys.argv[3:]),
           "profile": {"model": profile.model, "device": profile.device, "path": a.profile},
           "plan": {w: {"rate": r, "requests": n} for w, (r, n) in plan.items()},
           "needs": needs, "cases": cases,
           "max_abs_error": max(errors, default=None),
           "recommended_won": sum(bool(c["recommended_won"]) for c in cases),
           "recommended_tied": sum(c["outcome"] == "tie" for c in cases),
           "measured_cases": sum(c["recommended_won"] is not None for c in cases)}
    print(json.dumps(out) if a.json else table(cases))
    return 0
