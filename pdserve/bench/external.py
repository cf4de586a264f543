"""`pdserve bench external`: benchmark clients written elsewhere against pdserve's edge.

guidellm, inference-perf and aiperf run unmodified, each from its own virtualenv
(`make bench-clients`), one after another against the same edge with the same workload
(`Shape`: fixed prompt and output lengths, Poisson arrivals), each read from its own
result files. pdserve's own runner (`pdserve bench compare`'s: vLLM's request function,
arrivals and metrics) sends the same shape before each tool and once more at the end:
each tool is set against the runner's run just before it, and the runner's successive
runs show how far the machine itself drifts between two runs.
The tools name their figures differently: guidellm's and aiperf's inter-token latency
is per request, (latency - TTFT) / (tokens - 1), which is what vLLM calls TPOT;
inference-perf's pools the gaps between chunks, as vLLM's ITL does. Each tool is set
beside the runner's figure of its own definition.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from .third_party import Figures, Shape
from .third_party import aiperf, guidellm, inference_perf

TOOLS = {m.NAME: m for m in (guidellm, inference_perf, aiperf)}
_TOOL_TIMEOUT_S = 900
# vLLM's arrivals: gamma-distributed gaps; a shape this large spaces them evenly.
_BURSTINESS = {"poisson": 1.0, "constant": 1e6}


def runner_figures(shape: Shape, urls: list[str], model: str, tokenizer, seed: int) -> dict:
    """pdserve's runner on `shape`, prompts drawn with `seed`: its TTFT, its ITL per chunk
    and its TPOT per request."""
    from vllm.benchmarks.datasets import RandomDataset

    from .load import latency_figures, metrics, run
    from .workloads import Workload
    cpu = time.process_time()
    reqs = RandomDataset(random_seed=seed).sample(
        tokenizer, shape.requests, request_id_prefix="ext-", input_len=shape.prompt_tokens,
        output_len=shape.output_tokens, range_ratio=0.0)
    result = asyncio.run(run(Workload("external", "fixed shape", requests=reqs), urls, model,
                             shape.rate, shape.seed, burstiness=_BURSTINESS[shape.arrival]))
    m = metrics(result, tokenizer)
    return {"completed": m.completed, "failed": m.failed, **latency_figures(m),
            "client_cpu_s": round(time.process_time() - cpu, 1),
            "request_throughput": round(float(m.request_throughput), 3),
            "output_token_throughput": round(float(m.output_throughput), 2)}


def run_tool(name: str, shape: Shape, url: str, model: str, tokenizer: str, out: Path,
             **options) -> tuple[Figures, float]:
    """One tool, unmodified, as a subprocess in its own session; its figures and the CPU
    seconds it spent (on the cores the engines run on). `options` go to the tool's
    `command` (inference-perf: `data`, another workload)."""
    tool = TOOLS[name]
    out.mkdir(parents=True, exist_ok=True)
    cmd = tool.command(shape, url, model, tokenizer, out, **options)
    if not Path(cmd[0]).exists():
        raise FileNotFoundError(f"{cmd[0]} is missing: run `make bench-clients`")
    cpu = _children_cpu_s()
    with open(out / "tool.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=out, env=tool.env(), stdout=log, stderr=log,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=_TOOL_TIMEOUT_S)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)   # its workers with it
            proc.wait()
            raise
    if code != 0:
        tail = (out / "tool.log").read_text()[-3000:]
        raise RuntimeError(f"{name} exited {code}: {shlex.join(cmd)}\n{tail}")
    return tool.parse(out), round(_children_cpu_s() - cpu, 1)


def _children_cpu_s() -> float:
    """CPU seconds of the children this process has waited for (and theirs)."""
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _served_model(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


_COMPARED = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms",
             "tpot_p99_ms", "request_throughput", "output_token_throughput")


def agreement(tool: dict, runner: dict) -> dict:
    """tool / runner for each figure both report (same definitions: see Figures)."""
    return {k: round(tool[k] / runner[k], 3) for k in _COMPARED
            if tool.get(k) is not None and runner.get(k)}


def cache_counts(urls: list[str]) -> tuple[float, float]:
    """(hits, queries) of the engines' prefix caches at `urls` (their /metrics), summed."""
    from .deployments import metric_sum
    return (sum(metric_sum(u, "vllm:prefix_cache_hits_total") for u in urls),
            sum(metric_sum(u, "vllm:prefix_cache_queries_total") for u in urls))


def hit_rate(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The share of prompt tokens found cached between two `cache_counts`."""
    queries = after[1] - before[1]
    return round((after[0] - before[0]) / queries, 3) if queries else None


def edge_ttft(url: str) -> tuple[float, float]:
    """(seconds, requests) of the edge's own time-to-first-token histogram at `url`: what
    the server saw, whatever the client's clock and CPU add."""
    from .deployments import metrics_page, samples_sum
    page = metrics_page(f"{url}/metrics")
    return (samples_sum(page, "pdserve:time_to_first_token_seconds_sum"),
            samples_sum(page, "pdserve:time_to_first_token_seconds_count"))


def _timed(run, engines: list[str], edge: str = "") -> dict:
    """`run()`'s figures, with the engines' prefix-cache hit rate over it where known and
    the edge's own mean TTFT over it (`edge`: its URL)."""
    before = cache_counts(engines) if engines else None
    ttft = edge_ttft(edge) if edge else None
    started = time.monotonic()
    got = run()
    got = {**got, "wall_s": round(time.monotonic() - started, 1)}
    if before:
        got["prefix_hit_rate"] = hit_rate(before, cache_counts(engines))
    if ttft:
        (s1, n1), (s0, n0) = edge_ttft(edge), ttft
        got["edge_ttft_mean_ms"] = round((s1 - s0) / (n1 - n0) * 1000, 1) if n1 > n0 else None
    return got


def _tool_figures(name: str, shape: Shape, url: str, model: str, tokenizer: str,
                  out: Path) -> dict:
    figures, cpu = run_tool(name, shape, url, model, tokenizer, out)
    return {**asdict(figures), "client_cpu_s": cpu}


def measure(shape: Shape, tools: list[str], url: str, model_dir: str, out: Path,
            engines: list[str] = ()) -> dict:
    """The runner, then a tool, for each tool in turn, then the runner once more, against
    the edge at `url`; each tool is compared with the runner's run just before it (the
    machine drifts between runs: the runner's successive runs show by how much). Every
    runner run draws prompts of its own: a prompt sent twice would be a prefix-cache hit.
    `engines`: the workers' /metrics URLs, for each run's prefix-cache hit rate."""
    from transformers import AutoTokenizer

    from .load import progress, warm_up
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = _served_model(url)
    asyncio.run(warm_up([url], model))
    runners: list[dict] = []
    figures: dict[str, dict] = {}
    for i, name in enumerate([*tools, None]):
        progress(f"pdserve runner: {shape.requests} requests at {shape.rate}/s")
        runners.append(_timed(lambda: runner_figures(
            shape, [url], model, tokenizer, shape.seed + 1000 * (i + 1)), engines, url))
        if name is None:
            break
        progress(f"{name}: {shape.requests} requests at {shape.rate}/s")
        figures[name] = _timed(lambda: _tool_figures(name, shape, url, model, model_dir,
                                                     out / name), engines, url)
    return {"shape": asdict(shape), "tools_order": tools, "runner": runners,
            "runner_drift": [agreement(b, a) for a, b in zip(runners, runners[1:])],
            "tools": figures,
            "agreement": {n: agreement(figures[n], runners[i]) for i, n in enumerate(tools)}}


def external(shape: Shape, tools: list[str], url: str, model: str, out: Path) -> dict:
    """`measure` against `url`, or against a `pdserve up` started (and stopped) here."""
    if url:
        return measure(shape, tools, url, model, out)
    from .deployments import Hardware, PdserveStack
    from .load import progress
    hw = Hardware(device="cpu", units=tuple(sorted(os.sched_getaffinity(0))))
    stack = PdserveStack("external", model, local_prefill_below=0, hw=hw,
                         placement=("--prefill-saturated", "0"))
    try:
        progress("starting pdserve up (1 prefill + 1 decode worker)")
        (edge,) = stack.start()
        result = measure(shape, tools, edge, model, out,
                         [stack.prefill_metrics, *stack.decode_metrics])
        result["deployment"] = "pdserve up, 1 prefill + 1 decode worker, every prompt " \
                               "prefilled remotely"
        return result
    finally:
        stack.stop()


def _row(name: str, f: dict) -> str:
    cell = lambda v, w, d: f"{v:>{w}.{d}f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    return (f"{name:<18}{cell(f['ttft_p50_ms'], 10, 1)}{cell(f['ttft_p99_ms'], 10, 1)}"
            f"{cell(f['itl_p50_ms'], 9, 2)}{cell(f['itl_p99_ms'], 9, 2)}"
            f"{cell(f['tpot_p50_ms'], 10, 2)}{cell(f['tpot_p99_ms'], 10, 2)}"
            f"{cell(f['request_throughput'], 8, 2)}{cell(f['output_token_throughput'], 8, 1)}"
            f"{f['completed']:>5}{f['failed']:>5}{f.get('prefix_hit_rate', '-')!s:>8}"
            f"{f['client_cpu_s']:>8}{f['wall_s']:>7}")


def table(result: dict) -> str:
    """Runner and tools side by side, then each one's ratio to the runner's run before it."""
    s = result["shape"]
    rows = [f"{s['requests']} completions, {s['prompt_tokens']} tokens in, "
            f"{s['output_tokens']} out, {s['arrival']} {s['rate']}/s (ms; ITL per chunk, TPOT "
            "per request; cpu s: the client's own)",
            f"{'client':<18}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
            f"{'TPOT p50':>10}{'TPOT p99':>10}{'req/s':>8}{'tok/s':>8}{'ok':>5}{'err':>5}"
            f"{'cached':>8}{'cpu s':>8}{'wall':>7}"]
    rows += [_row(f"pdserve runner {i + 1}", r) for i, r in enumerate(result["runner"])]
    rows += [_row(name, f) for name, f in result["tools"].items()]
    rows.append("each over the runner's run just before it:")
    drift = {f"pdserve runner {i + 2}": d for i, d in enumerate(result["runner_drift"])}
    for name, a in {**result["agreement"], **drift}.items():
        rows.append(f"  {name:<16} " + ", ".join(f"{k.removesuffix('_ms')} {v:g}"
                                                  for k, v in a.items()))
    return "\n".join(rows)


_SHAPE_FLAGS = {"requests": "requests per client", "rate": "arrivals per second (--arrival)",
                "prompt_tokens": "every prompt's length in the model's tokens",
                "output_tokens": "tokens every answer streams (EOS ignored)",
                "seed": "prompts and arrivals, as far as each tool takes a seed"}


def install_tools() -> None:
    """`make bench-clients` in a checkout (each tool's venv from its lock; nothing to do
    once they are there); elsewhere the tools must be installed already."""
    from .third_party import ROOT
    if (ROOT / "Makefile").exists():
        # -o: never remake .venv (this process runs from it), only the tools' venvs.
        keep = [f"-o{p.relative_to(ROOT)}" for p in ROOT.glob(".venv/.installed-*")]
        subprocess.run(["make", "--no-print-directory", *keep, "bench-clients"], cwd=ROOT,
                       stdout=sys.stderr, check=True)


def _parser() -> argparse.ArgumentParser:
    d = Shape()
    p = argparse.ArgumentParser(prog="pdserve bench external", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", default=",".join(TOOLS),
                   help=f"comma-separated subset of {','.join(TOOLS)}")
    p.add_argument("--url", default="", help="a running edge (default: start `pdserve up`)")
    p.add_argument("--model", default="",
                   help="model dir, also every tool's tokenizer (default: the tiny model)")
    for field, helps in _SHAPE_FLAGS.items():
        p.add_argument(f"--{field.replace('_', '-')}", type=type(getattr(d, field)),
                       default=getattr(d, field), help=helps)
    p.add_argument("--arrival", choices=("poisson", "constant"), default=d.arrival,
                   help="arrivals at --rate: Poisson, or evenly spaced")
    p.add_argument("--out", default="", help="keep each tool's own files here "
                                             "(default: a temporary directory)")
    p.add_argument("--shared-prefix", action="store_true",
                   help="instead: inference-perf's shared-prefix workload on 2 decode "
                        "workers, pdserve against SMG cache_aware (pdserve.bench.shared_prefix)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def main(argv: list[str]) -> int:
    """Parse, run, print (JSON or a table) with the command that made it."""
    import tempfile

    from .cli import _model
    a = _parser().parse_args(argv)
    tools = [t.strip() for t in a.tools.split(",") if t.strip()]
    try:
        if not tools or set(tools) - set(TOOLS):
            raise ValueError(f"--tools is a subset of {','.join(TOOLS)}")
        shape = Shape(a.prompt_tokens, a.output_tokens, a.requests, a.rate, a.seed, a.arrival)
    except ValueError as e:
        print(f"pdserve bench external: {e}", file=sys.stderr)
        return 2
    model = _model(a.model)
    install_tools()
    signal.signal(signal.SIGTERM, lambda sig, _: sys.exit(128 + sig))
    with contextlib.ExitStack() as stack:
        out = Path(a.out) if a.out else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        with contextlib.redirect_stdout(sys.stderr):
            if a.shared_prefix:
                from .shared_prefix import compare_shared_prefix, table as sp_table
                result, show = compare_shared_prefix(shape, model, out), sp_table
            else:
                result, show = external(shape, tools, a.url, model, out), table
    result["command"] = "pdserve bench external " + shlex.join(argv)
    print(json.dumps(result) if a.json else show(result))
    return 0
