"""`pdserve bench placement`: what one placement decision costs the router, C against Python.

The router's own `placement.place`, as `pdserve router` runs it, on a large state:
`workers` decode workers, each holding `prefixes` cached prompt prefixes (reported
to the index as an engine's KV events would be: `PrefixIndex.stored`), each prefix
one of a few shared system prompts and then blocks of its own. Requests are chat
turns: most extend a prefix some worker holds (the session it belongs to), the rest
start fresh; each prompt is `prompt_tokens` long (5,000 of them, offered in turn: a
prompt offered again finds the keys its last placement left, as a session's next turn
does). Decisions are offered at each of `rates` per second for `seconds`; the workers
report their loads 100 times a second, as their KV-event streams do under load.

Each implementation runs in a process of its own (PDSERVE_NATIVE=require, then
=python: a module picks one when it is imported). Per rate: the decision's wall time
(p50, p99; only `place()`, the prompt's hashing included), its CPU time, and the share
of one core the router spends deciding at that rate (rate x mean CPU per decision).

    pdserve bench placement [--workers 16] [--prefixes 10000] [--rates 1000,10000] [--json]
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

# Each implementation, and the PDSERVE_NATIVE that makes a process run it.
PATHS = {"c": "require", "python": "python"}
REQUESTS = 5000                  # distinct prompts, offered in turn (each 4 bytes a token)


@dataclass(frozen=True, slots=True)
class PlacementBench:
    """The state and the load one run measures."""

    workers: int = 16                # decode workers
    prefixes: int = 10_000           # cached prompt prefixes per worker
    block: int = 16                  # the engines' block size (tokens)
    prefix_blocks: int = 8           # blocks of one cached prefix ...
    system_prompts: int = 8          # ... of which the first `system_blocks` are one of
    system_blocks: int = 4           # these shared system prompts
    prompt_tokens: int = 1024        # each request's prompt
    hit_fraction: float = 0.9        # requests that extend a held prefix (a session's turn)
    rates: tuple[float, ...] = (1000.0, 10000.0)     # decisions offered per second
    seconds: float = 5.0             # at each rate
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("workers", "prefixes", "block", "prefix_blocks", "system_prompts",
                     "seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.system_blocks < self.prefix_blocks:
            raise ValueError("system_blocks must be in 1..prefix_blocks - 1")
        if self.prompt_tokens < self.prefix_blocks * self.block:
            raise ValueError("prompt_tokens must hold a whole cached prefix "
                             f"({self.prefix_blocks * self.block} tokens)")
        if not self.rates or min(self.rates) <= 0:
            raise ValueError("rates must be > 0")


def compare(cfg: PlacementBench) -> dict:
    """Both implementations, each in its own process; the JSON the command prints."""
    runs = {}
    for path, mode in PATHS.items():
        out = subprocess.run([sys.executable, "-m", __name__, json.dumps(asdict(cfg))],
                             env={**os.environ, "PDSERVE_NATIVE": mode}, capture_output=True,
                             text=True)
        if out.returncode:
            raise RuntimeError(f"the {path} run failed (PDSERVE_NATIVE={mode}):\n{out.stderr}")
        runs[path] = json.loads(out.stdout)
    return {"config": asdict(cfg), "runs": runs}


def measure(cfg: PlacementBench) -> dict:
    """This process's implementation on `cfg`: {"native", "build_s", "keys", "rates"}."""
    from pdserve.services.router import keystore

    started = time.perf_counter()
    router, prompts = _build(cfg)
    built = time.perf_counter() - started
    gc.collect()
    _fine_timer_slack()
    return {"native": "c" if keystore.NATIVE else "python", "build_s": round(built, 2),
            "keys": sum(len(s) for s in router.index.stores.values()),
            "rates": [_offered(router, prompts, rate, cfg.seconds) for rate in cfg.rates]}


class _Router:
    """A router's placement state: registry, prefix index, policy."""

    def __init__(self, cfg: PlacementBench):
        from pdserve.v1 import common_pb2, router_pb2
        from pdserve.services.router.placement import Policy
        from pdserve.services.router.prefix_index import PrefixIndex
        from pdserve.services.router.registry import WorkerRegistry

        self.registry = WorkerRegistry(timeout=1e12)
        self.index = PrefixIndex(cfg.block)
        self.policy = Policy()
        for w in range(cfg.workers):
            self.registry.register(router_pb2.WorkerInfo(
                worker_id=f"decode-{w}", role=common_pb2.WORKER_ROLE_DECODE,
                address=f"decode-{w}", model="m", serving=True))

    def report_loads(self, rng: random.Random) -> None:
        """Each worker's engine reports its running requests (and so covers every
        placement so far), as its KV-event stream does."""
        for e in self.registry.entries():
            e.reported(rng.randrange(0, 8))


def _build(cfg: PlacementBench) -> tuple[_Router, list]:
    """The router with every worker's prefixes reported, and the requests to offer:
    (session, packed prompt) each."""
    import numpy as np

    from pdserve.services.router.keystore import packed

    rng, draw = random.Random(cfg.seed), np.random.default_rng(cfg.seed)
    router = _Router(cfg)
    router.report_loads(rng)
    vocab = 32_000
    system = draw.integers(0, vocab, (cfg.system_prompts, cfg.system_blocks * cfg.block)).tolist()
    own = (cfg.prefix_blocks - cfg.system_blocks) * cfg.block
    held = []                                     # (worker, its prefix's tokens)
    engine_hash = 0
    for w in range(cfg.workers):
        worker = f"decode-{w}"
        for tail in draw.integers(0, vocab, (cfg.prefixes, own)).tolist():
            tokens = rng.choice(system) + tail
            blocks = []
            for b in range(cfg.prefix_blocks):
                engine_hash += 1
                blocks.append((engine_hash, tokens[b * cfg.block:(b + 1) * cfg.block]))
            router.index.stored(worker, None, blocks)
            held.append((worker, tokens))
    requests = []
    for i in range(REQUESTS):
        if rng.random() < cfg.hit_fraction:
            j = rng.randrange(len(held))
            session, head = f"s{j}", held[j][1]
        else:
            session, head = f"new{i}", rng.choice(system)
        prompt = head + draw.integers(0, vocab, cfg.prompt_tokens - len(head)).tolist()
        requests.append((session, packed(prompt)))
    return router, requests


def _offered(router: _Router, requests: list, rate: float, seconds: float) -> dict:
    """`place()` at `rate` decisions/s for `seconds`: wall and CPU time per decision."""
    from pdserve.v1 import router_pb2
    from pdserve.services.router.placement import place

    rng = random.Random(1)
    n = max(1, int(rate * seconds))
    report_every = max(1, int(rate / 100))
    wall, cpu = [], []
    start = time.perf_counter()
    for i in range(n):
        pause = start + i / rate - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        if i % report_every == 0:
            router.report_loads(rng)
        session, prompt = requests[i % len(requests)]
        req = router_pb2.RouteRequest(model="m", session_id=session,
                                      prompt_token_ids_packed=prompt)
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        _, decode, _ = place(router.registry, req, router.policy, router.index)
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        router.registry.placed(decode)
        wall.append(t1 - t0)
        cpu.append(c1 - c0)
    elapsed = time.perf_counter() - start
    wall.sort()
    cpu_us = statistics.fmean(cpu) / 1000
    return {"rate": rate, "decisions": n, "achieved_rate": round(n / elapsed, 1),
            "p50_us": round(wall[len(wall) // 2] / 1000, 1),
            "p99_us": round(wall[int(0.99 * (len(wall) - 1))] / 1000, 1),
            "cpu_us_mean": round(cpu_us, 1),
            "core_share": round(rate * cpu_us / 1e6, 4)}


def _fine_timer_slack() -> None:
    """Timer slack 1 us for this thread (Linux's default, 50 us, would stretch every
    pause between decisions offered 100 us apart by half of one)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)   # PR_SET_TIMERSLACK, ns
    except (OSError, AttributeError):
        pass                                      # not Linux: pauses run a little long


def table(result: dict) -> str:
    """The runs side by side, as text."""
    cfg = result["config"]
    lines = [f"placement decision: {cfg['workers']} decode workers, {cfg['prefixes']:,} cached "
             f"prefixes each ({cfg['prefix_blocks']} blocks of {cfg['block']} tokens), prompts "
             f"of {cfg['prompt_tokens']} tokens, {cfg['seconds']:g} s per rate",
             f"{'path':<8}{'offered/s':>10}{'achieved/s':>12}{'p50 us':>9}{'p99 us':>9}"
             f"{'cpu us':>9}{'core share':>12}"]
    for rate_i in range(len(cfg["rates"])):
        for path, run in result["runs"].items():
            r = run["rates"][rate_i]
            lines.append(f"{path:<8}{r['rate']:>10,.0f}{r['achieved_rate']:>12,.0f}"
                         f"{r['p50_us']:>9}{r['p99_us']:>9}{r['cpu_us_mean']:>9}"
                         f"{r['core_share']:>11.1%}")
    for path, run in result["runs"].items():
        lines.append(f"{path}: {run['keys']:,} keys held, state built in {run['build_s']} s "
                     f"(ran {run['native']})")
    return "\n".join(lines)


if __name__ == "__main__":
    given = json.loads(sys.argv[1])
    print(json.dumps(measure(PlacementBench(**{**given, "rates": tuple(given["rates"])}))))
