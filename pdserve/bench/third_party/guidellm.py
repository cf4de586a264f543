"""guidellm (vLLM project): `guidellm run`, its JSON report.

Its TTFT is the time to the first streamed token; its `inter_token_latency_ms` is one
value per request, (last token - first token) / (output tokens - 1), its percentiles
weighted by tokens: what vLLM calls TPOT. It reports no gap between chunks (vLLM's ITL).
NOTE: its Poisson profile (0.8.1) can send every request at once: the main process wakes
the worker before it sets the schedule's origin, and a worker already waiting draws all
its arrival times from the unset origin (-1 s), all long past; `--arrival constant`
schedules from the run's start time instead."""
from __future__ import annotations

import json
from pathlib import Path

from . import Figures, Shape, environment, executable

NAME = "guidellm"
REPORT = "guidellm.json"


def command(shape: Shape, url: str, model: str, tokenizer: str, out: Path) -> list[str]:
    """`guidellm run` for `shape` against `url` (served `model`), its report to `out`."""
    return [str(executable(NAME, "guidellm")), "run",
            "--backend", f"kind=openai_http,target={url},model={model},"
                         "request_format=/v1/completions",
            "--profile", f"kind={shape.arrival},rate={shape.rate}",
            "--constraint", f"kind=max_requests,count={shape.requests}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--data", f"kind=synthetic_text,prompt_tokens={shape.prompt_tokens},"
                      f"output_tokens={shape.output_tokens}",
            "--seed", f"kind=static,value={shape.seed}",
            "--output", f"kind=json,path={out / REPORT}", "--disable-console-interactive"]


def env() -> dict[str, str]:
    """One worker process instead of its 10: each imports torch (a minute on 2 cores)."""
    e = environment(GUIDELLM__MAX_WORKER_PROCESSES="1")
    e.pop("PYTHONDONTWRITEBYTECODE", None)   # keep the bytecode `make clients` compiled
    return e


def parse(out: Path) -> Figures:
    """The figures of the one benchmark in `out`'s report; throughput is its successful
    requests and their output tokens over its duration."""
    (bench,) = json.loads((out / REPORT).read_text())["benchmarks"]
    m = {k: v["successful"] for k, v in bench["metrics"].items() if isinstance(v, dict)
         and "successful" in v}
    made = bench["scheduler_metrics"]["requests_made"]
    ttft, tpot = m["time_to_first_token_ms"], m["inter_token_latency_ms"]
    return Figures(completed=made["successful"], failed=made["errored"] + made["incomplete"],
                   ttft_p50_ms=ttft["percentiles"]["p50"], ttft_p99_ms=ttft["percentiles"]["p99"],
                   itl_p50_ms=None, itl_p99_ms=None,
                   tpot_p50_ms=tpot["percentiles"]["p50"], tpot_p99_ms=tpot["percentiles"]["p99"],
                   request_throughput=made["successful"] / bench["duration"],
                   output_token_throughput=(m["output_token_count"]["total_sum"]
                                            / bench["duration"]),
                   names={"ttft": "time_to_first_token_ms", "tpot": "inter_token_latency_ms"})
