"""`pdserve up`: the whole stack as child processes on one machine.

Starts the router, N prefill and M decode workers (each engine on its own
cores or GPUs, or sharing them when there are more engines than units) and
the edge; prints one line when the edge reports healthy. A worker that dies
once the stack is up is restarted (the pool serves on without it meanwhile; at
most 3 times in 10 minutes); on Ctrl-C/SIGTERM, or when the router, the edge or
a worker before the stack is up dies, it stops every process it started.
Each child runs in its own session so that its engine subprocesses go with it.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pdserve.cli import PLACEMENT_FLAGS, EDGE_FLAGS
from pdserve.config import EngineConfig

_READY_TIMEOUT_S = 600
_STOP_GRACE_S = 40  # the edge gives in-flight streams 30 s


def _spread(units: list[str], n: int) -> list[str]:
    """`n` workers over `units` (cores or GPUs): contiguous equal shares when there are
    enough, else several workers share one unit, round-robin."""
    if n <= len(units):
        per = len(units) // n
        return [",".join(units[i * per:(i + 1) * per]) for i in range(n)]
    return [units[i % len(units)] for i in range(n)]


def _placement(a: argparse.Namespace, eng: EngineConfig) -> dict[str, list[str]]:
    """Cores (cpu) or CUDA_VISIBLE_DEVICES (cuda) of every prefill and decode worker.

    On CPU the prefill pool gets the lower half of the cores and the decode pool
    the upper half (or the given --prefill-cpus / --decode-cpus), each shared out
    among its workers; on GPUs each pool's --*-gpus are.
    """
    if eng.device == "cuda":
        pre, dec = a.prefill_gpus.split(","), a.decode_gpus.split(",")
    else:
        cores = [str(c) for c in sorted(os.sched_getaffinity(0))]
        half = max(1, len(cores) // 2)
        pre = a.prefill_cpus.split(",") if a.prefill_cpus else cores[:half]
        dec = a.decode_cpus.split(",") if a.decode_cpus else (cores[half:] or cores[:half])
    return {"prefill": _spread(pre, a.prefill_workers), "decode": _spread(dec, a.decode_workers)}


def _passed_on(name: str, value) -> list[str]:
    """A flag of `up` as its child takes it (booleans as --x / --no-x)."""
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return [f"--{flag}" if value else f"--no-{flag}"]
    return [f"--{flag}", str(value)]


def _engine_flags(a: argparse.Namespace, eng: EngineConfig) -> list[str]:
    return ["--model", eng.model, "--served-model-name", eng.name, "--device", eng.device,
            "--dtype", eng.dtype, "--max-model-len", str(eng.max_model_len),
            "--kv-cache-gb", str(a.kv_cache_gb),
            "--gpu-memory-utilization", str(eng.gpu_memory_utilization),
            "--tensor-parallel-size", str(eng.tensor_parallel_size),
            "--max-num-seqs", str(eng.max_num_seqs), "--seed", str(eng.seed)]


def _commands(a: argparse.Namespace, eng: EngineConfig) -> list[tuple[str, list[str], dict]]:
    """Router, every worker, edge. Worker k (prefill first, then decode) gets NIXL
    side-channel port --kv-port + k and metrics port --worker-metrics-port + k."""
    me = [sys.executable, "-m", "pdserve.cli", "--log-level", a.log_level]
    router = f"127.0.0.1:{a.router_port}"
    units = _placement(a, eng)
    workers = []
    for role, first_port in (("prefill", a.prefill_port), ("decode", a.decode_port)):
        for i, unit in enumerate(units[role]):
            k = len(workers)
            env = {"CUDA_VISIBLE_DEVICES": unit} if eng.device == "cuda" else {}
            pin = [] if eng.device == "cuda" else ["--cpus", unit]
            metrics = (["--metrics-port", str(a.worker_metrics_port + k)]
                       if a.worker_metrics_port else [])
            workers.append((f"{role}-{i}", me + [
                role, "--port", str(first_port + i), "--router", router,
                "--kv-port", str(a.kv_port + k), "--kv-lease-seconds", str(a.kv_lease_seconds),
                "--worker-id", f"{role}-{i}"] + pin + metrics
                + _engine_flags(a, eng), env))
    placement, streams = ([arg for name in names for arg in _passed_on(name, getattr(a, name))]
                          for names in (PLACEMENT_FLAGS, EDGE_FLAGS))
    # The gateway runs anywhere unless told: on the 2-core dev box, pinning it
    # to the prefill core measured a worse TTFT (its per-token wake-ups then
    # delay every prefill; bench/README.md).
    gateway_pin = ["--cpus", a.gateway_cpus] if a.gateway_cpus else []
    return [("router", me + ["router", "--port", str(a.router_port)] + gateway_pin + placement,
             {}),
            *workers,
            ("edge", me + ["edge", "--host", a.host, "--port", str(a.port),
                           "--grpc-port", str(a.grpc_port), "--router", router,
                           "--model", eng.model, "--served-model-name", eng.name,
                           "--max-model-len", str(eng.max_model_len),
                           "--min-prefill-workers", str(a.prefill_workers),
                           "--min-decode-workers", str(a.decode_workers)] + streams
             + gateway_pin, {})]


def healthy(url: str) -> bool:
    """True when `url` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    """Stop in reverse start order, one tier at a time: the edge drains its streams
    while the workers still serve them, then the workers, then the router.
    Whatever is left of a child's session after its grace period is SIGKILLed."""
    tiers = [("edge",), ("prefill-", "decode-"), ("router",)]
    for tier in tiers:
        members = [(n, p) for n, p in procs.items() if n.startswith(tier)]
        for _, p in members:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for name, p in members:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"pdserve: {name} did not stop in {_STOP_GRACE_S}s; killing",
                      file=sys.stderr)
            try:
                os.killpg(p.pid, signal.SIGKILL)  # engine subprocesses left in its session
            except ProcessLookupError:
                pass
            p.wait()


class _Restarts:
    """A worker is restarted when it dies, at most `limit` times in `window` seconds:
    one that keeps dying (bad flags, no memory) stops the stack instead."""

    def __init__(self, limit: int = 3, window: float = 600.0):
        self.limit, self.window = limit, window
        self.times: dict[str, list[float]] = {}

    def allow(self, name: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        recent = [t for t in self.times.get(name, []) if now - t < self.window]
        self.times[name] = recent + [now]
        return len(recent) < self.limit


def _clean_up_after(proc: subprocess.Popen) -> None:
    """What a dead worker leaves: the rest of its session (engine processes), and the
    socket file its engine published KV events on."""
    from services.worker.engine import kv_events_path
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    Path(kv_events_path(proc.pid)).unlink(missing_ok=True)


def run_stack(a: argparse.Namespace, eng: EngineConfig) -> int:
    """Run until signalled; returns the exit code."""
    if not a.model:
        from pdserve.tiny_model import ensure_tiny_model
        ensure_tiny_model(Path(eng.model))
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    procs: dict[str, subprocess.Popen] = {}
    commands = {name: (cmd, env) for name, cmd, env in _commands(a, eng)}
    restarts = _Restarts()
    health = f"http://{'127.0.0.1' if a.host in ('0.0.0.0', '') else a.host}:{a.port}/health"

    def start(name: str) -> None:
        cmd, env = commands[name]
        procs[name] = subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=True)

    try:
        for name in commands:
            start(name)
        ready_by = time.monotonic() + _READY_TIMEOUT_S
        ready = False
        while not stopping:
            for name in [n for n, p in procs.items() if p.poll() is not None]:
                code = procs[name].returncode
                _clean_up_after(procs[name])
                if not ready or name in ("router", "edge") or not restarts.allow(name):
                    print(f"pdserve: {name} exited (code {code}); stopping the stack",
                          file=sys.stderr)
                    return 1
                # A pool carries on without one worker (the router stops offering it);
                # the worker comes back on the same ports and registers again.
                print(f"pdserve: {name} exited (code {code}); restarting it", file=sys.stderr,
                      flush=True)
                start(name)
            if not ready and healthy(health):
                ready = True
                print(f"pdserve ready: http://{a.host}:{a.port} (router 127.0.0.1:{a.router_port},"
                      f" {a.prefill_workers} prefill from :{a.prefill_port}, {a.decode_workers}"
                      f" decode from :{a.decode_port}, model {eng.name})", flush=True)
            if not ready and time.monotonic() > ready_by:
                print(f"pdserve: not healthy after {_READY_TIMEOUT_S}s; stopping", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        _stop(procs)
        print(f"pdserve: stopped {len(procs)} processes", file=sys.stderr, flush=True)
