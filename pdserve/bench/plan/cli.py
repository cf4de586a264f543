"""`pdserve plan ...`: the command line of the planner.

    pdserve plan profile [--model M] [--device cpu|cuda] [--out FILE] [--quick]
                         [--max-context N] [--json]
                                 measure the engine: prefill, decode, KV transfer and the
                                 edge's and router's overheads, saved as a profile
    pdserve plan recommend --profile P --workload W --slo ttft_p99=MS,itl_p99=MS
                           --devices N [--rate R,R] [--json]
                                 simulate every deployment over the profile; print the best
                                 as `pdserve up` flags and k8s replica counts
    pdserve plan check --profile P [--quick] [--json]
                                 run the recommended deployment and the best alternative on
                                 the benchmark's workloads; predicted vs measured goodput
    pdserve plan calibrate --profile P [--compare bench/results/compare.json]
                                 the simulator against every run of a compare result
    pdserve plan map --profile P [--png PATH] [--json]
                                 which deployment the planner picks by prompt length and rate
"""
from __future__ import annotations

import argparse
import importlib


def _subcommand(name: str, module: str, description: str):
    """A subcommand whose module has add_arguments(parser) and main(args) -> int."""
    def run(argv: list[str]) -> int:
        mod = importlib.import_module(f"pdserve.bench.plan.{module}")
        p = argparse.ArgumentParser(prog=f"pdserve plan {name}", description=description)
        mod.add_arguments(p)
        return mod.main(p.parse_args(argv))
    return run


def commands() -> dict:
    """Every `pdserve plan` subcommand: the function that parses its arguments and runs it."""
    return {"profile": _subcommand("profile", "profile_command",
                                   "Measure one engine (the configured model and device) and "
                                   "save its profile: prefill by prompt length and cached "
                                   "fraction, decode step by batch and context, KV transfer by "
                                   "prompt length, and the edge's and router's overheads "
                                   "(docs/planning.md)."),
            "recommend": _subcommand("recommend", "recommend",
                                     "Simulate every candidate deployment over an engine "
                                     "profile; print the best per SLO (docs/planning.md)."),
            "check": _subcommand("check", "check",
                                 "Run the recommended deployment and the best alternative "
                                 "through the benchmark's runner; predicted vs measured."),
            "calibrate": _subcommand("calibrate", "calibrate",
                                     "The simulator against every run of a `pdserve bench "
                                     "compare` result: predicted vs measured goodput."),
            "map": _subcommand("map", "regime",
                               "Which deployment the planner picks by prompt length and "
                               "rate: a table and a PNG.")}


def main(argv: list[str]) -> int:
    """Dispatch `pdserve plan <what> ...`."""
    from pdserve.bench.cli import dispatch
    return dispatch(commands(), __doc__, argv)
