"""`pdserve plan map`: which deployment the planner picks, by prompt length and rate.

Each cell simulates the long-prompt mix with its long prompts stretched to the cell's
length (half the requests that long with 16 output tokens, half 128-token prompts
decoding 64: long prefills land among decodes) at the cell's rate, over every
candidate, and picks as recommend does at a rate: the highest goodput, near-ties
(within 2%) to the simpler deployment. Printed as a markdown table; `--png` draws it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import mean

from .candidates import candidates
from .demand import long_context
from .profile import Profile
from .recommend import TIE, parse_slo
from .sim import simulate

FAMILIES = ("colocated_1x2", "colocated_2x1", "disaggregated", "conditional")


def family(name: str) -> str:
    """The map's colour: colocated engines by shape, P/D by policy."""
    if name.startswith("colocated"):
        return name if name in FAMILIES else "colocated"
    return name.split("_")[0]


def pick(profile: Profile, engines: int, length: int, rate: float, slo, requests: int,
         reps: int) -> tuple[str, float]:
    """(the best candidate, its goodput) for one cell."""
    scores = []
    for order, dep in enumerate(candidates(engines)):
        runs = [simulate(profile, dep, long_context(requests, k, length), rate, k)
                for k in range(reps)]
        scores.append((mean(r.goodput(slo.ttft_ms, slo.itl_ms) for r in runs), -order, dep.name))
    top = max(s[0] for s in scores)
    best = max((s for s in scores if s[0] >= top * (1 - TIE)), key=lambda s: s[1])
    return best[2], round(best[0], 3)


def regime_map(profile: Profile, engines: int, lengths: list[int], rates: list[float], slo,
               requests: int = 60, reps: int = 2) -> list[dict]:
    return [{"prompt_tokens": n, "rate": r,
             **dict(zip(("pick", "goodput"), pick(profile, engines, n, r, slo, requests, reps)))}
            for n in lengths for r in rates]


def table(cells: list[dict]) -> str:
    """Markdown: a row per prompt length, a column per rate."""
    rates = sorted({c["rate"] for c in cells})
    lines = ["| prompt tokens | " + " | ".join(f"{r:g}/s" for r in rates) + " |",
             "|---" * (len(rates) + 1) + "|"]
    for n in sorted({c["prompt_tokens"] for c in cells}):
        row = {c["rate"]: c for c in cells if c["prompt_tokens"] == n}
        lines.append(f"| {n} | " + " | ".join(
            f"{row[r]['pick']} ({row[r]['goodput']:g})" for r in rates) + " |")
    return "\n".join(lines)


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
            ax.text(j, i, f"{family(c['pick'])}\n{c['goodput']:g}/s", ha="center",
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
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(a: argparse.Namespace) -> int:
    try:
        profile = Profile.load(Path(a.profile))
        name, slo = parse_slo(a.slo)
        lengths = [int(x) for x in a.lengths.split(",")]
        rates = [float(x) for x in a.rates.split(",")]
        if a.devices < profile.units_per_engine or min(lengths) < 1 or min(rates) <= 0:
            raise ValueError("--devices must hold one engine; lengths and rates must be > 0")
    except (OSError, ValueError, TypeError) as e:
        print(f"pdserve plan map: {e}", file=sys.stderr)
        return 2
    cells = regime_map(profile, a.devices // profile.units_per_engine, lengths, rates, slo,
                       a.requests)
    if a.png:
        plot(cells, f"{profile.model} on {a.devices} {profile.device} units, SLO {name}: "
                    f"TTFT <= {slo.ttft_ms:g} ms, gap <= {slo.itl_ms:g} ms", Path(a.png))
    out = {"profile": profile.model, "devices": a.devices, "slo": name,
           "slo_ms": {"ttft": slo.ttft_ms, "itl": slo.itl_ms}, "cells": cells}
    print(json.dumps(out) if a.json else table(cells))
    return 0
