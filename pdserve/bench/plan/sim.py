"""Discrete-event simulation of one deployment serving a workload at a rate.

Requests arrive as the benchmark sends them (`demand.arrival_times`; a session's next
turn when its previous answer is in). Colocated engines are stock vLLM servers the
client round-robins over (as `pdserve bench compare` does) or, behind pdserve's edge,
decode workers the router picks by cache, then load. Disaggregated: the router sends a
prompt to the least-loaded prefill engine, which streams the first token (pdserve's
`--first-token prefill`) and hands the KV over (`profile.transfer_ms`); the decode
engine picks the request up a step later and decodes the rest. Conditional: the
router's rules (services/router/placement.py) prefill on the decode engine when the
uncached part is under `local_prefill_below`, the decode engine holds
`local_cached_fraction` of the prompt, or every prefill engine has `prefill_saturated`
requests in flight.

Each request yields its TTFT and its longest gap between streamed tokens, so goodput
is `slo.py`'s: requests meeting both limits per second of the run (first send to last
answer).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from statistics import mean

import numpy as np

from .demand import Demand, Turn, arrival_times
from .engine import EngineModel, Job, Speed, StepResult
from .profile import Profile


@dataclass(frozen=True, slots=True)
class Deployment:
    """A candidate: engines, their units, and where prompts prefill."""

    name: str
    prefill: int = 0                 # prefill engines (0: colocated)
    decode: int = 1                  # decode engines (colocated: the engines)
    units_per_engine: int = 1        # colocated engines may span several units
    gateway: bool = True             # through pdserve's edge and router (stock vLLM: no)
    local_prefill_below: int = 0
    local_cached_fraction: float = 0.8
    prefill_saturated: int = 0

    def __post_init__(self) -> None:
        if self.decode < 1 or self.prefill < 0 or self.units_per_engine < 1:
            raise ValueError(f"{self.name}: needs >= 1 decode engine, >= 0 prefill engines")
        if not 0 <= self.local_cached_fraction <= 1:
            raise ValueError(f"{self.name}: local_cached_fraction must be in [0, 1]")

    @property
    def units(self) -> int:
        return (self.prefill + self.decode) * self.units_per_engine


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as its client saw it."""

    ttft_ms: float
    max_gap_ms: float
    sent_s: float
    done_s: float
    local: bool = True               # prefilled where it decoded


@dataclass(frozen=True, slots=True)
class SimResult:
    """Every request's outcome and the run's length."""

    outcomes: list[Outcome]
    duration_s: float

    def met(self, ttft_ms: float, itl_ms: float) -> int:
        return sum(o.ttft_ms <= ttft_ms and o.max_gap_ms <= itl_ms for o in self.outcomes)

    def goodput(self, ttft_ms: float, itl_ms: float) -> float:
        """Requests per second meeting both limits (slo.py's definition)."""
        return self.met(ttft_ms, itl_ms) / self.duration_s if self.duration_s > 0 else 0.0

    def attainment(self, ttft_ms: float, itl_ms: float, after_s: float = 0.0) -> float:
        """The share of the requests sent from `after_s` on that met both limits."""
        got = [o.ttft_ms <= ttft_ms and o.max_gap_ms <= itl_ms
               for o in self.outcomes if o.sent_s >= after_s]
        return sum(got) / len(got) if got else 0.0

    def median_sent_s(self) -> float:
        """When half the requests had been sent."""
        return float(np.median([o.sent_s for o in self.outcomes])) if self.outcomes else 0.0

    def p99(self, what: str) -> float:
        values = [getattr(o, what) for o in self.outcomes]
        return float(np.percentile(values, 99)) if values else 0.0


@dataclass(slots=True)
class _Flight:
    """A request in flight: its times so far."""

    turn: Turn
    sent: float
    session: int = -1
    index: int = 0
    first: float = -1.0
    last: float = -1.0
    max_gap: float = 0.0
    local: bool = True


@dataclass(frozen=True, slots=True)
class Knobs:
    """Engine-level modelling choices (docs/planning.md, "Recommend")."""

    unit_speedup_prefill: float = 0.7   # each extra unit of an engine adds this x one unit
    unit_speedup_decode: float = 0.0    # (both fit on the 2-core machine: calibrate)
    kv_wait_steps: int = 1              # steps a decode engine waits for pulled KV
    stock_request_ms: float = 0.0       # a stock server's own HTTP cost per request
    # CPU time the load's client (and pdserve's edge and router) take from the engines'
    # own cores, per request and per streamed token: 0 where they run elsewhere
    host_request_ms: float = 0.0
    host_token_ms: float = 0.0
    # what the serving process adds to an engine step beyond the profiled engine (the
    # output path: detokenizing, streaming), per step that streams and per streamed token
    serve_step_ms: float = 0.0
    serve_token_ms: float = 0.0

    def slowdown(self, demand: Demand, rate: float, units: int) -> float:
        """How much longer every engine step takes when the host's share of the cores
        is taken from the engines: 1 / (1 - share), the share at the offered load."""
        turns = demand.requests or [t for s in demand.sessions for t in s]
        per_s = rate * demand.total_requests / demand.units
        ms = per_s * (self.host_request_ms + self.host_token_ms * mean(t.output for t in turns))
        return 1 / (1 - min(0.9, ms / 1000 / units))


@dataclass
class _Run:
    """The event loop's state for one simulation."""

    profile: Profile
    dep: Deployment
    demand: Demand
    knobs: Knobs
    rate: float
    prefill: list[EngineModel] = field(default_factory=list)
    decode: list[EngineModel] = field(default_factory=list)
    events: list = field(default_factory=list)
    seq: itertools.count = field(default_factory=itertools.count)
    flights: dict[int, _Flight] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    sent: int = 0

    def __post_init__(self) -> None:
        k, u = self.knobs, self.dep.units_per_engine
        speed = Speed(1 + k.unit_speedup_prefill * (u - 1), 1 + k.unit_speedup_decode * (u - 1))
        slow = k.slowdown(self.demand, self.rate, self.dep.units)
        serve = (k.serve_step_ms, k.serve_token_ms)
        self.prefill = [EngineModel(self.profile, Speed(), f"prefill-{i}", slow, serve)
                        for i in range(self.dep.prefill)]
        self.decode = [EngineModel(self.profile, speed, f"decode-{i}", slow, serve)
                       for i in range(self.dep.decode)]
        o = self.profile.overheads
        self.gateway_ms = (o.edge_request_ms + o.router_request_ms + o.edge_token_ms
                           if self.dep.gateway else k.stock_request_ms)

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn, args))

    def send(self, t: float, turn: Turn, session: int = -1, index: int = 0) -> None:
        rid = len(self.flights)
        f = self.flights[rid] = _Flight(turn, t, session, index)
        dec = self._pick_decode(turn)
        cached = dec.cached_tokens(turn.prompt, turn.prefixes)
        pre = self._pick_prefill(turn, cached)
        f.local = pre is None
        self.sent += 1
        if pre is None:
            dec.admit(Job(rid, turn.prompt, turn.output, todo=turn.prompt, key=turn.key),
                      turn.prefixes)
            self.kick(t, dec)
        else:
            pre.admit(Job(rid, turn.prompt, 0, todo=turn.prompt, key=turn.key), turn.prefixes)
            self.kick(t, pre)

    def _pick_decode(self, turn: Turn) -> EngineModel:
        if not self.dep.gateway:
            return self.decode[self.sent % len(self.decode)]   # the client's round-robin
        # the router: the engine holding most of the prompt, then the least loaded
        return max(self.decode, key=lambda e: (e.cached_tokens(turn.prompt, turn.prefixes),
                                               -e.load))

    def _pick_prefill(self, turn: Turn, cached: int) -> EngineModel | None:
        """The prefill engine, or None to prefill on the decode engine."""
        d = self.dep
        if not self.prefill or turn.prompt - cached < d.local_prefill_below:
            return None
        if d.local_cached_fraction < 1 and cached >= d.local_cached_fraction * turn.prompt:
            return None
        free = [e for e in self.prefill
                if not (d.prefill_saturated and e.load >= d.prefill_saturated)]
        return min(free, key=lambda e: e.load) if free else None

    def kick(self, t: float, engine: EngineModel) -> None:
        if not engine.busy:
            res = engine.step()
            if res is not None:
                engine.busy = True
                self.at(t + res.ms / 1000, self.step_done, engine, res)

    def step_done(self, t: float, engine: EngineModel, res: StepResult) -> None:
        engine.busy = False
        for job in res.tokens + res.prefilled:
            self.token(t, self.flights[job.rid])
        for job in res.prefilled:
            turn = self.flights[job.rid].turn
            if turn.output > 1:
                dec = self._pick_decode(turn)
                xfer = self.profile.transfer_ms(turn.prompt) / 1000
                self.at(t + xfer, self.handed, dec, Job(
                    job.rid, turn.prompt, turn.output - 1, key=turn.key,
                    wait_steps=self.knobs.kv_wait_steps))
            else:
                self.finish(t, job.rid)
        for job in res.finished:
            if job.emit:
                self.finish(t, job.rid)
        self.kick(t, engine)

    def handed(self, t: float, engine: EngineModel, job: Job) -> None:
        engine.admit(job)
        self.kick(t, engine)

    def token(self, t: float, f: _Flight) -> None:
        if f.first < 0:
            f.first = t
        else:
            f.max_gap = max(f.max_gap, t - f.last)
        f.last = t

    def finish(self, t: float, rid: int) -> None:
        f = self.flights[rid]
        self.outcomes.append(Outcome((f.first - f.sent) * 1000 + self.gateway_ms,
                                     f.max_gap * 1000, f.sent, t, f.local))
        if f.session >= 0 and f.index + 1 < len(self.demand.sessions[f.session]):
            self.at(t, self.send, self.demand.sessions[f.session][f.index + 1],
                    f.session, f.index + 1)

    def run(self, seed: int) -> SimResult:
        d = self.demand
        starts = (d.arrivals if d.arrivals is not None
                  else arrival_times(d.units, self.rate, seed))
        for i, t in enumerate(starts):
            if d.sessions:
                self.at(t, self.send, d.sessions[i][0], i, 0)
            else:
                self.at(t, self.send, d.requests[i])
        while self.events:
            t, _, fn, args = heapq.heappop(self.events)
            fn(t, *args)
        return SimResult(self.outcomes, max((o.done_s for o in self.outcomes), default=0.0))


def simulate(profile: Profile, dep: Deployment, demand: Demand, rate: float, seed: int = 0,
             knobs: Knobs = Knobs()) -> SimResult:
    """Serve `demand` at `rate` (requests/s; sessions/s for sessions) on `dep`."""
    return _Run(profile, dep, demand, knobs, rate).run(seed)
