"""aiperf (NVIDIA): `aiperf profile`, its profile_export_aiperf.json.

Its TTFT is the time to the first streamed response with content; its
`inter_token_latency` is one value per request, (request latency - TTFT) / (output
tokens - 1), percentiles over requests (vLLM's TPOT); its `inter_chunk_latency` pools
the gaps between chunks (vLLM's ITL)."""
from __future__ import annotations

import json
from pathlib import Path

from . import OFFLINE, Figures, Shape, environment, executable

NAME = "aiperf"
REPORT = "profile_export_aiperf.json"


def command(shape: Shape, url: str, model: str, tokenizer: str, out: Path) -> list[str]:
    """`aiperf profile` for `shape` against `url`, its artifacts under `out`."""
    return [str(executable(NAME, "aiperf")), "profile", "--model", model, "--url", url,
            "--endpoint-type", "completions", "--streaming", "--tokenizer", tokenizer,
            "--prompt-input-tokens-mean", str(shape.prompt_tokens),
            "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(shape.output_tokens),
            "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
            "--request-rate", str(shape.rate), "--arrival-pattern", shape.arrival,
            "--request-count", str(shape.requests), "--random-seed", str(shape.seed),
            "--output-artifact-dir", str(out), "--ui-type", "none",
            "--no-server-metrics", "--no-gpu-telemetry", "--workers-max", "1",
            "--record-processor-service-count", "1"]


def env() -> dict[str, str]:
    """Online mode: offline, aiperf 0.13.0 sends even a local tokenizer path through
    `snapshot_download`, which refuses it; a local path reaches no hub either way."""
    e = environment(HF_HUB_DISABLE_TELEMETRY="1")
    for name in OFFLINE:
        e.pop(name, None)
    return e


def _find(out: Path) -> Path:
    found = sorted(out.rglob(REPORT))
    if not found:
        raise FileNotFoundError(f"aiperf wrote no {REPORT} under {out}")
    return found[0]


def parse(out: Path) -> Figures:
    """The figures of the report aiperf wrote under `out`."""
    r = json.loads(_find(out).read_text())
    ttft, itl, tpot = (r[k] for k in ("time_to_first_token", "inter_chunk_latency",
                                      "inter_token_latency"))
    return Figures(completed=int(r["request_count"]["avg"]),
                   failed=sum(int(e.get("count", 0)) for e in r["error_summary"]),
                   ttft_p50_ms=ttft["p50"], ttft_p99_ms=ttft["p99"],
                   itl_p50_ms=itl["p50"], itl_p99_ms=itl["p99"],
                   tpot_p50_ms=tpot["p50"], tpot_p99_ms=tpot["p99"],
                   request_throughput=r["request_throughput"]["avg"],
                   output_token_throughput=r["output_token_throughput"]["avg"],
                   names={"ttft": "time_to_first_token", "itl": "inter_chunk_latency",
                          "tpot": "inter_token_latency"})
