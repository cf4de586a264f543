"""`pdserve plan ...`: the command line of the planner.

    pdserve plan profile [--model M] [--device cpu|cuda] [--out FILE] [--quick]
                         [--max-context N] [--json]
                                 measure the engine: prefill, decode, KV transfer and the
                                 edge's and router's overheads, saved as a profile
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
                                   "(docs/planning.md).")}


def main(argv: list[str]) -> int:
    """Dispatch `pdserve plan <what> ...`."""
    from pdserve.bench.cli import dispatch
    return dispatch(commands(), __doc__, argv)
