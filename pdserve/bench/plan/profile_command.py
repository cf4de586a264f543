"""`pdserve plan profile`: its flags, and the run that saves a profile (sweep.py)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from pathlib import Path

from pdserve.bench.plan.sweep import ProfileRun, profile
from pdserve.flags import DEFAULT_MODEL_DIR


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`pdserve plan profile`'s flags."""
    p.add_argument("--model", default="",
                   help=f"model dir or name (default: the tiny model, {DEFAULT_MODEL_DIR})")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu or cuda: the engine takes that device's defaults "
                        "(docs/engine-flags.md)")
    p.add_argument("--gpus", default="0,1",
                   help="cuda: the GPUs of the stack part (half prefill, half decode); the "
                        "engine part runs on the decode half")
    p.add_argument("--out", default="", help="write the profile (JSON) to this file")
    p.add_argument("--quick", action="store_true",
                   help="fewer points and repetitions (about half the time)")
    p.add_argument("--max-context", type=int, default=0,
                   help="profile prompts up to this many tokens (the model's context is "
                        "extended when its config allows fewer: tiny_model.long_context_copy)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random prompts and of the engine")
    p.add_argument("--json", action="store_true",
                   help="print the profile as JSON on stdout (progress stays on stderr)")


def _units(device: str, gpus: str) -> tuple[int, ...]:
    if device == "cuda":
        try:
            return tuple(int(g) for g in gpus.split(","))
        except ValueError:
            raise ValueError(f"--gpus must be comma-separated GPU ids, got {gpus!r}") from None
    return tuple(sorted(os.sched_getaffinity(0)))


def _command_line() -> str:
    """This process's `pdserve plan profile ...` as typed (what the profile records)."""
    argv = sys.argv[sys.argv.index("profile") + 1:] if "profile" in sys.argv else []
    return "pdserve plan profile " + shlex.join(argv)


def summary(profile) -> str:
    """The headline figures of a profile, as text."""
    lines = [f"{profile.model} on {profile.device} ({profile.units_per_engine} unit per "
             f"engine, block {profile.block_size}, step budget {profile.max_num_batched_tokens}"
             f" tokens, context {profile.max_model_len})"]
    for tokens in (128, 1024, 2048):
        if tokens <= profile.max_model_len:
            lines.append(f"  prefill {tokens:>6} tokens: {profile.prefill_ms(tokens):8.1f} ms"
                         f" ({profile.prefill_ms(tokens, 0.9):.1f} ms 90% cached)")
    for batch in (1, 8, 32):
        lines.append(f"  decode step, batch {batch:>2}, context 1024: "
                     f"{profile.decode_step_ms(batch, 1024):.2f} ms")
    lines.append(f"  transfer 1024 tokens: {profile.transfer_ms(1024):.2f} ms")
    o = profile.overheads
    lines.append(f"  edge {o.edge_request_ms} ms a request + {o.edge_token_ms} ms a token, "
                 f"router {o.router_request_ms} ms a request")
    return "\n".join(lines)


def main(a: argparse.Namespace) -> int:
    """Run the sweep of `a` (parsed flags); the profile's summary or JSON on stdout."""
    from pdserve.bench.engine_run import stdout_for_the_result

    try:
        run = ProfileRun(model=a.model or str(DEFAULT_MODEL_DIR), device=a.device,
                         units=_units(a.device, a.gpus), quick=a.quick,
                         max_context=a.max_context, seed=a.seed,
                         command=_command_line())
    except ValueError as e:
        print(f"pdserve plan profile: {e}", file=sys.stderr)
        return 2
    if not a.model:
        from pdserve.tiny_model import ensure_tiny_model
        ensure_tiny_model(DEFAULT_MODEL_DIR)
    # SIGTERM unwinds like Ctrl-C, so the stack it started is stopped.
    signal.signal(signal.SIGTERM, lambda sig, _: sys.exit(128 + sig))
    result = stdout_for_the_result()
    prof = profile(run, log=lambda line: print(f"pdserve plan profile: {line}",
                                               file=sys.stderr, flush=True))
    if a.out:
        prof.save(Path(a.out))
        print(f"pdserve plan profile: wrote {a.out}", file=sys.stderr)
    with result:
        print(json.dumps(prof.to_json()) if a.json else summary(prof), file=result)
    return 0
