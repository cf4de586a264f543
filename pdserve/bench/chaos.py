"""`pdserve chaos`: kill real workers under streaming load; no accepted stream may suffer.

Starts its own stack (`pdserve up`, 2 prefill + 2 decode workers, tiny model,
loopback ports), records each prompt's uninterrupted temperature-0 text, then
for `--duration` seconds drives `--concurrency` streaming clients while a
seeded schedule faults workers: SIGKILL (the supervisor restarts it), SIGSTOP
for a few seconds then SIGCONT, or SIGTERM (it drains and exits; the supervisor
restarts it); and SIGTERM to the edge ("edge": it drains its streams, exits and
is restarted; requests meanwhile are refused, not accepted). A fault only hits
a pool whose workers all serve, so each pool always keeps one. Then it checks, by SSE event id and
text, every stream the edge accepted:

- completed: a finish chunk and `[DONE]`, no error event, every token;
- duplicated / missing: event ids repeated / skipped;
- text_mismatches: text unequal to the prompt's uninterrupted run;
- after the load: every engine's KV usage back to idle (`leaked_blocks`) and no
  KV lease open on any prefill worker (`open_leases`);
- continue_p50/p99_ms: for every stream a SIGKILLed decode worker was serving,
  its longest silence after the kill, from the kill to the next event (a stopped
  or draining worker: stall_continue_*; a stop costs the stall deadline first).

Prints "N streams, N completed, 0 lost, 0 duplicated, K migrations, F failovers"
(or one JSON object with `--json`); exits 1 when a stream was lost, duplicated,
changed, or anything leaked.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import aiohttp

from pdserve.bench.deployments import Hardware, PdserveStack, metric_sum
from pdserve.config import EdgeConfig

_FAULTS = ("kill", "stop", "term", "edge")
# Deadlines tight enough that a fault is seen in about a second here.
EDGE_FLAGS = ("--decode-stall-seconds", "1.5", "--decode-first-token-seconds", "10",
              "--prefill-timeout-seconds", "5", "--max-migrations", "5")
_ROUTER_FLAGS = ("--local-cached-fraction", "1", "--prefill-saturated", "0")


@dataclass
class Stream:
    """What one client saw of one stream."""

    prompt: int
    started: float
    worker: str = ""                    # the decode worker it started on
    status: int = 0
    ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    text: str = ""
    tokens: int = 0
    finish: str | None = None
    done: bool = False
    error: str = ""


@dataclass
class Fault:
    at: float
    victim: str
    kind: str


def _prompts(n: int, seed: int) -> list[str]:
    from pdserve.tiny_model import synthetic_corpus
    rng = random.Random(seed)
    return [" ".join(synthetic_corpus(seed * 100 + i, rng.randint(6, 20))) for i in range(n)]


async def _stream(http, url: str, model: str, prompt: str, max_tokens: int, out: Stream) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        # The resumable framing: the report's duplicated/missing counts and the
        # continue gaps read each event's id (OpenAI's default framing has none).
        async with http.post(f"{url}/v1/completions", json=body,
                             headers={"x-pdserve-sse": "resumable"}) as r:
            out.status, out.worker = r.status, r.headers.get("x-pdserve-worker", "")
            if r.status != 200:
                out.error = (await r.text())[:200]
                return
            buf = ""
            async for raw in r.content.iter_any():
                buf += raw.decode()
                *blocks, buf = buf.split("\n\n")
                for block in blocks:
                    _event(block, out)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out.error = out.error or f"connection: {type(e).__name__}"


def _event(block: str, out: Stream) -> None:
    ident = data = None
    for line in block.split("\n"):
        if line.startswith("id: "):
            ident = int(line[4:])
        elif line.startswith("data: "):
            data = line[6:]
    if data is None:
        return
    if ident is None:                           # not the resumable framing asked for
        out.error = out.error or "an event without an id"
        return
    out.ids.append(ident)
    out.times.append(time.monotonic())
    if data == "[DONE]":
        out.done = True
        return
    obj = json.loads(data)
    if "error" in obj:
        out.error = obj["error"].get("message", "error")
        return
    for choice in obj.get("choices", []):
        out.text += choice.get("text", "")
        out.finish = choice.get("finish_reason") or out.finish
    if obj.get("usage"):
        out.tokens = obj["usage"]["completion_tokens"]


def _silence_ms(times: list[float], at: float, window: float = 15.0) -> float:
    """How long a stream went without events because of a fault at `at`: its longest
    silence in the `window` after it, counted from the fault (events a dying worker
    had already sent may still arrive just after it; they do not end the silence)."""
    before = [t for t in times if t <= at]
    points = [before[-1] if before else at] + [t for t in times if at < t <= at + window]
    return max((b - max(a, at) for a, b in zip(points, points[1:])), default=0.0) * 1000


def kv_blocks_in_use(metrics_url: str) -> int:
    """KV blocks an engine holds for requests (cached-but-free blocks are not counted):
    its usage fraction times its block count, from its Prometheus metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        body = r.read().decode()
    usage = re.search(r"^vllm:kv_cache_usage_perc(?:{[^}]*})? (\S+)$", body, re.M)
    blocks = re.search(r'^vllm:cache_config_info{[^}]*num_gpu_blocks="(\d+)"', body, re.M)
    if usage is None or blocks is None:
        raise RuntimeError(f"{metrics_url} reports no KV usage or block count")
    return round(float(usage.group(1)) * int(blocks.group(1)))


def open_leases(prefill_address: str) -> int:
    """KV leases a prefill worker still holds."""
    import grpc
    from pdserve.v1 import transfer_pb2, transfer_pb2_grpc
    with grpc.insecure_channel(prefill_address) as ch:
        return transfer_pb2_grpc.KVTransferStub(ch).Stats(transfer_pb2.LeaseStatsRequest(),
                                                           timeout=10).open


class Chaos:
    """The stack, its load, and the faults."""

    def __init__(self, a: argparse.Namespace, stack=None):
        """`stack`: a running one to break instead of starting its own (it has what
        PdserveStack has: start, up_pid, worker_metrics, worker_addresses)."""
        self.a = a
        self.rng = random.Random(a.seed)            # the faults
        self.load_rng = random.Random(a.seed + 1)   # which prompt each stream sends
        self.prompts = _prompts(a.prompts, a.seed)
        self.stack = stack or PdserveStack(
            "chaos", a.model, local_prefill_below=0,
            hw=Hardware(units=tuple(sorted(os.sched_getaffinity(0)))),
            prefill_workers=2, decode_workers=2,
            placement=_ROUTER_FLAGS + EDGE_FLAGS + ("--decode-calls", a.decode_calls))
        self.url = ""
        self.streams: list[Stream] = []
        self.faults: list[Fault] = []
        self.stopped: set[int] = set()
        self.t0 = 0.0
        self.baseline: dict[str, float] = {}    # the edge's counters when last read
        self.banked: dict[str, float] = {}      # what it counted, across its restarts

    def workers(self) -> dict[str, int]:
        """Worker id (and "edge") -> PID of its process now (a restarted one has a new one)."""
        import psutil
        up = psutil.Process(self.stack.up_pid)
        out = {}
        for child in up.children():
            try:
                cmd = child.cmdline()
            except psutil.Error:                # just died (a zombie until reaped)
                continue
            if "--worker-id" in cmd:
                out[cmd[cmd.index("--worker-id") + 1]] = child.pid
            elif "edge" in cmd:
                out["edge"] = child.pid
        return out

    def health(self) -> tuple[bool, set[str]]:
        """(the edge's /health is 200, the ids of the workers the router has serving)."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                body, ok = json.loads(r.read()), r.status == 200
        except urllib.error.HTTPError as e:
            body, ok = json.loads(e.read() or b"{}"), False
        except OSError:
            return False, set()
        return ok, {w["worker_id"] for w in body.get("workers", []) if w["serving"]}

    def serving(self) -> bool:
        return self.health()[0]

    async def reference(self) -> list[str]:
        """Each prompt's text with nothing failing."""
        async with aiohttp.ClientSession() as http:
            refs = [Stream(i, time.monotonic()) for i in range(len(self.prompts))]
            for i, s in enumerate(refs):
                await _stream(http, self.url, self.a.model, self.prompts[i], self.a.max_tokens, s)
                if not (s.done and s.finish and not s.error):
                    raise RuntimeError(f"the reference run of prompt {i} failed: {s.error}")
        return [s.text for s in refs]

    async def load(self, until: float) -> None:
        async def client() -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
                while time.monotonic() < until:
                    s = Stream(self.load_rng.randrange(len(self.prompts)), time.monotonic())
                    self.streams.append(s)
                    await _stream(http, self.url, self.a.model, self.prompts[s.prompt],
                                  self.a.max_tokens, s)
                    if s.status != 200:
                        await asyncio.sleep(0.2)        # refused: back off a little
        await asyncio.gather(*(client() for _ in range(self.a.concurrency)))

    async def inject(self, until: float) -> None:
        """Faults on a worker whose pool is whole: at most one worker per pool is ever
        down (killed, stopped or draining, until it serves again)."""
        kinds = self.a.faults.split(",")
        down: dict[str, float] = {}             # victim -> when it may count as back
        await asyncio.sleep(self.a.first_fault)
        while time.monotonic() < until - 3:
            ok, serving = self.health()
            serving |= {"edge"} if ok else set()
            now = time.monotonic()
            for w in [w for w, t in down.items() if now > t and w in serving]:
                del down[w]
            pools_hit = {w.split("-")[0] for w in down}
            kind = self.rng.choice(kinds)
            victims = {w: pid for w, pid in self.workers().items()
                       if w.split("-")[0] not in pools_hit and (w == "edge") == (kind == "edge")}
            if not victims:
                await asyncio.sleep(0.5)
                continue
            victim = self.rng.choice(sorted(victims))
            pid = victims[victim]
            self.faults.append(Fault(now, victim, kind))
            down[victim] = now + 3.0 + (self.a.stop_seconds if kind == "stop" else 0)
            print(f"chaos: {kind} {victim} (pid {pid}) at {now - self.t0:.1f} s",
                  file=sys.stderr, flush=True)
            if kind == "stop":
                os.kill(pid, signal.SIGSTOP)
                self.stopped.add(pid)
                asyncio.get_running_loop().call_later(self.a.stop_seconds, self._cont, pid)
            else:                               # kill; term and edge: a drain
                if victim == "edge":            # its counters restart with it
                    self._bank_counters()
                os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGTERM)
            await asyncio.sleep(self.rng.uniform(1.0, self.a.gap))

    def _cont(self, pid: int) -> None:
        if pid in self.stopped:
            self.stopped.discard(pid)
            os.kill(pid, signal.SIGCONT)

    async def run(self) -> dict:
        self.url = self.stack.start()[0]
        refs = await self.reference()
        self.baseline = self._edge_counters()
        self.t0 = time.monotonic()
        until = self.t0 + self.a.duration
        await asyncio.gather(self.load(until), self.inject(until))
        for pid in list(self.stopped):
            self._cont(pid)
        deadline = time.monotonic() + 300
        while not self.serving() and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        self._bank_counters()
        return self._report(refs, self.banked)

    def _bank_counters(self) -> None:
        """Add what the edge counted since the baseline to `banked` (before the edge
        restarts, and at the end)."""
        now = self._edge_counters()
        for k, v in now.items():
            self.banked[k] = self.banked.get(k, 0) + v - self.baseline.get(k, 0)
        self.baseline = {}

    def _edge_counters(self) -> dict[str, float]:
        metrics = f"{self.url}/metrics"
        return {name: metric_sum(metrics, f"pdserve:{name}_total")
                for name in ("migrations", "prefill_failovers", "prefill_fallbacks")}

    def _leaks(self) -> tuple[int, int]:
        """(KV blocks still in use on any engine, leases still open), once the load is over:
        waits up to 30 s for both to reach 0."""
        deadline = time.monotonic() + 30
        while True:
            blocks = sum(kv_blocks_in_use(url) for url in self.stack.worker_metrics().values())
            leases = sum(open_leases(a) for a in self.stack.worker_addresses("prefill"))
            if (blocks == 0 and leases == 0) or time.monotonic() > deadline:
                return blocks, leases
            time.sleep(0.5)

    def _report(self, refs: list[str], counters: dict[str, float]) -> dict:
        accepted = [s for s in self.streams if s.status == 200]
        completed = [s for s in accepted if s.done and s.finish and not s.error
                     and s.tokens == self.a.max_tokens]
        duplicated = sum(len(s.ids) - len(set(s.ids)) for s in accepted)
        missing = sum(max(s.ids, default=0) - len(set(s.ids)) for s in accepted)
        mismatched = [s for s in completed if s.text != refs[s.prompt]]
        kill_gaps, stall_gaps = [], []
        for f in self.faults:
            if not f.victim.startswith("decode"):
                continue
            for s in accepted:
                # A stream the victim was serving (it started there, and had not ended).
                if s.worker == f.victim and s.started < f.at and s.times[-1] > f.at:
                    (kill_gaps if f.kind == "kill" else stall_gaps).append(
                        _silence_ms(s.times, f.at))
        blocks, leases = self._leaks()

        def pct(xs: list[float], q: int) -> float | None:
            if not xs:
                return None
            return round(statistics.quantiles(xs, n=100, method="inclusive")[q - 1]
                         if len(xs) > 1 else xs[0], 1)

        return {
            "seed": self.a.seed, "duration": self.a.duration, "streams": len(accepted),
            "completed": len(completed), "lost": len(accepted) - len(completed),
            "duplicated": duplicated, "missing": missing,
            "text_mismatches": len(mismatched),
            "refused": len(self.streams) - len(accepted),
            "migrations": int(counters["migrations"]),
            "failovers": int(counters["prefill_failovers"]),
            "fallbacks": int(counters["prefill_fallbacks"]),
            "faults": [{"at_s": round(f.at - self.t0, 1), "victim": f.victim, "kind": f.kind}
                       for f in self.faults],
            "leaked_blocks": blocks, "open_leases": leases,
            "continue_p50_ms": pct(kill_gaps, 50), "continue_p99_ms": pct(kill_gaps, 99),
            "continue_samples": len(kill_gaps), "stall_continue_samples": len(stall_gaps),
            "stall_continue_p50_ms": pct(stall_gaps, 50),
            "stall_continue_p99_ms": pct(stall_gaps, 99),
            "lost_errors": sorted({s.error for s in accepted if s not in completed})[:5],
        }


def passed(out: dict) -> bool:
    """Every accepted stream whole and unchanged, nothing leaked (and some load ran)."""
    return (out["lost"] == 0 and out["duplicated"] == 0 and out["missing"] == 0
            and out["text_mismatches"] == 0 and out["leaked_blocks"] == 0
            and out["open_leases"] == 0 and out["streams"] > 0)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule and the prompts")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load and faults")
    p.add_argument("--concurrency", type=int, default=4, help="streaming clients")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per stream")
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts")
    p.add_argument("--faults", default=",".join(_FAULTS),
                   help=f"fault kinds to draw from: {', '.join(_FAULTS)}")
    p.add_argument("--first-fault", type=float, default=3.0, help="seconds of load before it")
    p.add_argument("--gap", type=float, default=5.0, help="most seconds between faults")
    p.add_argument("--stop-seconds", type=float, default=4.0, help="how long SIGSTOP lasts")
    p.add_argument("--decode-calls", choices=["per-request", "batched"],
                   default=EdgeConfig(model="-").decode_calls,
                   help="how the edge reads decode tokens (pdserve edge --decode-calls)")
    p.add_argument("--model", default="models/tiny-llama", help="model dir")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    bad = [k for k in a.faults.split(",") if k not in _FAULTS]
    if bad or a.duration <= 0 or a.concurrency < 1 or a.max_tokens < 1 or a.prompts < 1:
        print(f"pdserve chaos: bad arguments ({', '.join(bad) or 'sizes must be positive'})",
              file=sys.stderr)
        return 2
    from pdserve.tiny_model import ensure_tiny_model
    from pathlib import Path
    if a.model == "models/tiny-llama":
        ensure_tiny_model(Path(a.model))
    chaos = Chaos(a)
    try:
        out = asyncio.run(chaos.run())
    finally:
        chaos.stack.stop()
    ok = passed(out)
    if a.json:
        print(json.dumps(out | {"ok": ok}))
    else:
        print(f"{out['streams']} streams, {out['completed']} completed, {out['lost']} lost, "
              f"{out['duplicated']} duplicated, {out['migrations']} migrations, "
              f"{out['failovers']} failovers")
        print(f"faults: {len(out['faults'])}; continue after a kill p50/p99 "
              f"{out['continue_p50_ms']}/{out['continue_p99_ms']} ms; after a stop "
              f"{out['stall_continue_p50_ms']}/{out['stall_continue_p99_ms']} ms; "
              f"{out['leaked_blocks']} KV blocks leaked, {out['open_leases']} leases open")
    return 0 if ok else 1

