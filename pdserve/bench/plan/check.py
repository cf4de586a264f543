"""`pdserve plan check`: the planner's pick against a measured run of it and of its rival.

For each benchmark workload at its check rate, recommend (over this machine's units)
picks a deployment per SLO mix (`slo.DEFAULT_MIXES`), and the best-predicted
deployment of another family (colocated_2x1, colocated_1x2, disaggregated,
conditional) is its alternative. Each deployment any case needs is started once
(`pdserve bench compare`'s deployments), sent each workload once with the same seed
the simulation drew its arrivals from, and every mix's goodput is computed from that
one run (`compare._summary`). A case's `error` is (predicted - measured) / measured.

Measurements are kept as JSON files under `--measured` (one per deployment and
workload), so a check can be split into several shorter commands (`--deployments`)
and combined by a last one that measures nothing new.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from .recommend import Setting, Workload, host_knobs, recommend
from .candidates import candidates
from .profile import Profile
from .sim import Deployment
from ..slo import DEFAULT_MIXES

# workload -> (rate, requests): rates where the deployments differ on 2 cores
# (`pdserve bench compare`'s highest rates: where the deployments differ on 2 cores)
QUICK = {"long_prompts": (4.0, 60), "short_chat": (8.0, 80), "sessions": (2.0, 64)}
FULL = {"long_prompts": (4.0, 120), "short_chat": (8.0, 160), "sessions": (2.0, 128)}


def family(name: str) -> str:
    """colocated_2x1 / colocated_1x2 / disaggregated / conditional."""
    return name if name.startswith("colocated") else name.split("_")[0]


def cases_for(result: dict, workload: str, rate: float) -> list[dict]:
    """Per SLO mix: the pick, its prediction, and the best other family's."""
    rows = {r["name"]: r for r in result["candidates"]}
    out = []
    for slo in DEFAULT_MIXES:
        pick = result["best"][slo]["name"]
        others = [r for r in rows.values() if family(r["name"]) != family(pick)]
        alt = max(others, key=lambda r: r["at"][0]["goodput"][slo])
        out.append({"workload": workload, "slo": slo, "rate": rate, "recommended": pick,
                    "predicted_goodput": rows[pick]["at"][0]["goodput"][slo],
                    "alternative": alt["name"],
                    "alternative_predicted_goodput": alt["at"][0]["goodput"][slo]})
    return out


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
            seed: int, folder: Path, only: set[str]) -> None:
    """Start each deployment of `deps` once and run each workload it `needs` (with
    `only`: the deployments named there, every workload) that `folder` lacks."""
    import asyncio

    from transformers import AutoTokenizer

    from ..compare import _summary
    from ..deployments import Hardware
    from ..load import progress, run, warm_up
    from ..workloads import BUILDERS
    tokenizer = AutoTokenizer.from_pretrained(model)
    hw = Hardware("cpu", tuple(sorted(os.sched_getaffinity(0))))
    for dep in deps:
        wanted = (list(plan) if dep.name in only else []) if only else needs.get(dep.name, [])
        todo = [w for w in wanted if not _cache_path(folder, dep.name, w, *plan[w], seed).exists()]
        if not todo:
            continue
        stack = stack_for(dep, model, hw)
        progress(f"{dep.name}: starting")
        try:
            urls = stack.start()
            asyncio.run(warm_up(urls, model))
            for w in todo:
                rate, n = plan[w]
                progress(f"{dep.name}: {w} at {rate}/s, {n} requests")
                load0 = os.getloadavg()[0]
                result = asyncio.run(run(BUILDERS[w](tokenizer, n, seed), urls, model, rate, seed))
                summary = _summary(result, tokenizer, DEFAULT_MIXES)
                summary.pop("samples")
                # the machine is shared: what else ran shows in its load
                summary["loadavg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
                _cache_path(folder, dep.name, w, rate, n, seed).write_text(json.dumps(summary))
        finally:
            stack.stop()
            progress(f"{dep.name}: stopped")


def _error(predicted: float, measured: float | None) -> float | None:
    return round((predicted - measured) / measured, 3) if measured else None


def settle(cases: list[dict], plan: dict, seed: int, folder: Path) -> list[dict]:
    """Fill each case's measured goodputs (None where not measured) and errors."""
    out = []
    for c in cases:
        rate, n = plan[c["workload"]]
        got = {}
        for role in ("recommended", "alternative"):
            path = _cache_path(folder, c[role], c["workload"], rate, n, seed)
            got[role] = (json.loads(path.read_text())["goodput"][c["slo"]]
                         if path.exists() else None)
        rec, alt = got["recommended"], got["alternative"]
        out.append({**c, "measured_goodput": rec, "alternative_measured_goodput": alt,
                    "error": _error(c["predicted_goodput"], rec),
                    "alternative_error": _error(c["alternative_predicted_goodput"], alt),
                    "recommended_won": None if rec is None or alt is None else rec >= alt})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="a profile JSON (`pdserve plan profile`)")
    p.add_argument("--quick", action="store_true",
                   help=f"{', '.join(f'{w} {r:g}/s x {n}' for w, (r, n) in QUICK.items())}")
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
    p.add_argument("--reps", type=int, default=3, help="simulated runs per prediction")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the measured runs' prompts and arrivals, and of the "
                        "simulated arrivals")


def plan_cases(profile: Profile, plan: dict, seed: int, reps: int) -> tuple[list, dict]:
    """(cases without measurements, the candidates each workload needs measured)."""
    engines = len(os.sched_getaffinity(0)) // profile.units_per_engine
    cases, needs = [], {}
    for w, (rate, n) in plan.items():
        s = Setting(profile, Workload(w), n, reps, seed, host_knobs(profile), arrival_seed=seed)
        result = recommend(s, engines, dict(DEFAULT_MIXES), [rate])
        cases += cases_for(result, w, rate)
    for c in cases:
        for role in ("recommended", "alternative"):
            needs.setdefault(c[role], [])
            if c["workload"] not in needs[c[role]]:
                needs[c[role]].append(c["workload"])
    return cases, needs


def table(cases: list[dict]) -> str:
    lines = [f"{'workload':13s} {'slo':11s} {'recommended':34s} {'pred':>6s} {'meas':>6s} "
             f"{'err':>7s}  {'alternative':34s} {'meas':>6s} won"]
    for c in cases:
        err = f"{c['error']:+.1%}" if c["error"] is not None else "-"
        lines.append(f"{c['workload']:13s} {c['slo']:11s} {c['recommended']:34s} "
                     f"{c['predicted_goodput']:6.2f} {c['measured_goodput'] or 0:6.2f} {err:>7s}  "
                     f"{c['alternative']:34s} {c['alternative_measured_goodput'] or 0:6.2f} "
                     f"{c['recommended_won']}")
    return "\n".join(lines)


def _model(given: str) -> str:
    from ..cli import _model as model
    return model(given)


def main(a: argparse.Namespace) -> int:
    base = QUICK if a.quick else FULL
    try:
        profile = Profile.load(Path(a.profile))
        wanted = a.workloads.split(",") if a.workloads else list(base)
        plan = {w: base[w] for w in wanted}
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
    if only:                # measure only: cases come from a later command
        measure([d for d in candidates(engines) if d.name in only], {}, plan,
                _model(a.model), a.seed, folder, only)
        print(json.dumps({"measured": sorted(str(p) for p in folder.glob("*.json"))}))
        return 0
    cases, needs = plan_cases(profile, plan, a.seed, a.reps)
    if not a.predict_only:
        measure([d for d in candidates(engines) if d.name in needs], needs, plan,
                _model(a.model), a.seed, folder, only)
    cases = settle(cases, plan, a.seed, folder)
    errors = [abs(c["error"]) for c in cases if c["error"] is not None]
    out = {"command": "pdserve plan check " + shlex.join(sys.argv[3:]),
           "profile": {"model": profile.model, "device": profile.device, "path": a.profile},
           "plan": {w: {"rate": r, "requests": n} for w, (r, n) in plan.items()},
           "needs": needs, "cases": cases,
           "max_abs_error": max(errors, default=None),
           "recommended_won": sum(bool(c["recommended_won"]) for c in cases),
           "measured_cases": sum(c["recommended_won"] is not None for c in cases)}
    print(json.dumps(out) if a.json else table(cases))
    return 0
