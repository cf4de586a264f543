"""`python -m pdserve.bench.pull_vs_push`: the disaggregated path's TTFT with each NIXL mode.

pull: the decode engine READs the prompt's blocks from the prefill engine (vLLM's
`NixlConnector`); push: the prefill engine WRITEs them into blocks the decode
engine allocated and registered (`NixlPushConnector`). Same orchestration for
both (prefill `Generate` with `max_tokens=1`, then decode with the returned
`kv_transfer_params_json`; the decode engine's registration meets the finished
prefill's blocks on the prefill side).

One `pdserve up` per mode and rep (1 prefill + 1 decode worker, every prompt
prefilled remotely), the modes alternating (pull, push, pull, push, ...) on the
same cores. Each gets the same prompts: random token ids, distinct per request
so no prefix cache helps, at each `--lengths` (default 1,024 and 8,192 tokens;
the tiny model is given a long-context copy of itself for that, same weights).
Each request streams one completion through the edge, one at a time; TTFT is
the first streamed token. The connectors' own `vllm:nixl_xfer_time_seconds`
(decode engine for pull, prefill engine for push) gives the transfer time.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pdserve.bench.deployments import Hardware, PdserveStack, metric_sum
from pdserve.tiny_model import long_context_copy

from .engine_run import stdout_for_the_result

MODES = ("pull", "push")
_XFER = "vllm:nixl_xfer_time_seconds"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.pull_vs_push", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-llama", help="model dir")
    p.add_argument("--lengths", default="1024,8192", help="prompt lengths in tokens")
    p.add_argument("--requests", type=int, default=6, help="per length, mode and rep")
    p.add_argument("--reps", type=int, default=2, help="stacks per mode, alternating")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per stream")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def _ttft(port: int, model: str, ids: list[int], max_tokens: int) -> tuple[float, str]:
    """(seconds to the first streamed token, x-pdserve-path) of one streamed completion."""
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        started = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        first = None
        for line in resp:
            if first is None and line.startswith(b"data: {"):
                if json.loads(line[6:])["choices"][0].get("text"):
                    first = time.perf_counter() - started
            if line.startswith(b"data: [DONE]"):
                break
        if first is None:
            raise RuntimeError("the stream carried no token")
        return first, resp.getheader("x-pdserve-path", "")
    finally:
        conn.close()


def make_prompts(lengths: list[int], requests: int, seed: int) -> dict[int, list[list[int]]]:
    """The same prompts for every mode: one warm-up and `requests` measured per length."""
    rng = random.Random(seed)
    # Ids clear of the tokenizer's special tokens (the first few) and of its vocab end.
    return {n: [[rng.randrange(16, 4000) for _ in range(n)] for _ in range(requests + 1)]
            for n in lengths}


def _xfer(urls: dict[str, str]) -> tuple[float, float]:
    """(count, seconds) of NIXL transfers over every worker."""
    return (sum(metric_sum(u, f"{_XFER}_count") for u in urls.values()),
            sum(metric_sum(u, f"{_XFER}_sum") for u in urls.values()))


def measure(port: int, model: str, metrics: dict[str, str],
            prompts: dict[int, list[list[int]]], max_tokens: int) -> dict[int, dict]:
    """Through the edge on `port` (its workers' metrics URLs `metrics`): per length,
    TTFTs (ms) of every prompt but the first (a warm-up) and the mean transfer (ms)."""
    out = {}
    for n, batch in prompts.items():
        _ttft(port, model, batch[0], max_tokens)              # warm-up (first handshake)
        count0, sum0 = _xfer(metrics)
        ttft = []
        for ids in batch[1:]:
            seconds, path = _ttft(port, model, ids, max_tokens)
            if path != "disaggregated":
                raise RuntimeError(f"a {n}-token prompt ran {path!r}, not disaggregated")
            ttft.append(1000 * seconds)
        count, total = (a - b for a, b in zip(_xfer(metrics), (count0, sum0)))
        out[n] = {"ttft_ms": ttft, "transfers": int(count),
                  "xfer_ms_mean": 1000 * total / count if count else None}
    return out


def run_mode(mode: str, model: str, prompts: dict[int, list[list[int]]],
             max_tokens: int) -> dict[int, dict]:
    """`measure` on a stack of its own in `mode`."""
    hw = Hardware(units=tuple(sorted(os.sched_getaffinity(0))),
                  max_model_len=max(prompts) + max_tokens + 64)
    stack = PdserveStack(f"pull-vs-push-{mode}", model, local_prefill_below=0, hw=hw,
                         placement=("--prefill-saturated", "0", "--kv-transfer-mode", mode))
    try:
        stack.start()
        return measure(stack.ports["edge"], model, stack.worker_metrics(), prompts, max_tokens)
    finally:
        stack.stop()


def compare(model: str, lengths: list[int], requests: int, reps: int, max_tokens: int,
            seed: int) -> dict:
    """Both modes, alternating, `reps` stacks each; the JSON the command prints."""
    batches = make_prompts(lengths, requests, seed)
    with tempfile.TemporaryDirectory(prefix="pdserve-long-model-") as tmp:
        long_model = str(long_context_copy(Path(model), Path(tmp) / "model",
                                           max(lengths) + max_tokens + 64))
        runs = {m: {n: {"ttft_ms": [], "xfer_ms": []} for n in lengths} for m in MODES}
        for rep in range(reps):
            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                for n, r in run_mode(mode, long_model, batches, max_tokens).items():
                    runs[mode][n]["ttft_ms"] += r["ttft_ms"]
                    if r["xfer_ms_mean"] is not None:
                        runs[mode][n]["xfer_ms"].append(r["xfer_ms_mean"])
    result = {"settings": {"lengths": lengths, "requests": requests, "reps": reps,
                           "max_tokens": max_tokens, "model": model}, "modes": {}}
    for mode in MODES:
        result["modes"][mode] = {
            str(n): {"ttft_ms_p50": round(statistics.median(r["ttft_ms"]), 1),
                     "ttft_ms_max": round(max(r["ttft_ms"]), 1),
                     "xfer_ms_mean": (round(statistics.mean(r["xfer_ms"]), 2)
                                      if r["xfer_ms"] else None),
                     "samples": len(r["ttft_ms"])}
            for n, r in runs[mode].items()}
    result["push_over_pull_ttft_p50"] = {
        str(n): round(result["modes"]["push"][str(n)]["ttft_ms_p50"]
                      / result["modes"]["pull"][str(n)]["ttft_ms_p50"], 3) for n in lengths}
    return result


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths must be token counts separated by commas, got {a.lengths!r}")
    if min(lengths) < 2 or a.requests < 1 or a.reps < 1 or a.max_tokens < 1:
        p.error("--lengths must be >= 2 tokens; --requests, --reps, --max-tokens >= 1")
    out = stdout_for_the_result()
    result = compare(a.model, lengths, a.requests, a.reps, a.max_tokens, a.seed)
    if a.json:
        print(json.dumps(result), file=out)
    else:
        for mode, rows in result["modes"].items():
            for n, r in rows.items():
                print(f"{mode:5s} {n:>6s} tokens: TTFT p50 {r['ttft_ms_p50']:8.1f} ms "
                      f"(max {r['ttft_ms_max']:.1f}), transfer {r['xfer_ms_mean']} ms, "
                      f"{r['samples']} requests", file=out)
        print("push / pull TTFT p50: " + ", ".join(
            f"{n} tokens {v}x" for n, v in result["push_over_pull_ttft_p50"].items()), file=out)
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
