"""`pdserve plan calibrate`: the simulator against every run of a `pdserve bench compare`.

compare.json holds each deployment's measured goodput per workload, rate and SLO mix.
Each run is simulated with the same request count and the same arrivals (compare sends
every run with `--seed`, 0 by default), and the prediction is printed beside the
measurement: how far the simulator is off, by deployment and workload, before anyone
trusts its pick. No engine is started.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import mean

from .profile import Profile
from .recommend import Setting, Workload, add_knob_arguments, knobs_from, predict
from .sim import Deployment
from ..slo import SLO

# compare's deployments as the planner's candidates (compare.py's _deployments)
DEPLOYMENTS = {
    "disaggregated": Deployment("disaggregated_1p1d", prefill=1, decode=1),
    "conditional": Deployment("conditional_1p1d_below512_sat2", prefill=1, decode=1,
                              local_prefill_below=512, prefill_saturated=2),
    "colocated_1x2": Deployment("colocated_1x2", decode=1, units_per_engine=2, gateway=False),
    "colocated_2x1": Deployment("colocated_2x1", decode=2, gateway=False),
}
REQUESTS = {"long_prompts": 60, "short_chat": 60, "sessions": 48}   # compare's FULL plan


def rows(profile: Profile, compare: dict, reps: int, seed: int, knobs) -> list[dict]:
    """Every simulated run beside its measurement."""
    mixes = {k: SLO(v["ttft_ms"], v["itl_ms"]) for k, v in compare["slo_mixes"].items()}
    out = []
    for run in compare["runs"]:
        dep = DEPLOYMENTS.get(run["deployment"])
        n = REQUESTS.get(run["workload"])
        if dep is None or n is None:
            continue
        s = Setting(profile, Workload(run["workload"]), n, reps, seed, knobs, arrival_seed=seed)
        p = predict(s, dep, run["rate"], mixes)
        out.append({"deployment": run["deployment"], "workload": run["workload"],
                    "rate": run["rate"], "predicted": p["goodput"], "measured": run["goodput"],
                    "predicted_ttft_p99_ms": p["ttft_p99_ms"],
                    "measured_ttft_p99_ms": run["ttft_p99_ms"],
                    "error": {m: round((p["goodput"][m] - g) / g, 3) if g else None
                              for m, g in run["goodput"].items()}})
    return out


def table(out: list[dict]) -> str:
    mixes = list(out[0]["error"]) if out else []
    lines = [f"{'deployment':14s} {'workload':13s} {'rate':>4s}  " +
             "  ".join(f"{m + ' pred/meas':>24s}" for m in mixes) + "  TTFT p99 pred/meas"]
    for r in out:
        cells = "  ".join(f"{r['predicted'][m]:7.2f} /{r['measured'][m]:5.2f} "
                          f"{(r['error'][m] or 0):+6.0%}" for m in mixes)
        lines.append(f"{r['deployment']:14s} {r['workload']:13s} {r['rate']:4g}  {cells}  "
                     f"{r['predicted_ttft_p99_ms']:6.0f} / {r['measured_ttft_p99_ms']:.0f}")
    errors = [abs(e) for r in out for e in r["error"].values() if e is not None]
    if errors:
        lines.append(f"mean |error| {mean(errors):.1%}, max {max(errors):.1%}, "
                     f"within 15%: {sum(e <= 0.15 for e in errors)}/{len(errors)}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="a profile JSON (`pdserve plan profile`)")
    p.add_argument("--compare", default="bench/results/compare.json",
                   help="a `pdserve bench compare` result")
    p.add_argument("--reps", type=int, default=3, help="simulated runs per point")
    p.add_argument("--seed", type=int, default=0, help="the seed compare ran with")
    add_knob_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(a: argparse.Namespace) -> int:
    try:
        profile = Profile.load(Path(a.profile))
        compare = json.loads(Path(a.compare).read_text())
        knobs = knobs_from(a, profile)
    except (OSError, ValueError, TypeError) as e:
        print(f"pdserve plan calibrate: {e}", file=sys.stderr)
        return 2
    out = rows(profile, compare, a.reps, a.seed, knobs)
    print(json.dumps({"profile": a.profile, "compare": a.compare, "runs": out}) if a.json
          else table(out))
    return 0
