"""The load and the watch of `pdserve bench admission`: streamed completions from two
tenants, open-loop or closed-loop, each request's outcome; the edges' /metrics scraped and
the decode engine's peak running and waiting sampled while it runs."""
from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from .admission import Settings

TENANTS = {"steady": "sk-bench-steady-0f3a9c", "burst": "sk-bench-burst-7d21e4"}


# --- the load ----------------------------------------------------------------------------

def prompts(model: str, n_tokens: int, seed: int):
    """Endless distinct prompts of about `n_tokens` tokens (no shared prefix to cache)."""
    from pdserve.services.edge.prompts import load_tokenizer
    from pdserve.tiny_model import synthetic_corpus
    tok = load_tokenizer(model)
    i = 0
    while True:
        text = " ".join(synthetic_corpus(seed * 1_000_003 + i, max(2, n_tokens // 8)))
        ids = tok.encode(text, add_special_tokens=False)[:n_tokens - 1]   # + BOS
        yield tok.decode(ids)
        i += 1


@dataclass(slots=True)
class Outcome:
    """One request as its client saw it (times in seconds from its send)."""

    tenant: str
    status: int = 0                 # 0: no response
    headers_at: float | None = None
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0                 # usage.completion_tokens
    chunks: int = 0
    done: bool = False              # data: [DONE]
    finish: str = ""
    retry_after: bool = False
    queue: float | None = None      # the edge's x-pdserve-queue-ms, in seconds
    error: str = ""


async def _request(http, url: str, tenant: str, body: dict) -> Outcome:
    """One streamed completion; parses SSE (`id:`, `data:` and comment lines)."""
    import aiohttp
    o = Outcome(tenant)
    start = time.perf_counter()
    try:
        async with http.post(f"{url}/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {TENANTS[tenant]}"}) as r:
            o.status, o.headers_at = r.status, time.perf_counter() - start
            if "x-pdserve-queue-ms" in r.headers:
                o.queue = float(r.headers["x-pdserve-queue-ms"]) / 1000
            if r.status != 200:
                o.retry_after = "Retry-After" in r.headers
                await r.read()
                return o
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    o.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    o.error = str(event["error"].get("code") or "stream_error")
                for choice in event.get("choices") or []:
                    if o.ttft is None:
                        o.ttft = time.perf_counter() - start
                    o.chunks += bool(choice.get("text"))
                    o.finish = choice.get("finish_reason") or o.finish
                if event.get("usage"):
                    o.tokens = event["usage"]["completion_tokens"]
            o.e2e = time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        o.error = type(e).__name__
    return o


class Load:
    """Sends the benchmark's requests to the edges, in turn."""

    def __init__(self, st: Settings, model: str, urls: list[str], prompt_source):
        self.st, self.model, self.prompts = st, model, prompt_source
        self._urls = itertools.cycle(urls)
        self.lag: list[float] = []      # the client's own event-loop lag (s), sampled

    def next_url(self) -> str:
        """The edge the next request goes to."""
        return next(self._urls)

    async def _watch_lag(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            self.lag.append(time.perf_counter() - t - 0.01)

    def body(self) -> dict:
        return {"model": self.model, "prompt": next(self.prompts), "max_tokens":
                self.st.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}

    def _session(self):
        import aiohttp
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=self.st.request_timeout))

    async def closed(self, concurrency: int, seconds: float) -> tuple[list[Outcome], float]:
        """`concurrency` clients, each sending its next request when the last ends."""
        out: list[Outcome] = []
        async with self._session() as http:
            t0 = time.perf_counter()

            async def client() -> None:
                while time.perf_counter() - t0 < seconds:
                    out.append(await _request(http, self.next_url(), "steady", self.body()))
            await asyncio.gather(*(client() for _ in range(concurrency)))
            return out, time.perf_counter() - t0

    async def open(self, rates: dict[str, float], seconds: float, seed: int) -> list[Outcome]:
        """Poisson arrivals per tenant at `rates` (req/s) for `seconds`; every request is
        waited for."""
        rng = random.Random(seed)
        arrivals = []
        for tenant, rate in rates.items():
            t = rng.expovariate(rate)
            while t < seconds:
                arrivals.append((t, tenant))
                t += rng.expovariate(rate)
        arrivals.sort()
        self.lag = []
        watch = asyncio.create_task(self._watch_lag())
        try:
            async with self._session() as http:
                t0, tasks = time.perf_counter(), []
                for t, tenant in arrivals:
                    delay = t0 + t - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(_request(http, self.next_url(), tenant,
                                                              self.body())))
                # The phase lasts its `seconds` even when the last arrival came early
                # (Poisson): rates over its wall time are then rates over the window.
                await asyncio.sleep(max(0.0, t0 + seconds - time.perf_counter()))
                return list(await asyncio.gather(*tasks))
        finally:
            watch.cancel()


# --- what the edge and the engine say ----------------------------------------------------

def scrape(urls: list[str]) -> dict[str, dict[str, float]]:
    """The edges' admission series, summed: queue-wait histogram, rejections by reason,
    preemptions."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, dict[str, float]] = {"wait_bucket": {}, "wait": {}, "rejections": {},
                                        "preemptions": {}}

    def add(series: str, key: str, value: float) -> None:
        out[series][key] = out[series].get(key, 0.0) + value
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            body = r.read().decode()
        for family in text_string_to_metric_families(body):
            for s in family.samples:
                if s.name == "pdserve:request_queue_time_seconds_bucket":
                    add("wait_bucket", s.labels["le"], s.value)
                elif s.name in ("pdserve:request_queue_time_seconds_count",
                                "pdserve:request_queue_time_seconds_sum"):
                    add("wait", s.name.rsplit("_", 1)[1], s.value)
                elif s.name == "pdserve:rejections_total":
                    add("rejections", s.labels["reason"], s.value)
                elif s.name == "pdserve:preemptions_total":
                    add("preemptions", "total", s.value)
    return out


def queue_wait(before: dict, after: dict) -> dict:
    """Queue wait of the requests admitted between two scrapes: count, mean, and the
    histogram bucket holding p50 / p99 (`le`, in ms)."""
    n = after["wait"].get("count", 0) - before["wait"].get("count", 0)
    if n <= 0:
        return {"admitted": 0}
    total = after["wait"]["sum"] - before["wait"].get("sum", 0)
    cum = sorted(((float(le), v - before["wait_bucket"].get(le, 0))
                  for le, v in after["wait_bucket"].items()))

    def le_ms(q: float):
        le = next(le for le, c in cum if c >= q * n)
        return None if le == float("inf") else round(le * 1000, 1)
    return {"admitted": int(n), "mean_ms": round(total / n * 1000, 1),
            "p50_le_ms": le_ms(0.5), "p99_le_ms": le_ms(0.99)}


class Watch:
    """Samples the edge's RSS (10/s) and the decode engine's running/waiting (2/s) in a
    thread while a phase runs."""

    def __init__(self, edge_pid: int, engine_metrics: str | None):
        import psutil
        self.edge = psutil.Process(edge_pid)
        self.engine_metrics = engine_metrics
        self.rss = [self.edge.memory_info().rss]
        self.cpu = [self._cpu()]
        self.engine = {"running": 0.0, "waiting": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from .deployments import metric_sum
        n = 0
        while not self._stop.wait(0.1):
            self.rss.append(self.edge.memory_info().rss)
            n += 1
            if self.engine_metrics and n % 5 == 0:
                try:
                    for k in self.engine:
                        self.engine[k] = max(self.engine[k], metric_sum(
                            self.engine_metrics, f"vllm:num_requests_{k}"))
                except OSError:
                    pass

    def __enter__(self) -> "Watch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.rss.append(self.edge.memory_info().rss)
        self.cpu.append(self._cpu())

    def _cpu(self) -> tuple[float, float]:
        """CPU seconds so far of the edge and of this process (the load generator)."""
        import psutil
        return tuple(sum(t[:2]) for t in (self.edge.cpu_times(), psutil.Process().cpu_times()))

    def figures(self) -> dict:
        mib = lambda b: round(b / 2**20, 1)  # noqa: E731
        out = {"edge_rss_mib": {"start": mib(self.rss[0]), "peak": mib(max(self.rss)),
                                "end": mib(self.rss[-1]),
                                "growth": mib(max(self.rss) - self.rss[0])},
               "cpu_s": {"edge": round(self.cpu[1][0] - self.cpu[0][0], 1),
                         "load_generator": round(self.cpu[1][1] - self.cpu[0][1], 1)}}
        if self.engine_metrics:
            out["decode_engine_peak"] = {k: int(v) for k, v in self.engine.items()}
        return out
