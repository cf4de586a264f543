"""`pdserve plan recommend`: simulate every candidate deployment, pick the best for an SLO.

For each candidate (candidates.py) and SLO: the predicted goodput at each `--rate`
(requests/s meeting the SLO, slo.py's definition; the mean over `--reps` simulated
runs) and the highest rate it sustains: the highest rate at which at least
`--attainment` (default 90%) of the requests meet the SLO, found by bisection. The
best candidate has the highest goodput at the first rate (without `--rate`: the
highest sustained rate); near-ties (within 2%) go to the higher sustained rate, then
to the simpler deployment (colocated, then disaggregated, then conditional).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from statistics import mean

from .candidates import candidates, conditionals, how_to_run
from .demand import BUILDERS, Demand, load_trace
from .profile import Profile
from .sim import Deployment, Knobs, simulate
from ..slo import DEFAULT_MIXES, SLO

TIE = 0.02
SPAN_S = 20.0          # a sustained-rate run's arrivals last at least this long ...
MAX_REQUESTS = 4000    # ... within this many requests
SPLITS = 2             # conditional thresholds are tried at this many best P:D splits
# On one CPU machine the load's client, the edge and the router share the engines' cores,
# and the server's output path runs between engine steps: fit to bench/results/compare.json
# with `pdserve plan calibrate` (docs/planning.md).
CPU_HOST = Knobs(host_request_ms=10.0, host_token_ms=1.0, serve_step_ms=5.0,
                 serve_token_ms=0.2)


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    """A named way to build the demand of one run: a benchmark mix or a trace."""

    name: str
    trace: Demand | None = None

    def build(self, n: int, seed: int, rate: float) -> Demand:
        if self.trace is None:
            return BUILDERS[self.name](n, seed)
        # A trace runs at its own times; another rate replays it faster or slower.
        arrivals = self.trace.arrivals or [0.0]
        span = max(arrivals) or 1.0
        scale = (len(arrivals) / span) / rate
        return dataclasses.replace(self.trace, arrivals=[t * scale for t in arrivals])

    def native_rate(self) -> float | None:
        if self.trace is None or not self.trace.arrivals:
            return None
        return len(self.trace.arrivals) / (max(self.trace.arrivals) or 1.0)


def workload(spec: str) -> Workload:
    """A benchmark workload's name or a JSONL trace's path."""
    if spec in BUILDERS:
        return Workload(spec)
    if spec.endswith(".jsonl") or Path(spec).exists():
        return Workload(Path(spec).stem, trace=load_trace(Path(spec)))
    raise ValueError(f"--workload must be one of {sorted(BUILDERS)} or a .jsonl trace, "
                     f"got {spec!r}")


def parse_slo(spec: str) -> tuple[str, SLO]:
    """'ttft_p99=250,itl_p99=40' (or ttft=..,itl=..), or a benchmark mix's name."""
    if spec in DEFAULT_MIXES:
        return spec, DEFAULT_MIXES[spec]
    try:
        values = {k.strip().removesuffix("_p99"): float(v)
                  for k, v in (part.split("=") for part in spec.split(","))}
        return spec, SLO(ttft_ms=values["ttft"], itl_ms=values["itl"])
    except (ValueError, KeyError) as e:
        raise ValueError(f"--slo must be ttft_p99=MS,itl_p99=MS or one of "
                         f"{sorted(DEFAULT_MIXES)}, got {spec!r}") from e


@dataclasses.dataclass(frozen=True, slots=True)
class Setting:
    """What every simulation of one recommendation shares."""

    profile: Profile
    workload: Workload
    requests: int = 120
    reps: int = 3
    seed: int = 0
    knobs: Knobs = Knobs()
    arrival_seed: int | None = None     # fixed: a measured run's arrivals
    span_s: float = SPAN_S              # a sustained-rate run's arrivals last this long

    def runs(self, dep: Deployment, rate: float) -> list:
        return [simulate(self.profile, dep, self.workload.build(self.requests, self.seed + k, rate),
                         rate, self.seed + k if self.arrival_seed is None else self.arrival_seed,
                         self.knobs)
                for k in range(self.reps)]


def predict(s: Setting, dep: Deployment, rate: float, slos: dict[str, SLO]) -> dict:
    """Mean goodput per SLO, and the p99 TTFT and longest token gap, at `rate`."""
    runs = s.runs(dep, rate)
    return {"rate": rate,
            "goodput": {n: round(mean(r.goodput(x.ttft_ms, x.itl_ms) for r in runs), 3)
                        for n, x in slos.items()},
            "attainment": {n: round(mean(r.attainment(x.ttft_ms, x.itl_ms) for r in runs), 3)
                           for n, x in slos.items()},
            "ttft_p99_ms": round(mean(r.p99("ttft_ms") for r in runs), 1),
            "max_gap_p99_ms": round(mean(r.p99("max_gap_ms") for r in runs), 1)}


def sustained(s: Setting, dep: Deployment, slos: dict[str, SLO], attainment: float = 0.9,
              start: float = 0.1, refine: int = 4) -> tuple[dict[str, float], list[str]]:
    """Per SLO, the highest rate at which `attainment` of the requests meet it: rates
    grow 1.5x from `start` until every SLO fails, then bisection. Each run lasts at least
    `span_s` of arrivals and only its second half counts: a backlog that grows (a rate
    the deployment cannot keep up with) fails there, whatever the SLO's slack. Runs stop
    at MAX_REQUESTS requests: past MAX_REQUESTS / span_s the search stops, and the SLOs
    still met there are returned second (their rate is a lower bound)."""
    def att(rate: float) -> dict[str, float]:
        n = min(MAX_REQUESTS, max(s.requests, int(rate * s.span_s)))
        runs = dataclasses.replace(s, requests=n, reps=min(s.reps, 2)).runs(dep, rate)
        return {k: mean(r.attainment(x.ttft_ms, x.itl_ms, r.median_sent_s()) for r in runs)
                for k, x in slos.items()}
    ok = dict.fromkeys(slos, 0.0)
    bad: dict[str, float] = {}
    rate = start
    while len(bad) < len(slos) and rate * s.span_s <= MAX_REQUESTS:
        for k, a in att(rate).items():
            if k not in bad:
                (ok.__setitem__ if a >= attainment else bad.__setitem__)(k, rate)
        rate *= 1.5
    for k in slos:
        lo, hi = ok[k], bad.get(k, ok[k])
        for _ in range(refine if hi > lo else 0):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if att(mid)[k] >= attainment else (lo, mid)
        ok[k] = round(lo, 3)
    return ok, [k for k in slos if k not in bad]


def _kind_order(name: str) -> int:
    return ("colocated", "disaggregated", "conditional").index(name.split("_")[0])


def _score(row: dict, slo: str, by_rate: bool, at: int) -> float:
    return row["at"][at]["goodput"][slo] if by_rate else row["sustained"][slo]


def best(rows: list[dict], slo: str, by_rate: bool, at: int = 0) -> dict:
    """The row to recommend for `slo` (module docstring), by the goodput at its `at`th
    rate when `by_rate`."""
    top = max(_score(r, slo, by_rate, at) for r in rows)
    near = [r for r in rows if _score(r, slo, by_rate, at) >= top * (1 - TIE)]
    return max(near, key=lambda r: (r["sustained"][slo], -_kind_order(r["name"])))


def _row(s: Setting, dep: Deployment, slos: dict[str, SLO], rates: list[float],
         attainment: float) -> dict:
    rate, capped = sustained(s, dep, slos, attainment,
                             start=(s.workload.native_rate() or 1.0) / 10)
    return {"name": dep.name, "deployment": dep, "at": [predict(s, dep, r, slos) for r in rates],
            "sustained": rate, "sustained_at_least": capped}


def recommend(s: Setting, engines: int, slos: dict[str, SLO], rates: list[float],
              attainment: float = 0.9, only: list[Deployment] | None = None) -> dict:
    """Every candidate's predictions and the best per SLO. Conditional thresholds are
    searched only at the P:D splits that did best disaggregated, per SLO (`SPLITS`)."""
    rows = [_row(s, d, slos, rates, attainment) for d in only or candidates(engines, False)]
    if only is None:
        pd = [r for r in rows if r["deployment"].prefill]
        # by sustained rate: at one modest rate the splits mostly tie
        splits = {(r["deployment"].prefill, r["deployment"].decode) for n in slos
                  for r in sorted(pd, key=lambda r: -r["sustained"][n])[:SPLITS]}
        rows += [_row(s, d, slos, rates, attainment)
                 for p, d_ in sorted(splits) for d in conditionals(p, d_)]
    picks = {}
    for n in slos:
        b = best(rows, n, bool(rates))
        picks[n] = {"name": b["name"], **how_to_run(b["deployment"], s.profile.units_per_engine)}
    return {"candidates": [{k: v for k, v in r.items() if k != "deployment"} for r in rows],
            "best": picks}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="a profile JSON (`pdserve plan profile`)")
    p.add_argument("--workload", required=True,
                   help=f"one of {', '.join(BUILDERS)}, or a JSONL trace (docs/planning.md)")
    p.add_argument("--slo", action="append", required=True,
                   help="ttft_p99=MS,itl_p99=MS or a benchmark mix (itl_strict, ttft_strict, "
                        "balanced); repeatable")
    p.add_argument("--devices", type=int, required=True,
                   help="units to deploy on (cores, GPUs); the profile's engine uses "
                        "units_per_engine of them")
    p.add_argument("--rate", default="", help="comma-separated rates (requests/s; sessions/s "
                                              "for sessions); default: rank by sustained rate")
    p.add_argument("--requests", type=int, default=120, help="requests per simulated run")
    p.add_argument("--reps", type=int, default=3, help="simulated runs per point, averaged")
    p.add_argument("--span-s", type=float, default=SPAN_S,
                   help="a sustained-rate run's arrivals last at least this long (s); "
                        f"the search stops at {MAX_REQUESTS} requests")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="share of requests meeting the SLO that counts as sustained")
    add_knob_arguments(p)
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the simulated arrivals and lengths (run k uses seed + k)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_knob_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--unit-speedup-prefill", type=float, default=Knobs().unit_speedup_prefill,
                   help="an engine on k units prefills 1 + this x (k - 1) times faster than "
                        "the profiled one (beyond the fixed step cost)")
    p.add_argument("--unit-speedup-decode", type=float, default=Knobs().unit_speedup_decode,
                   help="the same for a decode step")
    p.add_argument("--host-request-ms", type=float, default=None,
                   help="CPU ms a request costs the clients and gateway on the engines' own "
                        f"cores (default: {CPU_HOST.host_request_ms:g} for a cpu profile, "
                        "where they share the machine; 0 for cuda)")
    p.add_argument("--host-token-ms", type=float, default=None,
                   help=f"the same per streamed token (default: {CPU_HOST.host_token_ms:g} "
                        "for a cpu profile, 0 for cuda)")
    p.add_argument("--serve-step-ms", type=float, default=None,
                   help="ms the serving process adds to an engine step that streams tokens "
                        "(output path) (default for a cpu profile: what its measured decode "
                        "leg spent a token beyond a decode step, else "
                        f"{CPU_HOST.serve_step_ms:g}; 0 for cuda)")
    p.add_argument("--serve-token-ms", type=float, default=None,
                   help=f"the same per streamed token (default: {CPU_HOST.serve_token_ms:g} "
                        "for a cpu profile, 0 for cuda)")


def serve_step_ms(profile: Profile) -> float | None:
    """What a worker's serving adds to a decode step, from the profile's own measurement:
    its decode leg's engine time a token (`sweep.legs`, a request streamed through
    pdserve) beyond one profiled decode step, less one token's output cost."""
    legs = profile.sweep.get("legs", {})
    if not legs.get("decode_engine_ms") or not legs.get("overhead_output_tokens"):
        return None
    tokens = legs["overhead_output_tokens"]
    step = profile.decode_step_ms(1, legs.get("overhead_prompt_tokens", 0) + tokens / 2)
    return max(0.0, legs["decode_engine_ms"] / tokens - step - CPU_HOST.serve_token_ms)


def host_knobs(profile: Profile) -> Knobs:
    """The defaults of the shared-host knobs for `profile`'s device."""
    if profile.device != "cpu":
        return Knobs()
    measured = serve_step_ms(profile)
    return CPU_HOST if measured is None else dataclasses.replace(CPU_HOST,
                                                                 serve_step_ms=measured)


def knobs_from(a: argparse.Namespace, profile: Profile) -> Knobs:
    """The modelling knobs the flags give, the host's share by the profile's device."""
    host = host_knobs(profile)
    values = {k: getattr(a, k) for k in ("unit_speedup_prefill", "unit_speedup_decode")} | {
        k: getattr(host, k) if getattr(a, k) is None else getattr(a, k)
        for k in ("host_request_ms", "host_token_ms", "serve_step_ms", "serve_token_ms")}
    if bad := [k for k, v in values.items() if v < 0]:
        raise ValueError(f"--{bad[0].replace('_', '-')} must be >= 0")
    return Knobs(**values)


def _engines(profile: Profile, devices: int) -> int:
    if devices < profile.units_per_engine:
        raise ValueError(f"--devices {devices} is fewer than the profile's engine needs "
                         f"({profile.units_per_engine})")
    return devices // profile.units_per_engine


def setting_from(a: argparse.Namespace) -> tuple[Setting, dict[str, SLO], list[float]]:
    """Validated inputs of recommend (ValueError names the flag)."""
    if a.requests < 1 or a.reps < 1 or a.span_s <= 0:
        raise ValueError("--requests and --reps must be >= 1, --span-s > 0")
    if not 0 < a.attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {a.attainment}")
    try:
        rates = [float(r) for r in a.rate.split(",")] if a.rate else []
    except ValueError as e:
        raise ValueError(f"--rate must be comma-separated numbers, got {a.rate!r}") from e
    if any(r <= 0 for r in rates):
        raise ValueError("--rate values must be > 0")
    try:
        profile = Profile.load(Path(a.profile))
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"--profile {a.profile}: {e}") from e
    slos = dict(parse_slo(x) for x in a.slo)
    knobs = knobs_from(a, profile)
    return (Setting(profile, workload(a.workload), a.requests, a.reps, a.seed, knobs,
                    span_s=a.span_s), slos, rates)


def table(result: dict, slos: list[str]) -> str:
    """The candidates, one line each, and the pick per SLO."""
    lines = []
    for r in result["candidates"]:
        at = "  ".join(f"@{p['rate']:g}: " + ",".join(f"{p['goodput'][n]:.2f}" for n in slos)
                       for p in r["at"])
        sus = ",".join(("≥" if n in r["sustained_at_least"] else "") + f"{r['sustained'][n]:g}"
                       for n in slos)
        lines.append(f"{r['name']:36s} goodput {at}  sustains {sus}")
    for n, b in result["best"].items():
        run = " ".join(b.get("pdserve_up", [])) or b.get("colocated", "")
        lines.append(f"best for {n}: {b['name']}\n  {run}\n  k8s: {b['k8s']}")
    return "\n".join(lines)


def main(a: argparse.Namespace) -> int:
    try:
        s, slos, rates = setting_from(a)
        engines = _engines(s.profile, a.devices)
    except ValueError as e:
        print(f"pdserve plan recommend: {e}", file=sys.stderr)
        return 2
    result = recommend(s, engines, slos, rates, a.attainment)
    result |= {"workload": a.workload, "devices": a.devices, "rates": rates,
               "slo": {n: dataclasses.asdict(x) for n, x in slos.items()},
               "profile": {"model": s.profile.model, "device": s.profile.device}}
    print(json.dumps(result) if a.json else table(result, list(slos)))
    return 0
