"""`pdserve plan profile`: measure one engine and save its profile (profile.py).

Two parts, one after the other, never together (each takes the machine):
1. the engine alone, in its own process on one unit (engine_sweep.py): prefill by
   prompt length and cached fraction, decode step by batch and context;
2. `pdserve up` with one prefill and one decode worker (stack_sweep.py): KV transfer
   by prompt length over the configured transport, and the edge's and router's
   overheads.
A longer context (`max_context`) profiles a copy of the model whose configs allow it
(`tiny_model.long_context_copy`: same weights, Llama's rotary positions).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.plan.grid import TOP_MARGIN, SweepSpec
from pdserve.bench.plan.profile import Overheads, Profile
from pdserve.bench.plan.stack_sweep import StackSpec

ENGINE_SWEEP_TIMEOUT_S = 1800


@dataclass(frozen=True)
class ProfileRun:
    """What to profile, and how thoroughly."""

    model: str
    device: str = "cpu"
    units: tuple[int, ...] = ()         # cores (cpu) or GPU ids (cuda); half each role
    quick: bool = False
    max_context: int = 0                # 0: the model's own max_model_len (2048)
    seed: int = 0
    command: str = ""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.max_context and not 256 <= self.max_context <= 1 << 20:
            raise ValueError(f"--max-context must be in 256..1048576, got {self.max_context}")
        if not self.units:
            raise ValueError("units must name at least one core or GPU")

    @property
    def max_model_len(self) -> int:
        return self.max_context or 2048


def transfer_lengths(max_len: int, quick: bool) -> tuple[int, ...]:
    """Prompt lengths of the transfer points: 128, 1,024, every 4x after, the top."""
    top = max_len - TOP_MARGIN
    lengths = [128, 1024] if quick else [128, 512, 1024]
    while lengths[-1] * 4 < top and max_len > 2048:
        lengths.append(lengths[-1] * 4)
    return tuple(x for x in lengths if x < top) + (top,)


def with_context(model: str, max_context: int, scratch: Path) -> str:
    """`model`, or a copy in `scratch` allowing `max_context` positions when its own
    config allows fewer."""
    from pdserve.tiny_model import long_context_copy
    if not max_context:
        return model
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"--max-context needs a model directory with a config.json: {model}")
    config = json.loads((Path(model) / "config.json").read_text())
    if config.get("max_position_embeddings", 0) >= max_context:
        return model
    return str(long_context_copy(Path(model), scratch / f"ctx{max_context}", max_context))


def run_engine_sweep(spec: SweepSpec, scratch: Path, gpus: list[int]) -> dict:
    """engine_sweep.py in its own process (pinned by its own set-up, given `gpus` on
    cuda); its result."""
    spec_file, out_file = scratch / "sweep-spec.json", scratch / "sweep-out.json"
    spec_file.write_text(json.dumps(spec.to_json()))
    with open(out_file, "w") as out:
        subprocess.run([sys.executable, "-m", "pdserve.bench.plan.engine_sweep", str(spec_file)],
                       stdout=out, check=True, timeout=ENGINE_SWEEP_TIMEOUT_S,
                       env={**os.environ, **({"CUDA_VISIBLE_DEVICES": ",".join(
                           map(str, gpus))} if spec.device == "cuda" else {})})
    return json.loads(out_file.read_text())


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def transport(device: str) -> str:
    """The KV transport the stack's workers use, as the connector sets it up."""
    devices = os.environ.get("UCX_NET_DEVICES", "lo" if device == "cpu" else "all")
    return (f"nixl/ucx (UCX_NET_DEVICES={devices}, UCX_TLS={os.environ.get('UCX_TLS', 'auto')}"
            f", pull)")


def profile(run: ProfileRun, log=print) -> Profile:
    """Both parts of the sweep for `run`, as a profile."""
    from pdserve.bench.deployments import Hardware
    from pdserve.bench.plan.stack_sweep import sweep as stack_sweep

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdserve-profile-") as tmp:
        model = with_context(run.model, run.max_context, Path(tmp))
        hw = Hardware(device=run.device, units=run.units, max_model_len=run.max_model_len)
        engine_units = hw.halves()[1]
        spec = SweepSpec(model=model, device=run.device, max_model_len=run.max_model_len,
                         cpus=",".join(map(str, engine_units)) if run.device == "cpu" else "",
                         quick=run.quick, seed=run.seed)
        log(f"engine sweep: {model} on {run.device} {engine_units}")
        engine = run_engine_sweep(spec, Path(tmp), engine_units)
        engine_s = time.monotonic() - started
        log(f"stack sweep: pdserve up, 1 prefill + 1 decode worker ({engine_s:.0f} s so far)")
        served = stack_sweep(model, hw, StackSpec(
            transfer_tokens=transfer_lengths(run.max_model_len, run.quick),
            transfer_requests=2 if run.quick or run.max_context else 4,
            overhead_reps=4 if run.quick else 8, seed=run.seed), log)
    e = engine["engine"]
    return Profile(
        model=run.model, device=run.device, prefill=engine["prefill"], decode=engine["decode"],
        transfer=served["transfer"], overheads=Overheads(**served["overheads"]),
        units_per_engine=len(engine_units), block_size=e["block_size"],
        max_num_batched_tokens=e["max_num_batched_tokens"], max_num_seqs=e["max_num_seqs"],
        max_model_len=e["max_model_len"], transport=transport(run.device),
        command=run.command, commit=_commit(),
        enable_chunked_prefill=e["enable_chunked_prefill"],
        sweep={"engine_s": round(engine_s), "total_s": round(time.monotonic() - started),
               "kv_tokens": e["kv_tokens"], "dtype": e["dtype"], "legs": served["legs"],
               "load_average": round(os.getloadavg()[0], 2)})
