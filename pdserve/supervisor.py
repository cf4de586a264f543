"""`pdserve up`: the whole stack as child processes on one machine.

Starts the router (--routers R: R replicas, each holding the whole pool), N
prefill and M decode workers (each engine on its own cores or GPUs, or sharing
them when there are more engines than units) and the edge; prints one line when the edge reports healthy. Any child that dies,
before or after that, is restarted after a backoff (0.5 s, doubling to 10 s;
0.5 s again once it has stayed up a minute) while the others are watched on:
a pool serves on without one worker, and the edge and the workers reconnect to
a restarted router. Only a crash loop (a child dying more than 5 times in 5
minutes) stops the stack, with a line saying which child and how often; so
does Ctrl-C/SIGTERM, which stops every process it started. Each child runs in
its own session so that its engine subprocesses go with it.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path

from pdserve.cluster_token import write_token
from pdserve.flags import EDGE_FLAGS, ENGINE_FLAGS, PLACEMENT_FLAGS
from pdserve.config import EngineConfig
from pdserve.launch import Child, healthy, stop_all
from pdserve.netaddr import dialable, hostport, loopback

_READY_TIMEOUT_S = 600
# A child stopping gets its drain (--drain-seconds, the edge's and every worker's)
# and this much more: a server's grace, an engine's shutdown.
_STOP_MARGIN_S = 10
_TICK_S = 0.25                 # how often the children are looked at

RESTART_LIMIT = 5              # more deaths than this of one child...
RESTART_WINDOW_S = 300.0       # ...within this long are a crash loop: the stack stops
BACKOFF_FIRST_S = 0.5          # a dead child's first wait to come back,
BACKOFF_CAP_S = 10.0           # doubling with each death up to this
HEALTHY_AFTER_S = 60.0         # a child up this long starts its backoff afresh


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
    return (["--model", eng.model, "--served-model-name", eng.name, "--device", eng.device,
             "--dtype", eng.dtype, "--max-model-len", str(eng.max_model_len),
             "--kv-cache-gb", str(a.kv_cache_gb),
             "--gpu-memory-utilization", str(eng.gpu_memory_utilization),
             "--tensor-parallel-size", str(eng.tensor_parallel_size),
             "--max-num-seqs", str(eng.max_num_seqs), "--seed", str(eng.seed)]
            + [arg for name in ENGINE_FLAGS for arg in _passed_on(name, getattr(eng, name))])


def _commands(a: argparse.Namespace, eng: EngineConfig,
              token_file: str = "") -> list[tuple[str, list[str], dict]]:
    """Router, every worker, edge. Worker k (prefill first, then decode) gets NIXL
    side-channel port --kv-port + k and metrics port --worker-metrics-port + k.
    `token_file`: the cluster token the router checks and the workers show."""
    me = [sys.executable, "-m", "pdserve.cli", "--log-level", a.log_level,
          "--log-format", a.log_format]
    # Only the edge listens where --host says; the rest stay on loopback, of --host's
    # family so that an IPv6-only stack (--host ::1) needs no IPv4.
    inside = loopback(a.host)
    # --router-in-edge: no router process; the edge serves the router's port itself.
    # Replicas: every worker registers with each, the edge dials them as one list.
    routers = [hostport(inside, a.router_port + i) for i in range(a.routers)]
    router = ",".join(routers)
    units = _placement(a, eng)
    token = ["--cluster-token-file", token_file] if token_file else []
    workers = []
    for role, first_port in (("prefill", a.prefill_port), ("decode", a.decode_port)):
        for i, unit in enumerate(units[role]):
            k = len(workers)
            env = {"CUDA_VISIBLE_DEVICES": unit} if eng.device == "cuda" else {}
            pin = [] if eng.device == "cuda" else ["--cpus", unit]
            metrics = (["--metrics-port", str(a.worker_metrics_port + k)]
                       if a.worker_metrics_port else [])
            workers.append((f"{role}-{i}", me + [
                role, "--host", inside, "--port", str(first_port + i), "--router", router,
                "--kv-port", str(a.kv_port + k), "--kv-lease-seconds", str(a.kv_lease_seconds),
                "--kv-transfer-mode", a.kv_transfer_mode,
                "--worker-id", f"{role}-{i}", "--drain-seconds", str(a.drain_seconds)]
                + token + pin + metrics
                + _engine_flags(a, eng), env))
    placement, streams = ([arg for name in names for arg in _passed_on(name, getattr(a, name))]
                          for names in (PLACEMENT_FLAGS, EDGE_FLAGS))
    # The gateway runs anywhere unless told: on the 2-core dev box, pinning it
    # to the prefill core measured a worse TTFT (its per-token wake-ups then
    # delay every prefill; docs/design/2026-11-30-gateway-unpinned.md).
    gateway_pin = ["--cpus", a.gateway_cpus] if a.gateway_cpus else []
    edge = ("edge", me + ["edge", "--host", a.host, "--port", str(a.port),
                          "--grpc-port", str(a.grpc_port),
                          "--metrics-port", str(a.edge_metrics_port),
                          *(["--router", "embedded", "--router-host", inside,
                             "--router-port", str(a.router_port)]
                            if a.router_in_edge else ["--router", router]),
                          "--model", eng.model, "--served-model-name", eng.name,
                          "--max-model-len", str(eng.max_model_len),
                          "--min-prefill-workers", str(a.prefill_workers),
                          "--min-decode-workers", str(a.decode_workers)] + streams
            + (placement + token if a.router_in_edge else []) + gateway_pin, {})
    if a.router_in_edge:
        return [*workers, edge]
    return [*_routers(a, me, inside, gateway_pin + placement + token), *workers, edge]


def _routers(a: argparse.Namespace, me: list[str], inside: str,
             flags: list[str]) -> list[tuple[str, list[str], dict]]:
    """`router` (one), or `router-0`... (replicas on ports, and metrics ports, counting up)."""
    out = []
    for i in range(a.routers):
        metrics = (["--metrics-port", str(a.router_metrics_port + i)]
                   if a.router_metrics_port else [])
        name = "router" if a.routers == 1 else f"router-{i}"
        out.append((name, me + ["router", "--host", inside, "--port", str(a.router_port + i)]
                    + flags + metrics, {}))
    return out


def _stop(children: dict[str, Child], grace: float) -> None:
    """Stop in reverse start order, one tier at a time: the edge drains its streams
    while the workers still serve them, then the workers, then the router.
    SIGTERM goes to each child alone, not its session: a worker drains its calls,
    then stops its own engine (an engine process signalled with it would die
    mid-stream). Whatever is left of a child's session after that is SIGKILLed."""
    tiers = [("edge",), ("prefill-", "decode-"), ("router",)]
    for tier in tiers:
        members = [c for n, c in children.items() if n.startswith(tier)]
        for late in stop_all(members, grace, sweep=True):
            print(f"pdserve: {late}; killed", file=sys.stderr)


class RestartPolicy:
    """When a dead child comes back: after BACKOFF_FIRST_S, doubling with each
    death up to BACKOFF_CAP_S, and after BACKOFF_FIRST_S again once it had stayed
    up HEALTHY_AFTER_S; never once it has died more than `limit` times in `window`
    seconds: a crash loop (bad flags, no memory, a port someone else holds) that
    no waiting cures. Times are passed in, so that the policy is testable."""

    def __init__(self, limit: int = RESTART_LIMIT, window: float = RESTART_WINDOW_S):
        self.limit, self.window = limit, window
        self.deaths: dict[str, list[float]] = {}      # per child, those within the window
        self.backoff: dict[str, float] = {}           # per child, its next wait
        self.up_since: dict[str, float] = {}

    def started(self, name: str, now: float) -> None:
        """Called each time `name` is started."""
        self.up_since[name] = now

    def died(self, name: str, now: float) -> float | None:
        """Called when `name` is found dead: seconds to wait before starting it
        again, or None when it is crash-looping."""
        self.deaths[name] = [t for t in self.deaths.get(name, [])
                             if now - t < self.window] + [now]
        if len(self.deaths[name]) > self.limit:
            return None
        if now - self.up_since.get(name, now) >= HEALTHY_AFTER_S:
            self.backoff.pop(name, None)
        wait = self.backoff.get(name, BACKOFF_FIRST_S)
        self.backoff[name] = min(2 * wait, BACKOFF_CAP_S)
        return wait


class CrashLoop(Exception):
    """A child died more often than RestartPolicy allows; the message says which."""


def _clean_up_after(child: Child) -> None:
    """What a dead child leaves: the rest of its session (a worker's engine
    processes), and the socket file a worker's engine published KV events on."""
    from pdserve.services.worker.engine import kv_events_path
    child.kill_session()
    Path(kv_events_path(child.pid)).unlink(missing_ok=True)


class Children:
    """The stack's processes by name: started, watched, restarted when they die."""

    def __init__(self, commands: dict[str, tuple[list[str], dict]],
                 policy: RestartPolicy | None = None):
        self.commands = commands                  # name -> (argv, extra environment)
        self.policy = policy or RestartPolicy()
        self.procs: dict[str, Child] = {}
        self.due: dict[str, float] = {}           # dead children: when each starts again

    def start(self, name: str, now: float) -> None:
        cmd, env = self.commands[name]
        self.procs[name] = Child(cmd, env, name=name)
        self.policy.started(name, now)

    def watch(self, now: float) -> None:
        """One look at every child, never waiting: a newly dead one is cleaned up
        after and given a time to come back; those whose time has come are started.
        Raises CrashLoop for a child the policy gives up on."""
        for name, proc in self.procs.items():
            if name in self.due or proc.running():
                continue
            _clean_up_after(proc)
            wait = self.policy.died(name, now)
            if wait is None:
                raise CrashLoop(
                    f"pdserve: {name} exited (code {proc.popen.returncode}), its "
                    f"{len(self.policy.deaths[name])} deaths in {self.policy.window:g} s are "
                    f"a crash loop; stopping the stack")
            # A pool carries on without one worker (the router stops offering it);
            # a child comes back on the same ports, and a worker registers again.
            print(f"pdserve: {name} exited (code {proc.popen.returncode}); restarting it in "
                  f"{wait:g} s", file=sys.stderr, flush=True)
            self.due[name] = now + wait
        for name in [n for n, at in self.due.items() if at <= now]:
            del self.due[name]
            self.start(name, now)


def _salt_secret(a: argparse.Namespace, directory: str) -> None:
    """With keys and no salt secret: a fresh one for this stack's edge, in a file only
    this user reads under `directory` (gone with the stack), as `a.tenant_salt_file`."""
    if not a.api_keys_file or a.tenant_salt_file:
        return
    path = Path(directory) / "tenant-salt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    a.tenant_salt_file = str(path)


def run_stack(a: argparse.Namespace, eng: EngineConfig) -> int:
    """Run until signalled (0) or a child crash-loops (1)."""
    if not a.model:
        from pdserve.tiny_model import ensure_tiny_model
        ensure_tiny_model(Path(eng.model))
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    # A fresh cluster token for this stack's own processes, in a file only this user
    # reads; gone with the stack.
    secrets_dir = tempfile.TemporaryDirectory(prefix="pdserve-up-")
    token_file = write_token(secrets_dir.name)
    _salt_secret(a, secrets_dir.name)
    children = Children({name: (cmd, env) for name, cmd, env
                         in _commands(a, eng, token_file)})
    health = f"http://{hostport(dialable(a.host), a.port)}/health"
    try:
        for name in children.commands:
            children.start(name, time.monotonic())
        ready_by = time.monotonic() + _READY_TIMEOUT_S
        ready = False
        while not stopping:
            children.watch(time.monotonic())
            if not ready and healthy(health):
                ready = True
                where = hostport(loopback(a.host), a.router_port) + (
                    " in the edge" if a.router_in_edge else
                    f" and {a.routers - 1} more counting up" if a.routers > 1 else "")
                print(f"pdserve ready: http://{hostport(a.host, a.port)} (router {where},"
                      f" {a.prefill_workers} prefill from :{a.prefill_port}, {a.decode_workers}"
                      f" decode from :{a.decode_port}, model {eng.name})", flush=True)
            if not ready and time.monotonic() > ready_by:
                print(f"pdserve: not healthy after {_READY_TIMEOUT_S}s; stopping", file=sys.stderr)
                return 1
            time.sleep(_TICK_S)
        return 0
    except CrashLoop as e:
        print(e, file=sys.stderr, flush=True)
        return 1
    finally:
        _stop(children.procs, a.drain_seconds + _STOP_MARGIN_S)
        secrets_dir.cleanup()
        print(f"pdserve: stopped {len(children.procs)} processes", file=sys.stderr, flush=True)
