"""The deployments the planner weighs for N units, and how to start the one it picks.

For N units and a profile of an engine on U units (`units_per_engine`), E = N / U engines:
- colocated: E / k engines of k x U units each, for every k dividing E (on 2 cores:
  `colocated_2x1`, two one-core engines the client alternates between, and
  `colocated_1x2`, one engine on both cores); stock vLLM servers, no edge;
- disaggregated, every P:D split of E (`disaggregated_1p1d`, ...): every prompt
  prefilled remotely unless the decode engine holds `local_cached_fraction` of it
  (the router's default, as `pdserve bench compare` runs it);
- conditional, with the router's thresholds searched over a small grid
  (`--local-prefill-below`, `--prefill-saturated`) at the P:D splits that did best
  disaggregated (recommend.py).
"""
from __future__ import annotations

from .sim import Deployment

BELOW = (256, 512, 1024)        # --local-prefill-below values tried
SATURATED = (0, 2)              # --prefill-saturated values tried (0: off)


def candidates(engines: int, conditional: bool = True) -> list[Deployment]:
    """Every candidate for `engines` engines of the profiled size (with `conditional`,
    the thresholds' grid at every split)."""
    if engines < 1:
        raise ValueError(f"need at least one engine's units, got {engines} engines")
    out = [Deployment(f"colocated_{engines // k}x{k}", prefill=0, decode=engines // k,
                      units_per_engine=k, gateway=False)
           for k in range(1, engines + 1) if engines % k == 0]
    for p in range(1, engines):
        out.append(Deployment(f"disaggregated_{p}p{engines - p}d", prefill=p,
                              decode=engines - p))
        if conditional:
            out += conditionals(p, engines - p)
    return out


def conditionals(prefill: int, decode: int) -> list[Deployment]:
    """The thresholds' grid at one P:D split."""
    return [Deployment(f"conditional_{prefill}p{decode}d_below{b}_sat{s}", prefill=prefill,
                       decode=decode, local_prefill_below=b, prefill_saturated=s)
            for b in BELOW for s in SATURATED]


def up_flags(dep: Deployment) -> list[str] | None:
    """`pdserve up` flags for `dep` (None: colocated, which `up` does not run)."""
    if not dep.prefill:
        return None
    return ["--prefill-workers", str(dep.prefill), "--decode-workers", str(dep.decode),
            *placement_flags(dep)]


def placement_flags(dep: Deployment) -> list[str]:
    """The router's placement flags for `dep`."""
    return ["--local-prefill-below", str(dep.local_prefill_below),
            "--local-cached-fraction", f"{dep.local_cached_fraction:g}",
            "--prefill-saturated", str(dep.prefill_saturated)]


def how_to_run(dep: Deployment, profile_units: int) -> dict:
    """`pdserve up` flags, k8s replica counts and router args, or a colocated server
    line, for the chosen deployment."""
    units = dep.units_per_engine * profile_units
    if not dep.prefill:
        return {"colocated": f"{dep.decode} stock vLLM server(s), {units} unit(s) each "
                             f"(tensor parallel {units} on GPUs), clients spread over them",
                "k8s": {"pdserve-prefill": 0, "pdserve-decode": dep.decode,
                        "edge_args": ["--min-prefill-workers=0"],
                        "note": "the edge over decode workers that prefill every prompt"}}
    return {"pdserve_up": ["pdserve", "up", *up_flags(dep)],
            "k8s": {"pdserve-prefill": dep.prefill, "pdserve-decode": dep.decode,
                    "router_args": [f"{f}={v}" for f, v in zip(placement_flags(dep)[::2],
                                                               placement_flags(dep)[1::2])]}}
