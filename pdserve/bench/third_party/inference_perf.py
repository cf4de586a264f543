"""inference-perf (Kubernetes SIG): one YAML config, its summary_lifecycle_metrics.json.

It runs for a duration at a rate (no request count): `requests / rate` seconds. Its
TTFT is the time to the first streamed chunk; its `inter_token_latency` pools the gaps
between chunks of every request (vLLM's ITL); its `time_per_output_token` is per
request, (last chunk - first chunk) / (tokens - 1) (vLLM's TPOT)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from . import Figures, Shape, environment, executable

NAME = "inference-perf"
REPORT = "summary_lifecycle_metrics.json"
CONFIG = "inference-perf.yaml"


def _fixed(tokens: int) -> dict:
    return {"type": "fixed", "min": tokens, "max": tokens, "mean": tokens, "std_dev": 0}


def shared_prefix(shape: Shape, groups: int, per_group: int, system_tokens: int,
                  question_tokens: int) -> dict:
    """The `data:` section of its shared-prefix workload: `groups` system prompts of
    `system_tokens` tokens, `per_group` questions of `question_tokens` after each, the
    shape's output length."""
    return {"type": "shared_prefix", "shared_prefix": {
        "num_groups": groups, "num_prompts_per_group": per_group,
        "system_prompt_len": system_tokens, "question_len": question_tokens,
        "output_len": shape.output_tokens, "seed": shape.seed}}


def config(shape: Shape, url: str, model: str, tokenizer: str, out: Path,
           data: dict | None = None) -> dict:
    """The run's config: random prompts of the shape's lengths unless `data` says else."""
    data = data or {"type": "random", "input_distribution": _fixed(shape.prompt_tokens),
                    "output_distribution": _fixed(shape.output_tokens)}
    return {"api": {"type": "completion", "streaming": True},
            "data": data,
            "load": {"type": shape.arrival, "num_workers": 1, "base_seed": shape.seed,
                     "stages": [{"rate": shape.rate,
                                 "duration": max(1, math.ceil(shape.requests / shape.rate))}]},
            "server": {"type": "vllm", "model_name": model, "base_url": url, "ignore_eos": True},
            "tokenizer": {"pretrained_model_name_or_path": tokenizer},
            "storage": {"local_storage": {"path": str(out)}},
            "report": {"request_lifecycle": {"summary": True, "per_stage": False,
                                             "per_request": False}}}


def command(shape: Shape, url: str, model: str, tokenizer: str, out: Path,
            data: dict | None = None) -> list[str]:
    """Write the config (JSON is YAML) under `out`; the command that runs it."""
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(config(shape, url, model, tokenizer, out, data), indent=1))
    return [str(executable(NAME, "inference-perf")), "--config_file", str(out / CONFIG)]


def env() -> dict[str, str]:
    return environment()


def parse(out: Path) -> Figures:
    """The figures of the summary report inference-perf wrote under `out`."""
    found = sorted(out.rglob(REPORT))
    if not found:
        raise FileNotFoundError(f"inference-perf wrote no {REPORT} under {out}")
    r = json.loads(found[0].read_text())
    ok = r["successes"]
    lat, tput = ok["latency"], ok["throughput"]
    ms = lambda s: round(1000 * s, 3)  # noqa: E731 - it reports seconds
    return Figures(completed=int(ok["count"]), failed=int(r["failures"]["count"]),
                   ttft_p50_ms=ms(lat["time_to_first_token"]["median"]),
                   ttft_p99_ms=ms(lat["time_to_first_token"]["p99"]),
                   itl_p50_ms=ms(lat["inter_token_latency"]["median"]),
                   itl_p99_ms=ms(lat["inter_token_latency"]["p99"]),
                   tpot_p50_ms=ms(lat["time_per_output_token"]["median"]),
                   tpot_p99_ms=ms(lat["time_per_output_token"]["p99"]),
                   request_throughput=tput["requests_per_sec"],
                   output_token_throughput=tput["output_tokens_per_sec"],
                   names={"ttft": "time_to_first_token", "itl": "inter_token_latency",
                          "tpot": "time_per_output_token"})
