"""`pdserve bench router`: the real placement code replayed on a synthetic chat trace.

No engines: each simulated decode worker keeps an LRU cache of KV blocks
(capacity in blocks) and serves a request for `uncached prompt tokens x
prefill time + output tokens x decode time`, concurrently with the others it
holds (continuous batching). The trace has sessions of several turns (each turn's
prompt is the whole history), a few shared system prompts with skewed
popularity, bursts of arrivals, and twice a worker leaving (at 25% and 60% of
the run) and a fresh one joining 10% later.

Policies: `pdserve` is `pdserve.services.router.placement.place` itself, fed what the
router gets live: the workers' stored/evicted block events, and their loads as
they push them (services/worker/load_push.py: a record with every KV-event batch
and the moment a request ends, so the router's view is current at each decision,
the network's milliseconds aside). The baselines: `round_robin`, `least_loaded`
(true current load), `consistent_hash` (rendezvous on the session, no load bound) and `oracle`
(true cache contents and loads: the longest actual prefix among workers within
the same load bound).

Figures per policy: `hit_rate` (prompt tokens served from cache / all prompt
tokens), `max_over_mean_load` (the worst 10 s window's busiest worker over the
mean, in request-seconds, among windows where the mean worker was busy with >= 1
request and no worker left or joined; `max_over_mean_load_steady` the same over the
windows that end before the last session begins, the trace's wind-down left out),
`moved_fraction_on_leave` (sessions active when a worker left whose next turn
went to another worker than their previous one, over all such sessions; w0 leaves,
then w1), `moved_fraction_mean_over_leavers` and `moved_fraction_worst_leaver` (the
same over each choice of the worker that leaves first),
`moved_off_kv_fraction_on_leave` (of those moves, the ones off KV the session still
had: its worker left, or held more of its prompt than the one it went to),
`min_worker_share` (over those same windows, the least-used worker's requests per
window over the mean worker's).
"""
from __future__ import annotations

import gc
import hashlib
import heapq
import itertools
import os
import random
import statistics
import struct
import time
from collections import OrderedDict, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from pdserve.cache_salt import plan, shared
from pdserve.config import RouterConfig
from pdserve.v1 import common_pb2, router_pb2
from pdserve.services.router.keystore import packed, salt_points, salted_block_keys
from pdserve.services.router.placement import Policy, load_cap, place
from pdserve.services.router.prefix_index import PrefixIndex
from pdserve.services.router.registry import WorkerRegistry

DECODE = common_pb2.WORKER_ROLE_DECODE


@dataclass(frozen=True, slots=True)
class SimConfig:
    workers: int = 4
    sessions: int = 2400
    seed: int = 0
    block_size: int = 16
    cache_blocks: int = 4000             # per worker
    system_prompts: int = 4
    system_tokens: int = 512
    session_rate: float = 8.0            # new sessions per second (doubled in bursts)
    prefill_s_per_token: float = 0.0002
    decode_s_per_token: float = 0.02
    balance: float = 1.25
    balance_slack: int = RouterConfig().balance_slack
    leaver: int = 0                      # the first worker to leave (the next one, second)
    # Tenants (> 1: each session one tenant's, tenant t in group t % system_prompts, whose
    # system prompt all its sessions open with) and their cache salts: "none" (one cache
    # for all), "tenant" (a salt each) or "shared" (a salt each after the group's
    # system prompt, which the group shares: pdserve/cache_salt.py).
    tenants: int = 1
    isolation: str = "none"


@dataclass(slots=True)
class Turn:
    at: float
    session: int
    prompt: list[int]
    out: list[int]
    tenant: int = 0
    salt: str = ""                      # its cache salt, as the edge would send it


def tenant_salt(cfg: SimConfig, tenant: int) -> str:
    """Tenant `tenant`'s cache salt under `cfg.isolation`."""
    if cfg.isolation == "none":
        return ""
    own = f"tenant-{tenant}"
    if cfg.isolation == "tenant":
        return own
    return shared(cfg.system_tokens, f"group-{tenant % cfg.system_prompts}", own)


def make_trace(cfg: SimConfig) -> list[Turn]:
    """Sessions of 2-6 turns; turn k's prompt = system + all earlier turns + new message."""
    rng = random.Random(cfg.seed)
    systems = [[rng.randrange(10, 30000) for _ in range(cfg.system_tokens)]
               for _ in range(cfg.system_prompts)]
    popularity = [1 / (i + 1) for i in range(cfg.system_prompts)]      # Zipf: one dominates
    turns, t = [], 0.0
    for s in range(cfg.sessions):
        burst = int(t / 20) % 3 == 2                                      # every third 20 s
        t += rng.expovariate(cfg.session_rate * (2 if burst else 1))
        tenant = rng.randrange(cfg.tenants) if cfg.tenants > 1 else 0
        history = list(systems[tenant % cfg.system_prompts] if cfg.tenants > 1
                       else rng.choices(systems, popularity)[0])
        at, salt = t, tenant_salt(cfg, tenant)
        for _ in range(rng.randint(2, 6)):
            history += [rng.randrange(10, 30000) for _ in range(rng.randint(20, 200))]
            out = [rng.randrange(10, 30000) for _ in range(rng.randint(20, 150))]
            turns.append(Turn(at, s, list(history), out, tenant, salt))
            history += out
            at += len(out) * cfg.decode_s_per_token + rng.expovariate(1 / 3.0)
    return sorted(turns, key=lambda x: x.at)


@dataclass
class SimWorker:
    """One decode engine: an LRU block cache and the requests it is running."""

    name: str
    capacity: int
    cache: OrderedDict = field(default_factory=OrderedDict)   # key -> engine hash
    ends: list = field(default_factory=list)                  # heap of finish times

    def load(self, now: float) -> int:
        while self.ends and self.ends[0] <= now:
            heapq.heappop(self.ends)
        return len(self.ends)

    def hit_blocks(self, keys: list[int]) -> int:
        n = 0
        for k in keys:
            if k not in self.cache:
                break
            n += 1
        return n

    def serve(self, now: float, keys: list[int], duration: float, events) -> None:
        """Run a request whose blocks (prompt + output) are `keys`; report KV events."""
        stored, parent = [], None
        for k in keys:
            if k in self.cache:
                self.cache.move_to_end(k)
                parent = self.cache[k]
                continue
            self.cache[k] = k                                     # the engine's hash: any id
            stored.append(k)
        evicted = []
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        events(self.name, parent, stored, evicted)
        heapq.heappush(self.ends, now + duration)


def _score(session: int, worker: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session}/{worker}".encode(),
                                          digest_size=8).digest(), "big")


class Pdserve:
    """The router's own placement, over a registry and index kept as the router keeps them."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.registry = WorkerRegistry(timeout=1e12, clock=lambda: 0.0)
        self.index = PrefixIndex(cfg.block_size)
        self.policy = Policy(balance=cfg.balance, balance_slack=cfg.balance_slack,
                             local_below_tokens=0)
        # key -> its block's tokens and the salt the engine folded into it ("" none)
        self.tokens: dict[int, tuple[list[int], str]] = {}
        self.decision_s: list[float] = []

    def join(self, w: SimWorker) -> None:
        self.registry.register(router_pb2.WorkerInfo(worker_id=w.name, role=DECODE,
                                                     address=w.name, model="m", serving=True))

    def leave(self, w: SimWorker) -> None:
        self.registry.deregister(w.name)
        self.index.forget(w.name)

    def events(self, worker: str, parent, stored: list[int], evicted: list[int]) -> None:
        if stored:
            self.index.stored(worker, parent, [(k, *self.tokens[k]) for k in stored])
        self.index.removed(worker, evicted)

    def choose(self, turn: Turn, workers: dict[str, SimWorker], now: float) -> str:
        for e in self.registry.serving(DECODE):     # the records the workers pushed by now
            e.reported(workers[e.info.worker_id].load(now))
        req = router_pb2.RouteRequest(model="m", session_id=str(turn.session),
                                      prompt_token_ids_packed=packed(turn.prompt),
                                      cache_salt=turn.salt)
        started = time.perf_counter()
        _, decode, _ = place(self.registry, req, self.policy, self.index)
        self.decision_s.append(time.perf_counter() - started)
        self.registry.placed(decode)
        return decode.info.worker_id


def _baselines(cfg: SimConfig):
    rr = itertools.count()

    def round_robin(turn, keys, workers, now):
        names = sorted(workers)
        return names[next(rr) % len(names)]

    def least_loaded(turn, keys, workers, now):
        return min(sorted(workers), key=lambda n: workers[n].load(now))

    def consistent_hash(turn, keys, workers, now):
        return max(workers, key=lambda n: _score(turn.session, n))

    def oracle(turn, keys, workers, now):
        loads = {n: w.load(now) for n, w in workers.items()}
        cap = load_cap(sum(loads.values()), len(loads), cfg.balance, cfg.balance_slack)
        under = [n for n in sorted(workers) if loads[n] + 1 <= cap] or sorted(workers)
        return max(under, key=lambda n: (workers[n].hit_blocks(keys), -loads[n]))

    return {"round_robin": round_robin, "least_loaded": least_loaded,
            "consistent_hash": consistent_hash, "oracle": oracle}


def _schedule(cfg: SimConfig, end: float) -> list[tuple[float, str, str]]:
    """(time, "leave"|"join", worker): two workers leave (w<leaver>, then the next), a
    fresh one joins after each."""
    out = []
    for i, (leave, join) in enumerate(((0.25, 0.35), (0.6, 0.7))):
        out += [(leave * end, "leave", f"w{(cfg.leaver + i) % cfg.workers}"),
                (join * end, "join", f"j{i}")]
    return out


def simulate(cfg: SimConfig, trace: list[Turn], policy: str) -> tuple[dict, Pdserve | None]:
    """Replay `trace` under `policy`; the figures of the module docstring."""
    workers = {f"w{i}": SimWorker(f"w{i}", cfg.cache_blocks) for i in range(cfg.workers)}
    router = Pdserve(cfg) if policy == "pdserve" else None
    baseline = None if router else _baselines(cfg)[policy]
    events = _schedule(cfg, trace[-1].at)
    for w in workers.values():
        if router:
            router.join(w)
    hit = total = moved = moved_off_kv = crossed = 0
    by_tenant: dict[int, list[int]] = defaultdict(lambda: [0, 0])    # tenant -> hit, total
    last: dict[int, str] = {}                   # session -> worker of its latest turn
    crossing: dict[int, str] = {}               # sessions active when a worker left
    share: dict[tuple[int, str], int] = defaultdict(int)     # (window, worker) -> requests
    busy: dict[int, dict[str, float]] = defaultdict(dict)        # 10 s window -> worker -> s
    for turn in trace:
        now = turn.at
        while events and events[0][0] <= now:
            _membership(events.pop(0), cfg, workers, router, last, crossing, busy)
        tokens = turn.prompt + turn.out
        points = salt_points(turn.salt, cfg.block_size)
        keys = salted_block_keys(turn.prompt, cfg.block_size, *points)
        all_keys = salted_block_keys(tokens, cfg.block_size, *points)
        name = (_pdserve_choice(cfg, router, turn, tokens, all_keys, workers, now) if router
                else baseline(turn, keys, workers, now))
        w = workers[name]
        held = w.hit_blocks(keys)
        cached = min(len(turn.prompt), held * cfg.block_size)
        hit, total = hit + cached, total + len(turn.prompt)
        by_tenant[turn.tenant][0] += cached
        by_tenant[turn.tenant][1] += len(turn.prompt)
        duration = ((len(turn.prompt) - cached) * cfg.prefill_s_per_token
                    + len(turn.out) * cfg.decode_s_per_token)
        w.serve(now, all_keys, duration, router.events if router else lambda *a: None)
        share[(int(now // 10), name)] += 1
        _count_busy(busy, workers, name, now, duration)
        if turn.session in crossing:            # its first turn after a worker left
            crossed += 1
            before = crossing.pop(turn.session)
            moved += name != before
            # ...off the KV it had: its worker left, or still held more of its prompt
            # (not a session whose blocks its worker had evicted meanwhile)
            moved_off_kv += name != before and (
                before not in workers or workers[before].hit_blocks(keys) > held)
        last[turn.session] = name
    return {"hit_rate": round(hit / total, 4),
            "max_over_mean_load": round(_max_over_mean(busy), 3),
            "max_over_mean_load_steady": round(_max_over_mean(busy, _last_start(trace)), 3),
            "moved_fraction_on_leave": round(moved / max(1, crossed), 4),
            "moved_off_kv_fraction_on_leave": round(moved_off_kv / max(1, crossed), 4),
            "min_worker_share": round(_min_share(share, busy), 3),
            **({"hit_rate_by_tenant": {t: round(h / n, 4) for t, (h, n) in
                                       sorted(by_tenant.items())}} if cfg.tenants > 1 else {})
            }, router


def _pdserve_choice(cfg: SimConfig, router: Pdserve, turn: Turn, tokens: list[int],
                    all_keys: list[int], workers: dict, now: float) -> str:
    """pdserve's router places `turn`, knowing each block's tokens and salt (as the
    workers' KV events would tell it)."""
    salted = dict(plan(turn.salt).folds(cfg.block_size))
    for i, k in enumerate(all_keys):
        router.tokens[k] = (tokens[i * cfg.block_size:(i + 1) * cfg.block_size],
                            salted.get(i, ""))
    return router.choose(turn, workers, now)


def _membership(event: tuple, cfg: SimConfig, workers: dict, router, last: dict,
                crossing: dict, busy: dict) -> None:
    """A worker joins or leaves: the sessions active then are marked as crossing it, and
    the 10 s windows around it leave the load figures."""
    at, kind, name = event
    if kind == "leave":
        crossing.update({s: w for s, w in last.items() if s not in crossing})
        if router:
            router.leave(workers[name])
        del workers[name]
    else:
        workers[name] = SimWorker(name, cfg.cache_blocks)
        if router:
            router.join(workers[name])
    for window in (int(at // 10), int(at // 10) + 1):     # a leaver's last requests
        busy[window]["changed"] = 0.0


def _count_busy(busy: dict, workers: dict, name: str, now: float, duration: float) -> None:
    """Add `name`'s `duration` from `now` on to the busy seconds of each 10 s window."""
    for window in range(int(now // 10), int((now + duration) // 10) + 1):
        lo, hi = max(now, window * 10), min(now + duration, (window + 1) * 10)
        seconds = busy[window]
        for n in workers:
            seconds.setdefault(n, 0.0)
        seconds[name] += max(0.0, hi - lo)


def _last_start(trace: list[Turn]) -> float:
    """When the last session began: after it the trace only winds down (the open
    sessions' later turns, ever fewer), to one or two requests per worker."""
    last = max(t.session for t in trace)
    return min(t.at for t in trace if t.session == last)


def _max_over_mean(busy: dict[int, dict[str, float]], until: float | None = None) -> float:
    """The worst window's busiest worker over the mean (windows with mean >= 1 request
    and no worker leaving or joining; with `until`, only windows that end by then)."""
    worst = 1.0
    for window, seconds in busy.items():
        if "changed" in seconds or (until is not None and (window + 1) * 10 > until):
            continue
        loads = [v / 10 for v in seconds.values()]
        mean = sum(loads) / len(loads)
        if mean >= 1:
            worst = max(worst, max(loads) / mean)
    return worst


def _min_share(share: dict, busy: dict[int, dict[str, float]]) -> float:
    """Over busy windows where no worker left or joined: each worker's requests over
    the window's mean, averaged per worker; the least of those."""
    relative: dict[str, list[float]] = defaultdict(list)
    for window, seconds in busy.items():
        if "changed" not in seconds and sum(seconds.values()) / len(seconds) >= 10:
            mean = sum(share[(window, n)] for n in seconds) / len(seconds)
            for name in seconds:
                relative[name].append(share[(window, name)] / mean)
    return min(sum(r) / len(r) for r in relative.values())


def decision_latency_us(trace: list[Turn], router: Pdserve, rate: float | None = 1000,
                        n: int = 2000) -> float:
    """p99 of one `place()` call (hashing the prompt included) at `rate` decisions/s
    (None: back to back), on the router state the simulation left."""
    router.tokens.clear()                  # the simulation's bookkeeping, not router state
    gc.collect()
    samples = []
    start = time.perf_counter()
    for i, turn in enumerate(itertools.islice(itertools.cycle(trace), n)):
        pause = start + i / rate - time.perf_counter() if rate else 0
        if pause > 0:
            time.sleep(pause)
        req = router_pb2.RouteRequest(model="m", session_id=str(turn.session),
                                      prompt_token_ids_packed=packed(turn.prompt))
        t0 = time.perf_counter()
        place(router.registry, req, router.policy, router.index)
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return 1e6 * samples[int(0.99 * (len(samples) - 1))]


@contextmanager
def cpus_kept_awake():
    """While open, ask the kernel's PM QoS for no CPU wake-up latency
    (`/dev/cpu_dma_latency` = 0, what tuned's latency-performance profile sets): the
    idle CPUs then poll instead of halting. On this VM a halted vCPU comes back
    several times slower for the next ~100 us (a lookup loop read 12.8 us after a
    1 ms sleep against 2.7 back to back, and 3.8 with this held), which a decision
    paced at 1,000/s meets every time. Yields whether it holds (it needs root)."""
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    except OSError:
        yield False
        return
    try:
        os.write(fd, struct.pack("i", 0))
        yield True
    finally:
        os.close(fd)


POLICIES = ("pdserve", "round_robin", "least_loaded", "consistent_hash", "oracle")


def run_all(cfg: SimConfig, seeds: int = 1) -> dict:
    """Every policy on one trace; the JSON `pdserve bench router` prints. With `seeds` >
    1, the same on the traces of seeds cfg.seed + 1 ... too: `over_seeds` holds each
    figure's min / median / max per policy, and per target the seeds that met it."""
    trace = make_trace(cfg)
    out, router = {}, None
    for name in POLICIES:
        out[name], r = _with_every_leaver(cfg, trace, name)
        router = router or r
    p99 = decision_latency_us(trace, router)
    with cpus_kept_awake() as awake:
        p99_awake = decision_latency_us(trace, router) if awake else None
    result = {"n_workers": cfg.workers, "requests": len(trace), "sessions": cfg.sessions,
              "decision_p99_us": round(p99, 1),
              "decision_p99_us_back_to_back": round(decision_latency_us(trace, router, None), 1),
              # The same paced run with the CPUs kept out of halt (None: not permitted).
              "decision_p99_us_cpus_awake": p99_awake and round(p99_awake, 1),
              "policies": out,
              "targets": {**_targets(cfg, out), "decision_p99_le_100us": p99 <= 100}}
    if seeds > 1:
        runs = [out] + [{name: _with_every_leaver(c, trace_i, name)[0] for name in POLICIES}
                        for c, trace_i in _traces(cfg, seeds)]
        result["over_seeds"] = {
            "seeds": list(range(cfg.seed, cfg.seed + seeds)),
            "policies": {name: {k: _spread([run[name][k] for run in runs]) for k in out[name]
                                if k != "hit_rate_by_tenant"} for name in POLICIES},
            "targets_met_by_seed": {k: [_targets(cfg, run)[k] for run in runs]
                                    for k in result["targets"] if k != "decision_p99_le_100us"}}
    return result


def _with_every_leaver(cfg: SimConfig, trace: list[Turn], policy: str
                       ) -> tuple[dict, Pdserve | None]:
    """`simulate`'s figures, plus the moved fraction over every choice of the worker
    that leaves first (one replay each): one leave moves the sessions that happen to be
    on that worker, ~1/N of them give or take a few points on this trace; the mean
    over the N choices is the expected fraction, and the worst shows the spread."""
    out, router = simulate(cfg, trace, policy)
    moved = [out["moved_fraction_on_leave"]] + [
        simulate(replace(cfg, leaver=(cfg.leaver + i) % cfg.workers), trace, policy)[0][
            "moved_fraction_on_leave"] for i in range(1, cfg.workers)]
    out["moved_fraction_mean_over_leavers"] = round(statistics.mean(moved), 4)
    out["moved_fraction_worst_leaver"] = max(moved)
    return out, router


def _traces(cfg: SimConfig, seeds: int):
    """The configs and traces of the seeds after cfg.seed."""
    for i in range(1, seeds):
        c = replace(cfg, seed=cfg.seed + i)
        yield c, make_trace(c)


def _spread(values: list[float]) -> list[float]:
    return [min(values), statistics.median(values), max(values)]


def _targets(cfg: SimConfig, out: dict) -> dict:
    p, o = out["pdserve"], out["oracle"]
    return {"hit_rate_ge_95pct_oracle": p["hit_rate"] >= 0.95 * o["hit_rate"],
            "max_over_mean_le_1.25": p["max_over_mean_load"] <= 1.25,
            "max_over_mean_steady_le_1.25": p["max_over_mean_load_steady"] <= 1.25,
            "moved_le_1.1_over_n": p["moved_fraction_on_leave"] <= 1.1 / cfg.workers,
            "moved_mean_over_leavers_le_1.1_over_n":
                p["moved_fraction_mean_over_leavers"] <= 1.1 / cfg.workers}
