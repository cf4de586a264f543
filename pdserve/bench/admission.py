"""`pdserve bench admission`: the edge at 3x what its pool can serve, and a bursting tenant.

One stack with admission control and then the same stack with `--no-admission`
(everything goes straight to the engines), each on free loopback ports, with a
keys file of two tenants, `steady` and `burst` (both `normal`):

- real backend: `pdserve up` (1 prefill + 1 decode worker, the tiny model) with
  `--max-num-seqs` small, so that the decode pool's capacity is a few requests;
- synthetic backend: `pdserve router` + `pdserve edge` in front of a synthetic
  engine (pdserve/bench/synthetic.py holding at most `--max-num-seqs` streams at
  once, the rest waiting, as vLLM's scheduler does), so the flow runs in seconds;
  `--edges N` starts N edge replicas on the one router and sends them requests
  in turn (they share the pool through the router: services/router/edges.py).

Every request is a streamed completion (~64-token prompt, `max_tokens` with
`ignore_eos`), read as SSE. Phases:

1. capacity: a closed loop at concurrency = capacity -> R requests/s; its TTFT,
   TPOT and e2e set the SLO the rest is judged by (stated in the result);
2. overload: open-loop Poisson arrivals at 3R for `duration`, with admission
   and without; per run: offered, accepted (200), completed ([DONE],
   finish_reason `length` and, on the real backend, exactly `max_tokens`
   completion tokens), rejected (503/429) and how fast, lost (accepted but cut,
   incomplete or never answered), TTFT/TPOT of the completed, the edge's peak
   RSS (sampled), its queue wait and rejections (its /metrics), and the decode
   engine's peak running/waiting requests (real backend);
3. fairness: `steady` alone at 0.3R, then with `burst` at 10x that (3R), with
   admission and without, each for `fairness_duration` (longer than the overload
   phases: steady's p99 needs several hundred of its requests to settle): steady's
   TTFT p99 against its value alone.

Only the result goes to stdout; progress goes to stderr.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from .admission_load import TENANTS, Outcome, Load, queue_wait, scrape, Watch, prompts
from .deployments import Hardware, PdserveStack, processes, free_port

REJECTED = (429, 503)


def progress(msg: str) -> None:
    print(f"[bench admission {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Settings:
    """One run of the benchmark."""

    backend: str = "real"           # "real" | "synthetic"
    duration: float = 30.0          # seconds of arrivals per overload phase
    fairness_duration: float = 90.0 # ... per fairness phase (0.3R x 90 s: ~600 steady
                                    # requests here, their p99 the ~6th-worst, not the 2nd)
    capacity_seconds: float = 20.0  # the closed loop that measures R
    max_num_seqs: int = 4           # the decode engine's capacity
    prompt_tokens: int = 64
    max_tokens: int = 32
    overload: float = 3.0           # x R in the overload phase
    steady_share: float = 0.3       # the steady tenant's rate, x R
    burst_factor: float = 10.0      # the bursting tenant's rate, x the steady one's
    queue: int = 0                  # --admission-queue (0: max_num_seqs)
    wait: float = 0.0               # --admission-wait-seconds (0: the SLO's queue allowance)
    synthetic_rate: float = 100.0   # synthetic engine: tokens per second per stream
    timeout: float = 0.0            # a request not done this long after it was sent is
                                    # lost (0: 3 x overload x duration + 60)
    settle: float = 2.5             # idle seconds after a phase: the router's view of the
                                    # engine's load catches up (static workers: polled)
    seed: int = 0
    edges: int = 1                  # edge replicas on the router (synthetic backend), each
                                    # sent every edges-th request

    @property
    def admission_queue(self) -> int:
        return self.queue or self.max_num_seqs

    @property
    def request_timeout(self) -> float:
        return self.timeout or (3 * self.overload
                                * max(self.duration, self.fairness_duration) + 60)


SMOKE = Settings(backend="synthetic", duration=1.5, fairness_duration=1.5,
                 capacity_seconds=1.0, timeout=30.0, settle=1.0)


# --- the stacks under test ---------------------------------------------------------------

def _edge_flags(st: Settings, keys_file: Path, admission: bool) -> list[str]:
    # Keys need the deployment's salt secret: the one written beside them.
    flags = ["--api-keys-file", str(keys_file), "--tenant-salt-file",
             str(keys_file.with_name("tenant-salt")), "--drain-seconds", "2"]
    if not admission:
        return [*flags, "--no-admission"]
    return [*flags, "--admission", "--admission-queue", str(st.admission_queue),
            "--admission-wait-seconds", str(st.wait)]


class _RealStack:
    """`pdserve up` with the tiny model and `--max-num-seqs` small."""

    def __init__(self, st: Settings, model: str, keys_file: Path, admission: bool):
        flags = ("--max-num-seqs", str(st.max_num_seqs), *_edge_flags(st, keys_file, admission))
        hw = Hardware(device="cpu", units=tuple(sorted(os.sched_getaffinity(0))))
        self.stack = PdserveStack("admission" if admission else "no-admission", model,
                                  local_prefill_below=32, hw=hw, placement=flags)
        self.urls: list[str] = []

    def start(self) -> list[str]:
        self.urls = [self.stack.start()[0]]
        return self.urls

    def edge_pid(self) -> int:
        import psutil
        return next(pid for pid in self.stack.gateway_pids()
                    if "edge" in psutil.Process(pid).cmdline())

    @property
    def engine_metrics(self) -> str | None:
        return self.stack.decode_metrics[0]

    def stop(self) -> None:
        self.stack.stop()


class _SyntheticStack:
    """`pdserve router` + `pdserve edge` in front of the bounded synthetic engine."""

    def __init__(self, st: Settings, model: str, keys_file: Path, admission: bool):
        self.st, self.model, self.keys_file, self.admission = st, model, keys_file, admission
        self.children = processes("admission-synthetic")
        self.urls: list[str] = []
        self.engine_metrics = None

    def start(self) -> list[str]:
        engine, router = free_port(), free_port()
        cli = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING"]
        self.children.start([sys.executable, "-m", "pdserve.bench.synthetic", "--model",
                             self.model, "--port", str(engine), "--rate",
                             str(self.st.synthetic_rate), "--capacity",
                             str(self.st.max_num_seqs)], {})
        self.children.start([*cli, "router", "--port", str(router),
                             "--decode-worker", f"127.0.0.1:{engine}"], {})
        for _ in range(self.st.edges):
            edge = free_port()
            self.children.start([*cli, "edge", "--router", f"127.0.0.1:{router}", "--port",
                                 str(edge), "--grpc-port", str(free_port()), "--model",
                                 self.model, "--min-prefill-workers", "0",
                                 *_edge_flags(self.st, self.keys_file, self.admission)], {})
            self.urls.append(f"http://127.0.0.1:{edge}")
        self.children.wait_healthy([url + "/health" for url in self.urls])
        return self.urls

    def edge_pid(self) -> int:
        """The first edge (its RSS and CPU are the ones reported)."""
        return self.children.children[2].pid

    def stop(self) -> None:
        self.children.stop()


# --- figures -----------------------------------------------------------------------------

def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def _dist(values: list[float]) -> dict:
    return {"p50": _pct(values, 50), "p99": _pct(values, 99)}


def completed(o: Outcome, st: Settings) -> bool:
    """Answered 200 and streamed to the end: [DONE], finish_reason `length`, and on the
    real backend exactly `max_tokens` tokens (the synthetic engine's tokens are stamps)."""
    return (o.status == 200 and o.done and not o.error and o.finish == "length"
            and (st.backend == "synthetic" or o.tokens == st.max_tokens))


def figures(outs: list[Outcome], st: Settings, slo: dict | None = None) -> dict:
    """What one tenant (or all) saw in one phase; times in ms."""
    done = [o for o in outs if completed(o, st)]
    rejected = [o for o in outs if o.status in REJECTED]
    statuses: dict[str, int] = {}
    for o in outs:
        if o.status not in (0, 200, *REJECTED):
            statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
    tpot = [(o.e2e - o.ttft) / max(1, st.max_tokens - 1) * 1000 for o in done]
    out = {"offered": len(outs), "accepted": sum(o.status == 200 for o in outs),
           "completed": len(done),
           "rejected": {str(s): sum(o.status == s for o in rejected) for s in REJECTED},
           "rejected_with_retry_after": sum(o.retry_after for o in rejected),
           "lost": {"cut_or_incomplete": sum(o.status == 200 and not completed(o, st)
                                             for o in outs),
                    "no_response": sum(o.status == 0 for o in outs)},
           "other_status": statuses,
           "ttft_ms": _dist([o.ttft * 1000 for o in done]), "tpot_ms": _dist(tpot),
           "e2e_ms": _dist([o.e2e * 1000 for o in done]),
           "rejection_ms": _dist([o.headers_at * 1000 for o in rejected])}
    queued = [o for o in done if o.queue is not None]
    if queued:      # TTFT = the wait for room in the pool + the rest (route, prefill, ...)
        out["queue_ms"] = _dist([o.queue * 1000 for o in queued])
        out["ttft_after_queue_ms"] = _dist([(o.ttft - o.queue) * 1000 for o in queued])
    out["lost"]["total"] = sum(out["lost"].values())
    if slo:
        within = sum(o.ttft * 1000 <= slo["ttft_p99_ms"] and t <= slo["tpot_p99_ms"]
                     for o, t in zip(done, tpot))
        out["completed_within_slo"] = within
    return out


def _slo(cap: dict) -> dict:
    """The SLO the overload runs are judged by, from the run at capacity: a request may
    wait one request's time in the queue on top of an unqueued TTFT, and decode no more
    than 25% slower than in a full batch."""
    return {"ttft_p99_ms": round(cap["ttft_ms"]["p99"] + cap["e2e_ms"]["p50"], 1),
            "tpot_p99_ms": round(1.25 * cap["tpot_ms"]["p99"], 1),
            "queue_allowance_s": round(cap["e2e_ms"]["p50"] / 1000, 3),
            "how": "TTFT p99 <= TTFT p99 + e2e p50 at capacity (one queue turn); "
                   "TPOT p99 <= 1.25 x TPOT p99 at capacity"}


def _within(run: dict, slo: dict) -> bool:
    return (run["completed"] > 0 and run["ttft_ms"]["p99"] <= slo["ttft_p99_ms"]
            and run["tpot_ms"]["p99"] <= slo["tpot_p99_ms"])


# --- the phases --------------------------------------------------------------------------

class _Runner:
    """Runs phases against one started stack."""

    def __init__(self, st: Settings, stack, load: Load):
        self.st, self.stack, self.load = st, stack, load
        self.seed = st.seed

    def open(self, name: str, rates: dict[str, float], slo: dict | None,
             seconds: float) -> dict:
        progress(f"{name}: " + ", ".join(f"{t} {r:.2f} req/s" for t, r in rates.items())
                 + f" for {seconds:g} s")
        before = scrape(self.stack.urls)
        self.seed += 1
        t0 = time.perf_counter()
        with Watch(self.stack.edge_pid(), self.stack.engine_metrics) as watch:
            outs = asyncio.run(self.load.open(rates, seconds, self.seed))
        after = scrape(self.stack.urls)
        wall = time.perf_counter() - t0
        run = {"rates_rps": {t: round(r, 2) for t, r in rates.items()},
               "wall_s": round(wall, 1), **figures(outs, self.st, slo)}
        run["completed_rps"] = round(run["completed"] / wall, 2)
        run["load_generator_loop_lag_ms"] = _dist([x * 1000 for x in self.load.lag])
        if len(rates) > 1:
            run["tenants"] = {t: figures([o for o in outs if o.tenant == t], self.st, slo)
                              for t in rates}
        run |= watch.figures()
        run["queue_wait"] = queue_wait(before, after)
        run["rejections_by_reason"] = {k: int(v - before["rejections"].get(k, 0))
                                       for k, v in after["rejections"].items()
                                       if v - before["rejections"].get(k, 0)}
        run["preemptions"] = int(after["preemptions"].get("total", 0)
                                 - before["preemptions"].get("total", 0))
        progress(f"  {_line(run)}")
        time.sleep(self.st.settle)
        return run

    def warm_up(self) -> None:
        asyncio.run(self.load.closed(self.st.max_num_seqs, 0.1))

    def capacity(self) -> dict:
        c = self.st.max_num_seqs
        progress(f"capacity: closed loop, {c} at once for {self.st.capacity_seconds:g} s")
        outs, elapsed = asyncio.run(self.load.closed(c, self.st.capacity_seconds))
        run = figures(outs, self.st)
        run |= {"concurrency": c, "elapsed_s": round(elapsed, 2),
                "throughput_rps": round(run["completed"] / elapsed, 3)}
        progress(f"  R = {run['throughput_rps']} req/s; {_line(run)}")
        return run


def _line(run: dict) -> str:
    return (f"offered {run['offered']}, completed {run['completed']}, rejected "
            f"{sum(run['rejected'].values())}, lost {run['lost']['total']}, TTFT p50/p99 "
            f"{run['ttft_ms']['p50']}/{run['ttft_ms']['p99']} ms, TPOT p99 "
            f"{run['tpot_ms']['p99']} ms, rejection p99 {run['rejection_ms']['p99']} ms")


def _with_stack(st: Settings, model: str, keys_file: Path, admission: bool, phases) -> None:
    cls = _RealStack if st.backend == "real" else _SyntheticStack
    stack = cls(st, model, keys_file, admission)
    progress(f"starting the {st.backend} stack, {'with' if admission else 'without'} admission")
    try:
        urls = stack.start()
        runner = _Runner(st, stack, Load(st, model, urls, prompts(model, st.prompt_tokens,
                                                                   st.seed)))
        runner.warm_up()
        phases(runner)
    finally:
        progress("stopping the stack")
        stack.stop()


def bench_admission(st: Settings, model: str) -> dict:
    """Both stacks in turn, every phase; the result as one dict. The stack without
    admission runs first: its closed loop measures R and sets the SLO, whose queueing
    allowance (one queue turn) is then the admission stack's `--admission-wait-seconds`
    unless `st.wait` names one."""
    result: dict = {"settings": asdict(st) | {"admission_queue": st.admission_queue,
                                              "request_timeout_s": st.request_timeout,
                                              "model": model}}
    overload: dict = {}
    fairness: dict = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-admission-") as tmp:
        keys_file = Path(tmp) / "keys"
        keys_file.write_text("".join(f"{k} {t} normal\n" for t, k in TENANTS.items()))
        keys_file.with_name("tenant-salt").write_text(secrets.token_hex(32))

        def baseline(r: _Runner) -> None:
            cap = result["capacity"] = r.capacity()
            rate = cap["throughput_rps"]
            if not rate:
                raise RuntimeError("nothing completed in the capacity run: "
                                   + json.dumps(cap))
            slo = result["slo"] = _slo(cap)
            result["rates_rps"] = {"R": rate, "overload": round(st.overload * rate, 3),
                                   "steady": round(st.steady_share * rate, 3),
                                   "burst": round(st.steady_share * st.burst_factor * rate, 3)}
            overload["no_admission"] = r.open("overload, no admission",
                                              {"burst": st.overload * rate}, slo, st.duration)
            fairness["with_burst_no_admission"] = r.open(
                "fairness, steady + burst, no admission", _pair(st, rate), slo,
                st.fairness_duration)

        def admitted(r: _Runner) -> None:
            rate, slo = result["rates_rps"]["R"], result["slo"]
            overload["admission"] = r.open("overload, admission",
                                           {"burst": st.overload * rate}, slo, st.duration)
            fairness["steady_alone"] = r.open("fairness, steady alone",
                                              {"steady": st.steady_share * rate}, slo,
                                              st.fairness_duration)
            fairness["with_burst_admission"] = r.open("fairness, steady + burst, admission",
                                                      _pair(st, rate), slo,
                                                      st.fairness_duration)

        _with_stack(st, model, keys_file, False, baseline)
        wait = st.wait or result["slo"]["queue_allowance_s"]
        result["settings"]["admission_wait_s"] = wait
        _with_stack(replace(st, wait=wait), model, keys_file, True, admitted)
    result["overload"], result["fairness"] = overload, fairness
    alone = fairness["steady_alone"]["ttft_ms"]["p99"]
    for mode in ("admission", "no_admission"):
        steady = fairness[f"with_burst_{mode}"]["tenants"]["steady"]
        fairness[f"steady_ttft_p99_ratio_{mode}"] = (
            round(steady["ttft_ms"]["p99"] / alone, 2)
            if alone and steady["ttft_ms"]["p99"] is not None else None)
    result["targets"] = targets(result)
    return result


def _pair(st: Settings, rate: float) -> dict[str, float]:
    steady = st.steady_share * rate
    return {"steady": steady, "burst": steady * st.burst_factor}


def targets(result: dict) -> dict:
    """The issue's targets, each met or not (with admission)."""
    adm, slo = result["overload"]["admission"], result["slo"]
    rej = adm["rejection_ms"]["p99"]
    ratio = result["fairness"]["steady_ttft_p99_ratio_admission"]
    return {"overload_accepted_within_slo": _within(adm, slo),
            "overload_rejection_p99_under_10ms": rej is not None and rej < 10,
            "overload_nothing_accepted_lost": adm["lost"]["total"] == 0
            and adm["accepted"] == adm["completed"],
            "overload_only_503_429_refusals": not adm["other_status"],
            "overload_edge_rss_growth_under_32mib": adm["edge_rss_mib"]["growth"] < 32,
            "fairness_steady_ttft_p99_within_1_5x_alone": ratio is not None and ratio <= 1.5}


def table(result: dict) -> str:
    """The figures as text."""
    s, r = result["settings"], result["rates_rps"]
    cap = result["capacity"]
    rows = [f"{s['backend']} backend, {s['edges']} edge(s), max-num-seqs {s['max_num_seqs']}, "
            f"admission queue "
            f"{s['admission_queue']}, wait {s['admission_wait_s']} s; {s['prompt_tokens']}-token prompts, "
            f"{s['max_tokens']} out",
            f"capacity R = {r['R']} req/s (closed loop at {cap['concurrency']}): TTFT p50/p99 "
            f"{cap['ttft_ms']['p50']}/{cap['ttft_ms']['p99']} ms, TPOT p99 "
            f"{cap['tpot_ms']['p99']} ms, e2e p50 {cap['e2e_ms']['p50']} ms",
            f"SLO: TTFT p99 <= {result['slo']['ttft_p99_ms']} ms, TPOT p99 <= "
            f"{result['slo']['tpot_p99_ms']} ms"]
    for name, run in [*(("overload " + k, v) for k, v in result["overload"].items()),
                      *(("fairness " + k, v) for k, v in result["fairness"].items()
                        if isinstance(v, dict))]:
        rows.append(f"{name}: {_line(run)}, edge RSS peak {run['edge_rss_mib']['peak']} MiB "
                    f"(+{run['edge_rss_mib']['growth']}), queue wait {run['queue_wait']}")
        for tenant, t in run.get("tenants", {}).items():
            rows.append(f"    {tenant}: {_line(t)}")
    f = result["fairness"]
    rows.append(f"steady TTFT p99 with burst / alone: admission "
                f"{f['steady_ttft_p99_ratio_admission']}, no admission "
                f"{f['steady_ttft_p99_ratio_no_admission']}")
    rows += [f"  target {k}: {'met' if v else 'MISSED'}" for k, v in result["targets"].items()]
    return "\n".join(rows)
