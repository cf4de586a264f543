"""The transfer as the engines do it: `pdserve up` (1 prefill + 1 decode worker),
requests with prompts of about a thousand tokens, every one disaggregated, and
the decode engine's connector statistics read back (`vllm:nixl_*`)."""
from __future__ import annotations

import json
import os
import random
import re
import sys
import urllib.request

from pdserve.bench.deployments import Hardware, PdserveStack

XFER_SECONDS = "vllm:nixl_xfer_time_seconds"


def stdout_for_the_result():
    """Send everything this process (and what it starts) writes to stdout to stderr
    instead: NIXL, UCX and vLLM log there. Returns a file on the old stdout, which
    then carries the result alone."""
    sys.stdout.flush()
    result_fd = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(result_fd, "w")
_BYTES = "vllm:nixl_bytes_transferred"


def prompt_text(rng: random.Random, words: int) -> str:
    """Distinct text per request: the decode engine's prefix cache must not hold it."""
    return " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 7)))
                    for _ in range(words))


def complete_disaggregated(url: str, model: str, prompt: str | list[int]) -> dict:
    """One completion through the edge at `url`, which must have run it disaggregated."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        if r.headers.get("x-pdserve-path") != "disaggregated":
            raise RuntimeError(f"request ran {r.headers.get('x-pdserve-path')}, "
                               "not disaggregated")
        return json.loads(r.read())


def nixl_series(url: str) -> dict[str, list[tuple[str, float]]]:
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read().decode()
    out: dict[str, list[tuple[str, float]]] = {}
    for name, labels, value in re.findall(r"^(vllm:nixl_\w+)(?:\{([^}]*)\})? (\S+)$", body,
                                          re.M):
        out.setdefault(name, []).append((labels, float(value)))
    return out


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus' histogram_quantile: linear within the bucket that crosses rank q."""
    buckets = sorted(buckets)
    total = buckets[-1][1]
    if total <= 0:
        raise ValueError("empty histogram")
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def _buckets(series: dict, name: str) -> list[tuple[float, float]]:
    by_le: dict[float, float] = {}
    for labels, value in series.get(f"{name}_bucket", []):
        le = re.search(r'le="([^"]+)"', labels).group(1)
        by_le[float(le)] = by_le.get(float(le), 0.0) + value
    return list(by_le.items())


def series_total(series: dict, name: str) -> float:
    return sum(v for _, v in series.get(name, []))


def transfer_times(model: str, requests: int, url: str = "", decode_metrics: str = "",
                   words: int = 220, seed: int = 0) -> dict:
    """Per-request transfer figures of `requests` disaggregated requests, through the
    stack at `url` (its decode engine's metrics at `decode_metrics`), or through a
    `pdserve up` started here."""
    if url:
        return _measure(url, decode_metrics, model, requests, random.Random(seed), words)
    hw = Hardware(units=tuple(sorted(os.sched_getaffinity(0))))
    stack = PdserveStack("transfer-bench", model, local_prefill_below=0, hw=hw,
                         placement=("--prefill-saturated", "0"))
    try:
        url = stack.start()[0]
        return _measure(url, stack.decode_metrics[0], model, requests, random.Random(seed),
                        words)
    finally:
        stack.stop()


def _measure(url: str, metrics: str, model: str, requests: int, rng: random.Random,
             words: int) -> dict:
    complete_disaggregated(url, model, prompt_text(rng, words))  # warm-up: handshake, pull
    before = nixl_series(metrics)
    prompt_tokens = [complete_disaggregated(url, model, prompt_text(rng, words))
                     ["usage"]["prompt_tokens"] for _ in range(requests)]
    after = nixl_series(metrics)
    xfer = [(le, n - dict(_buckets(before, XFER_SECONDS)).get(le, 0.0))
            for le, n in _buckets(after, XFER_SECONDS)]
    count = series_total(after, f"{XFER_SECONDS}_count") - series_total(before, f"{XFER_SECONDS}_count")
    if count <= 0:
        raise RuntimeError("the decode engine reported no NIXL transfer")
    seconds = series_total(after, f"{XFER_SECONDS}_sum") - series_total(before, f"{XFER_SECONDS}_sum")
    moved = series_total(after, f"{_BYTES}_sum") - series_total(before, f"{_BYTES}_sum")
    return {"requests": requests, "transfers": int(count),
            "request_prompt_tokens": round(sum(prompt_tokens) / len(prompt_tokens)),
            "request_bytes": int(moved / count),
            "request_ms_p50": round(1000 * histogram_quantile(xfer, 0.5), 3),
            "request_ms_mean": round(1000 * seconds / count, 3)}
