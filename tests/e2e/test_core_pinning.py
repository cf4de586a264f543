"""Each worker's engine stays on the cores it was given: every thread of every process.

vLLM's NIXL worker re-pins its model-runner thread on CPU (to the last core of
each NUMA node), which on a 2-core box puts the prefill engine on the decode
engine's core. This walks both worker trees after a disaggregated request (so
NIXL's handshake and transfer threads exist) and checks each thread's affinity.
"""
from __future__ import annotations

import json
import os
import time
import urllib.request

import psutil
import pytest

from cases import CASES
from pdserve.cli import parse_cpus


def _workers(stack) -> dict[str, tuple[psutil.Process, set[int]]]:
    """role -> (worker process, the cores its command line gave it)."""
    out = {}
    for pid in stack.proc.descendants():
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.NoSuchProcess:
            continue
        for role in ("prefill", "decode"):
            if "pdserve.cli" in cmd and role in cmd and "--cpus" in cmd:
                out[role] = (psutil.Process(pid), parse_cpus(cmd[cmd.index("--cpus") + 1]))
    return out


def _disaggregated_request(stack, case) -> None:
    req = urllib.request.Request(f"{stack.url}/v1/completions",
                                 data=json.dumps(case.body(stack.model, False)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["x-pdserve-path"] == "disaggregated"


def _threads_outside(proc: psutil.Process, cores: set[int]) -> list[str]:
    bad = []
    for p in [proc, *proc.children(recursive=True)]:
        try:
            for t in p.threads():
                allowed = os.sched_getaffinity(t.id)
                if not allowed <= cores:
                    bad.append(f"pid {p.pid} ({p.name()}) thread {t.id}: {sorted(allowed)}")
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return bad


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
def test_every_engine_thread_stays_on_its_workers_cores(stack):
    _disaggregated_request(stack, CASES[1])
    workers = _workers(stack)
    assert set(workers) == {"prefill", "decode"}, workers
    (_, pre_cores), (_, dec_cores) = workers["prefill"], workers["decode"]
    assert pre_cores.isdisjoint(dec_cores), (pre_cores, dec_cores)
    for role, (proc, cores) in workers.items():
        children = proc.children(recursive=True)
        engine_threads = sum(len(p.threads()) for p in children)
        assert engine_threads > 1, f"{role}: no engine process found under the worker"
        # One engine core process, running the model itself: no vLLM worker process
        # behind it (pdserve/cli.py's _engine_env, one tensor-parallel rank on CPU).
        titles = [name for name in (p.name() for p in children) if name.startswith("VLLM")]
        assert titles == ["VLLM::EngineCore"], f"{role}: {titles}"
        assert _threads_outside(proc, cores) == [], f"{role} threads left cores {sorted(cores)}"


def _cpu_seconds(proc: psutil.Process) -> float:
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def test_an_idle_worker_gives_its_core_back(stack):
    """vLLM's engine spins for a second after each step by default; pdserve's workers
    stop spinning within milliseconds, so a prefill worker between prompts leaves its
    core to the edge and router."""
    _disaggregated_request(stack, CASES[0])
    time.sleep(0.2)
    workers = {role: proc for role, (proc, _) in _workers(stack).items()}
    before = {role: _cpu_seconds(p) for role, p in workers.items()}
    time.sleep(1.0)
    used = {role: round(_cpu_seconds(p) - before[role], 3) for role, p in workers.items()}
    assert all(u < 0.3 for u in used.values()), f"CPU seconds in 1 s of idling: {used}"
