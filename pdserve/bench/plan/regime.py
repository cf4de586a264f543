"""`pdserve plan map`: which deployment the planner picks, by prompt length and rate.

Each cell simulates the long-prompt mix with its long prompts stretched to the cell's
length (half the requests that long with 16 output tokens, half 128-token prompts
decoding 64: long prefills land among decodes) at the cell's rate, over the
candidates (conditional thresholds at the two best P:D splits), and picks as recommend
does at a rate: the highest goodput, near-ties (within 2%) to the simpler deployment.
Printed as a markdown table; `--png` draws it.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

from .candidates import candidates, conditionals
from .demand import long_context
from .profile import Profile
from .recommend import TIE, add_knob_arguments, knobs_from, parse_slo
from .sim import Deployment, Knobs, simulate
from ..slo import SLO

FAMILIES = ("colocated_1x2", "colocated_2x1", "disaggregated", "conditional")
SPAN_S = 20.0          # a cell's arrivals last at least this long ...
MAX_REQUESTS = 800     # ... within this many requests


def family(name: str) -> str:
    """The map's colour: colocated engines by shape, P/D by policy."""
    if name.startswith("colocated"):
        return name if name in FAMILIES else "colocated"
    return name.split("_")[0]


@dataclass(frozen=True, slots=True)
class Cell:
    """One cell's simulation: its long prompts' length and its rate."""

    profile: Profile
    length: int
    rate: float
    slo: SLO
    requests: int = 60
    reps: int = 2
    knobs: Knobs = Knobs()

    def goodput(self, dep: Deployment) -> float:
        n = min(MAX_REQUESTS, max(self.requests, int(self.rate * SPAN_S)))
        return mean(simulate(self.profile, dep, long_context(n, k, self.length), self.rate, k,
                             self.knobs).goodput(self.slo.ttft_ms, self.slo.itl_ms)
                    for k in range(self.reps))


def short(name: str) -> str:
    """'conditional_6p2d_below256_sat0' -> 'conditional 6p2d\n<256 sat0'."""
    kind, shape, *knobs = name.split("_")
    return f"{kind} {shape}" + (f"\n<{knobs[0][5:]} {knobs[1]}" if knobs else "")


def pick(cell: Cell, engines: int) -> dict:
    """The best candidate and its goodput for one cell, and the best of every family;
    conditional thresholds are tried at the two best P:D splits."""
    base = candidates(engines, conditional=False)
    scores = [(cell.goodput(d), d) for d in base]
    pd = sorted((s for s in scores if s[1].prefill), key=lambda s: -s[0])[:2]
    scores += [(cell.goodput(d), d)
               for _, top in pd for d in conditionals(top.prefill, top.decode)]
    order = {d.name: i for i, (_, d) in enumerate(scores)}
    best = max(g for g, _ in scores)
    # near-ties go to the simpler deployment: the earlier candidate
    g, dep = min((s for s in scores if s[0] >= best * (1 - TIE)), key=lambda s: order[s[1].name])
    families: dict[str, float] = {}
    for score, d in scores:
        families[family(d.name)] = max(families.get(family(d.name), 0.0), round(score, 3))
    return {"pick": dep.name, "goodput": round(g, 3), "by_family": families}


def regime_map(profile: Profile, engines: int, lengths: list[int], rates: list[float], slo: SLO,
               requests: int = 60, knobs: Knobs = Knobs()) -> list[dict]:
    return [{"prompt_tokens": n, "rate": r,
             **pick(Cell(profile, n, r, slo, requests, knobs=knobs), engines)}
            for n in lengths for r in rates]


def table(cells: list[dict]) -> str:
    """Markdown: a row per prompt length, a column per rate."""
    rates = sorted({c["rate"] for c in cells})
    lines = ["| prompt tokens | " + " | ".join(f"{r:g}/s" for r in rates) + " |",
             "|---" * (len(rates) + 1) + "|"]
    for n in sorted({c["prompt_tokens"] for c in cells}):
        row = {c["rate"]: c for c in cells if c["prompt_tokens"] == n}
        lines.append(f"| {n} | " + " | ".join(_cell(row[r]) for r in rates) + " |")
    return "\n".join(lines)


def _cell(c: dict) -> str:
    """'disaggregated_1p1d 3.88 (colocated_2x1 3.20)': the pick, and the best family on
    the other side of the colocated / prefill-elsewhere line."""
    def side(name: str) -> bool:
        return name.startswith("colocated")
    others = {f: g for f, g in c.get("by_family", {}).items() if side(f) != side(c["pick"])}
    rival = max(others, key=others.get) if others else ""
    return f"{c['pick']} {c['goodput']:g}" + (f" ({rival} {others[rival]:g})" if rival else "")


def plot(cells: list[dict], title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    lengths = sorted({c["prompt_tokens"] for c in cells})
    rates = sorted({c["rate"] for c in cells})
    names = FAMILIES + ("colocated",)
    grid = [[names.index(family(next(c["pick"] for c in cells if c["prompt_tokens"] == n
                                     and c["rate"] == r))) for r in rates] for n in lengths]
    colours = ["tab:orange", "tab:purple", "tab:blue", "tab:green", "tab:red"]
    fig, ax = plt.subplots(figsize=(1.6 * len(rates) + 2, 0.7 * len(lengths) + 1.8))
    ax.imshow(grid, cmap=ListedColormap(colours), vmin=0, vmax=len(names) - 1, aspect="auto")
    for i, n in enumerate(lengths):
        for j, r in enumerate(rates):
            c = next(c for c in cells if c["prompt_tokens"] == n and c["rate"] == r)
            ax.text(j, i, f"{short(c['pick'])}\n{c['goodput']:g}/s", ha="center",
                    va="center", fontsize=7)
    ax.set_xticks(range(len(rates)), [f"{r:g}" for r in rates])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("long prompt (tokens)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="a profile JSON (`pdserve plan profile`)")
    p.add_argument("--slo", default="itl_strict",
                   help="ttft_p99=MS,itl_p99=MS or a benchmark mix (default itl_strict)")
    p.add_argument("--devices", type=int, default=2, help="units to deploy on")
    p.add_argument("--lengths", default="256,512,1024,1600", help="long prompts' tokens")
    p.add_argument("--rates", default="0.5,1,2,4,8", help="offered rates (requests/s)")
    p.add_argument("--requests", type=int, default=60, help="requests per simulated run")
    p.add_argument("--png", default="", help="draw the map here")
    add_knob_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(a: argparse.Namespace) -> int:
    try:
        profile = Profile.load(Path(a.profile))
        name, slo = parse_slo(a.slo)
        lengths = [int(x) for x in a.lengths.split(",")]
        rates = [float(x) for x in a.rates.split(",")]
        if a.devices < profile.units_per_engine or min(lengths) < 1 or min(rates) <= 0:
            raise ValueError("--devices must hold one engine; lengths and rates must be > 0")
        knobs = knobs_from(a, profile)
    except (OSError, ValueError, TypeError) as e:
        print(f"pdserve plan map: {e}", file=sys.stderr)
        return 2
    cells = regime_map(profile, a.devices // profile.units_per_engine, lengths, rates, slo,
                       a.requests, knobs)
    if a.png:
        plot(cells, f"{profile.model} on {a.devices} {profile.device} units, SLO {name}: "
                    f"TTFT <= {slo.ttft_ms:g} ms, gap <= {slo.itl_ms:g} ms", Path(a.png))
    out = {"profile": profile.model, "devices": a.devices, "slo": name,
           "slo_ms": {"ttft": slo.ttft_ms, "itl": slo.itl_ms}, "cells": cells}
    print(json.dumps(out) if a.json else table(cells))
    return 0
