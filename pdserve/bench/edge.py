"""`pdserve bench edge`: many SSE streams through the edge, beside nginx and no proxy.

One token source (`pdserve.bench.synthetic`: its gRPC face for the edge,
an OpenAI-shaped HTTP face for the rest) stamps every chunk with its send time
on CLOCK_MONOTONIC. `streams` concurrent streamed completions of
`rate × duration` chunks each (starts spread over `ramp` seconds) go, one path
after another, in the same run:

- `direct`: to the source's HTTP face;
- `nginx`: through Debian's nginx (`proxy_buffering off`, HTTP/1.1 to the source;
  one worker, or as few more as the open-file limit needs for two sockets per
  stream), configured and started here in a temporary prefix;
- `floor`: through `edge_floor`, the least a Python relay does over the decode
  interface (the edge's shared batched call, its detokenizer, a chunk written per
  output, nothing else): what the edge adds over it is its features' cost;
- `edge`: through `pdserve edge` and `pdserve router`, the source as the router's
  static decode worker (prompts are short: the decode worker prefills);
- `traced`: the same with tracing on: every request's spans exported over OTLP
  (http/protobuf unless OTEL_EXPORTER_OTLP_PROTOCOL says grpc) to a collector in
  this process. `tracing` compares it with `edge`: the cost of
  tracing per token (target: under 5% added latency). With `together`, `edge`
  and `traced` run at the same time, the streams alternating between them, so
  the comparison is paired: both see the same machine, second by second
  (one after the other, this box's run-to-run drift is larger than the cost).

The load comes from separate client processes (uvloop, raw asyncio streams, a
minimal HTTP/1.1 + SSE reader): a token's latency is its arrival time minus its
stamp. A path's "added" latency is its quantile minus direct's. CPU seconds are
the proxy's (nginx master + workers; the edge process) per 1,000 tokens
delivered, the source's for direct; the edge's RSS is its peak, sampled.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from .edge_client import PROMPT, raise_nofile
from .edge_paths import Deployment, nginx_workers
from .otlp_collector import Collector

# embedded: the edge with the router in its own process (`--router embedded`: no Route call
# to another process per request; its CPU is counted, as the edge's alone is for `edge`);
# per_request: the edge with --decode-calls per-request (a Generate call per stream, where
# `edge` has the default, one shared batched call to the source's worker past a few)
PATHS = ("direct", "nginx", "floor", "edge", "embedded", "traced", "per_request")


def progress(msg: str) -> None:
    """A timestamped progress line on stderr (stdout carries the result)."""
    print(f"[bench edge {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Settings:
    """One run of the benchmark."""

    streams: int
    rate: float              # chunks per second per stream
    duration: float          # seconds each stream lasts
    ramp: float = 1.0        # stream starts spread over this many seconds
    clients: int = 2         # load-generator processes
    timeout: float = 0.0     # a stream unfinished this long after its start fails (0: 2 x
                             # duration + 120 s)

    @property
    def stream_timeout(self) -> float:
        return self.timeout or 2 * self.duration + 120

    @property
    def max_tokens(self) -> int:
        return max(1, round(self.rate * self.duration))


# --- measuring one path ---

def _rss_mib(pids: list[int]) -> float:
    import psutil
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def _peak_concurrency(spans) -> int:
    """Most streams between their first and last token at one moment."""
    import numpy as np
    if len(spans) == 0:
        return 0
    s = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    times = np.concatenate([s[:, 0], s[:, 1]])
    steps = np.concatenate([np.ones(len(s), np.int64), -np.ones(len(s), np.int64)])
    order = np.lexsort((-steps, times))         # at equal times, a start counts first
    return int(np.cumsum(steps[order]).max())


def _run_clients(st: Settings, ports: list[int], model: str, tmp: Path, watch: list[list[int]],
                 source_url: str, cpu_watch: list[list[int]]
                 ) -> tuple[list[list[dict]], list[float], float, list]:
    """Spawn the clients (their streams alternate over `ports`), sample each port's
    `watch` RSS, and the CPU seconds of each of `cpu_watch`'s groups, until they exit;
    (results per port, peak RSS per port, wall s, CPU samples: (monotonic s, [CPU s
    per group, then the whole machine's busy CPU s]))."""
    import numpy as np
    import psutil
    from pdserve.launch import Child

    from .deployments import cpu_seconds
    start_at = time.monotonic() + 1.0           # after the clients' own start-up (~0.2 s)
    base = {"host": "127.0.0.1", "ports": ports, "model": model, "max_tokens": st.max_tokens,
            "streams": st.streams, "of": st.clients, "ramp": st.ramp, "start_at": start_at,
            "timeout": st.stream_timeout}
    procs = []
    peak = [0.0] * len(ports)
    t0 = time.monotonic()
    try:
        for i in range(st.clients):
            spec = dict(base, index=i, out=str(tmp / f"client{i}"))
            procs.append(Child([sys.executable, "-m", "pdserve.bench.edge_client",
                                json.dumps(spec)], name=f"client{i}"))
        last_note = time.monotonic()
        samples = []
        while any(p.running() for p in procs):
            peak = [max(p, _rss_mib(w)) for p, w in zip(peak, watch)]
            box = psutil.cpu_times()
            samples.append((time.monotonic(), [cpu_seconds(g) for g in cpu_watch]
                            + [box.user + box.system + box.softirq + box.irq]))
            if time.monotonic() - last_note > 5:
                last_note = time.monotonic()
                progress(f"  {time.monotonic() - t0:.0f} s: {_source_note(source_url)}")
            time.sleep(0.2)
        wall = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill_session()
            p.popen.wait()
    results: list[list[dict]] = [[] for _ in ports]
    for i, p in enumerate(procs):
        out = tmp / f"client{i}"
        if p.popen.returncode != 0 or not out.with_suffix(".json").exists():
            raise RuntimeError(f"load client {i} failed (exit {p.popen.returncode})")
        r = json.loads(out.with_suffix(".json").read_text())
        for k in range(len(ports)):
            results[k].append({
                "held": r["held"][k], "errors": r["errors"][k], "cpu_s": r["cpu_s"] / len(ports),
                "lat": np.fromfile(out.with_suffix(f".lat{k}"), dtype=np.int64),
                "sent": np.fromfile(out.with_suffix(f".sent{k}"), dtype=np.int64),
                # Tokens sent a second after the last stream's start: the steady state.
                "steady_from": int((start_at + st.ramp + 1.0) * 1e6),
                "start_at": start_at,
                "spans": np.fromfile(out.with_suffix(f".spans{k}"), dtype=np.int64),
                "first": np.fromfile(out.with_suffix(f".first{k}"), dtype=np.int64)})
    return results, peak, wall, samples


def _source_note(url: str) -> str:
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            h = json.loads(r.read())
        return f"source has {h['http_streams']} HTTP + {h['grpc_streams']} gRPC streams running"
    except (OSError, ValueError, KeyError):
        return "source busy"


def warm_up(port: int, model: str) -> None:
    """One short stream, so first-call costs (channels, placement) stay out of the run."""
    import urllib.request
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 2, "stream": True})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body.encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read()
    if b"[DONE]" not in text:
        raise RuntimeError(f"warm-up stream on :{port} did not finish: {text[:300]!r}")


def measure(name: str, st: Settings, port: int, model: str, tmp: Path, proxy: list[int],
            source: list[int], source_url: str) -> dict:
    """Run the streams through one path; its figures (latencies in ms)."""
    return measure_together({name: (port, proxy)}, st, model, tmp, source, source_url)[name]


def measure_together(paths: dict[str, tuple[int, list[int]]], st: Settings, model: str,
                     tmp: Path, source: list[int], source_url: str) -> dict[str, dict]:
    """Run the streams through the paths at once (name -> port, proxy pids), alternating
    over them; each path's figures."""
    from .deployments import cpu_seconds
    for port, _ in paths.values():
        warm_up(port, model)
    names = " and ".join(paths)
    progress(f"{names}: {st.streams} streams x {st.max_tokens} tokens at {st.rate:g}/s")
    cpu0 = [cpu_seconds(proxy) for _, proxy in paths.values()]
    src0 = cpu_seconds(source)
    proxies = [proxy for _, proxy in paths.values()]
    results, peaks, wall, samples = _run_clients(st, [port for port, _ in paths.values()],
                                                 model, tmp, proxies, source_url,
                                                 [*proxies, source])
    src = cpu_seconds(source) - src0
    out = {}
    for k, (name, (_, proxy)) in enumerate(paths.items()):
        cpu = cpu_seconds(proxy) - cpu0[k]
        out[name] = _figures(name, results[k], peaks[k] if proxy else None, cpu if proxy
                             else None, src / len(paths), wall)
        out[name]["by_second"] = by_second(results[k], samples, k if proxy else None, len(proxies),
                                           st.ramp + st.duration + 1)
    return out


def by_second(results: list[dict], samples: list, k: int | None, source: int, seconds: float
              ) -> list[dict]:
    """The path's tokens by the second they were sent in, from the first start: how
    many, their latency p50 / p99 (ms), and the CPU seconds the proxy (group `k` of
    the samples) and the source (group `source`) spent in that second, and the whole
    machine's busy CPU seconds (of as many as it has cores). It shows where a run's
    tail comes from: the starts, the steady streams, their ends."""
    import numpy as np
    start_at = results[0]["start_at"]
    sent = np.concatenate([r["sent"] for r in results]) / 1e6 - start_at
    lat = np.concatenate([r["lat"] for r in results]) / 1000
    times = np.array([t - start_at for t, _ in samples])
    cpu = np.array([c for _, c in samples]) if samples else np.zeros((0, source + 2))

    def cpu_in(group: int, a: float, b: float) -> float | None:
        if not len(times) or times[0] > a or times[-1] < b:
            return None
        return round(float(np.interp(b, times, cpu[:, group]) -
                           np.interp(a, times, cpu[:, group])), 3)
    out = []
    for s in range(int(np.ceil(seconds))):
        mask = (sent >= s) & (sent < s + 1)
        if not mask.any():
            continue
        window = lat[mask]
        out.append({"second": s, "tokens": int(mask.sum()),
                    "p50_ms": round(float(np.percentile(window, 50)), 3),
                    "p99_ms": round(float(np.percentile(window, 99)), 3),
                    "proxy_cpu_s": None if k is None else cpu_in(k, s, s + 1),
                    "source_cpu_s": cpu_in(source, s, s + 1),
                    "machine_cpu_s": cpu_in(source + 1, s, s + 1)})
    return out


def _figures(name: str, results: list[dict], peak: float | None, cpu: float | None,
             src: float, wall: float) -> dict:
    """One path's figures from its clients' results."""
    import numpy as np
    lat = np.concatenate([r["lat"] for r in results])
    steady = np.concatenate([r["lat"][r["sent"] >= r["steady_from"]] for r in results])
    first = np.concatenate([r["first"] for r in results])
    errors = sum((Counter(r["errors"]) for r in results), Counter())
    tokens = int(len(lat))
    def quantile(values, p: float) -> float | None:             # µs in, ms out
        return round(float(np.percentile(values, p)) / 1000, 3) if len(values) else None
    q = lambda p: quantile(lat, p)  # noqa: E731
    qs = lambda p: quantile(steady, p)  # noqa: E731
    per_1k = lambda s: round(1000 * s / tokens, 4) if tokens else None  # noqa: E731
    out = {"streams_held": sum(r["held"] for r in results), "errors": sum(errors.values()),
           "error_kinds": dict(errors), "tokens": tokens,
           "latency_p50_ms": q(50), "latency_p99_ms": q(99), "latency_max_ms": q(100),
           "added_p50_ms": 0.0, "added_p99_ms": 0.0,
           # The same, over the tokens sent from a second after the last stream started
           # (the starts' own work left out: what the path adds to running streams).
           "steady_tokens": int(len(steady)), "steady_p50_ms": qs(50), "steady_p99_ms": qs(99),
           "steady_added_p50_ms": 0.0, "steady_added_p99_ms": 0.0,
           # From a stream's connect to its first token: what a start waits (the ramp's
           # starts queue behind each other and, in the edge, behind running streams).
           "first_token_p50_ms": quantile(first, 50), "first_token_p99_ms": quantile(first, 99),
           "cpu_s_per_1k_tokens": per_1k(src if cpu is None else cpu),
           "source_cpu_s_per_1k_tokens": per_1k(src),
           "peak_concurrent_streams": _peak_concurrency(np.concatenate(
               [r["spans"] for r in results])),
           "client_cpu_s": round(sum(r["cpu_s"] for r in results), 2), "wall_s": round(wall, 1)}
    if peak is not None:
        out["proxy_rss_mib"] = round(peak, 1)
    progress(f"{name}: held {out['streams_held']}, errors {dict(errors) or 0}, "
             f"p50 {out['latency_p50_ms']} ms, p99 {out['latency_p99_ms']} ms, "
             f"{out['cpu_s_per_1k_tokens']} CPU s / 1k tokens")
    return out


def _added(sections: dict) -> None:
    direct = sections.get("direct")
    for name, s in sections.items():
        if name == "direct":
            continue
        for p in ("p50", "p99"):
            for of, to in ((f"latency_{p}_ms", f"added_{p}_ms"),
                           (f"steady_{p}_ms", f"steady_added_{p}_ms")):
                ok = direct and s.get(of) is not None and direct.get(of) is not None
                s[to] = round(max(0.0, s[of] - direct[of]), 3) if ok else None


def targets(result: dict) -> dict:
    """The issue's targets this run's settings speak to (others are left out)."""
    st, edge, nginx = result["settings"], result.get("edge"), result.get("nginx")
    out = {}
    tracing = result.get("tracing")
    if tracing and tracing["latency_p50_ratio"] is not None and st["streams"] >= 100:
        out["tracing_latency_p50_le_1.05x"] = tracing["latency_p50_ratio"] <= 1.05
    if edge and st["streams"] >= 10_000:
        out["edge_10k_streams_0_errors"] = edge["errors"] == 0 and edge["streams_held"] >= 10_000
        out["edge_rss_le_1_gib"] = result["edge_rss_mib"] <= 1024
    for name in ("edge", "embedded", "per_request"):
        s = result.get(name)
        if s and st["streams"] >= 1000 and st["rate"] >= 20 and s["added_p99_ms"] is not None:
            out[f"{name}_added_p99_le_1_ms"] = s["added_p99_ms"] <= 1.0
            if nginx and nginx["added_p99_ms"] is not None:
                out[f"{name}_added_p99_le_2x_nginx"] = (s["added_p99_ms"]
                                                        <= 2 * nginx["added_p99_ms"])
    return out


def _note_errors(dep: Deployment, name: str, section: dict) -> None:
    """On errors, what the path's processes logged goes to stderr (their logs are deleted)."""
    if section["errors"]:
        progress(f"{name}: {section['errors']} errors; its log:\n{dep.log_summary(name)}")


def bench_edge(st: Settings, paths: list[str], model: str, together: bool = False) -> dict:
    """Start the source, then each path's proxy in turn; measure; stop everything.
    `together`: `edge` and `traced` run at once, streams alternating between them
    (each gets half), so both see the same machine."""
    nofile = raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-bench-edge-"))
    dep = Deployment(model, st.rate, tmp)
    sections: dict[str, dict] = {}
    try:
        progress("starting the source")
        dep.start_source()
        source = Deployment.pids(dep.source)
        source_url = f"http://127.0.0.1:{dep.ports['http']}/health"
        for name in PATHS:
            if name not in paths:
                continue
            if sections:
                time.sleep(1)                   # the last path's sockets close
            if name == "direct":
                sections[name] = measure(name, st, dep.ports["http"], model, tmp, [], source,
                                         source_url)
                _note_errors(dep, name, sections[name])
            elif name == "nginx":
                progress("starting nginx")
                dep.start_nginx(nofile, nginx_workers(st.streams, nofile))
                sections[name] = measure(name, st, dep.ports["nginx"], model, tmp,
                                         Deployment.pids(dep.nginx), source, source_url)
                _note_errors(dep, name, sections[name])
                dep.stop_nginx()
            elif name == "floor":
                progress("starting the floor relay")
                dep.start_floor()
                sections[name] = measure(name, st, dep.ports["floor"], model, tmp,
                                         Deployment.pids(dep.floor), source, source_url)
                _note_errors(dep, name, sections[name])
                dep.stop_floor()
            elif name not in sections:
                pair = ([n for n in ("edge", "traced") if n in paths]
                        if together and name in ("edge", "traced") else [name])
                sections |= _measure_edges(dep, pair, st, model, tmp, source, source_url)
    finally:
        dep.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    _added(sections)
    result = {"settings": {**asdict(st), "max_tokens": st.max_tokens, "together": together,
                           "stream_timeout_s": st.stream_timeout, "nginx_workers": nginx_workers(st.streams, nofile),
                           "nofile": nofile,
                           "cores": len(os.sched_getaffinity(0))},
              "streams": st.streams, "rate": st.rate, "duration": st.duration,
              **sections,
              "edge_rss_mib": sections["edge"]["proxy_rss_mib"] if "edge" in sections else None}
    if "edge" in sections and "traced" in sections:
        result["tracing"] = tracing_cost(sections["edge"], sections["traced"])
    result["targets"] = targets(result)
    return result


def _measure_edges(dep: Deployment, names: list[str], st: Settings, model: str, tmp: Path,
                   source: list[int], source_url: str) -> dict[str, dict]:
    """Start a router + edge per path (`traced`: tracing on, to a collector here),
    measure them at once, stop them (which flushes the last spans)."""
    collector = Collector() if "traced" in names else None
    try:
        for name in names:
            what = "edge (router embedded)" if name == "embedded" else "router + edge"
            progress(f"starting pdserve {what} for {name}")
            dep.start_edge(name, _tracing_env(collector) if name == "traced" else None,
                           ("--decode-calls", "per-request") if name == "per_request" else (),
                           embedded=name == "embedded")
        out = measure_together({n: (dep.ports[n], Deployment.pids(dep.edges[n][1]))
                                for n in names}, st, model, tmp, source, source_url)
        for name in names:
            _note_errors(dep, name, out[name])
            dep.stop_edge(name)
        if collector:
            out["traced"]["spans_exported"] = len(collector.spans)
        return out
    finally:
        if collector:
            collector.stop()


def _tracing_env(collector: Collector) -> dict:
    """Tracing on, every request sampled (unless the environment says otherwise: the
    standard OTEL_* variables reach the edge), spans batched to `collector`."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": (collector.endpoint if protocol == "grpc"
                                            else collector.http_endpoint),
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_TRACES_SAMPLER": os.environ.get("OTEL_TRACES_SAMPLER", "always_on")}


def tracing_cost(off: dict, on: dict) -> dict:
    """Tracing on vs off, per token: latency quantiles and the edge's CPU, as ratios."""
    ratio = lambda a, b: round(a / b, 3) if a is not None and b else None  # noqa: E731
    return {"latency_p50_ratio": ratio(on["latency_p50_ms"], off["latency_p50_ms"]),
            "latency_p99_ratio": ratio(on["latency_p99_ms"], off["latency_p99_ms"]),
            "cpu_per_token_ratio": ratio(on["cpu_s_per_1k_tokens"], off["cpu_s_per_1k_tokens"]),
            "spans_exported": on.get("spans_exported", 0)}


def table(result: dict) -> str:
    """The sections side by side, then the targets, as text."""
    keys = ["streams_held", "errors", "tokens", "latency_p50_ms", "latency_p99_ms",
            "added_p50_ms", "added_p99_ms", "steady_added_p50_ms", "steady_added_p99_ms",
            "cpu_s_per_1k_tokens", "peak_concurrent_streams"]
    st = result["settings"]
    lines = [f"{st['streams']} streams x {st['max_tokens']} tokens at {st['rate']:g} tokens/s "
             f"on {st['cores']} cores", f"{'path':<12}" + "".join(f"{k:>24}" for k in keys)]
    for name in PATHS:
        if name in result:
            lines.append(f"{name:<12}" + "".join(f"{str(result[name][k]):>24}" for k in keys))
    lines.append(f"edge peak RSS: {result['edge_rss_mib']} MiB")
    if "tracing" in result:
        lines.append(f"tracing on vs off: {result['tracing']}")
    lines += [f"  target {k}: {'met' if v else 'MISSED'}" for k, v in result["targets"].items()]
    return "\n".join(lines)
