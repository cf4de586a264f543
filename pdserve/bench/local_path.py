"""A pdserve worker's local path against a stock vLLM server pinned to the same core.

Starts `pdserve up` (both workers, so a worker that strays onto the other's core
shows), sends N prompts one at a time straight to the decode worker's
`Generate` (vLLM's engine protocol) with no kv_transfer_params (the worker
prefills locally), and times the first token and every later one. Then stops
it, starts a stock vLLM OpenAI server pinned to the decode worker's core, and
sends the same token ids over HTTP.
Prints both side by side with the ratios (target: <= 1.15x); exits 1 when a
ratio is above --max-ratio.

    pdserve bench local --prompts 12 --input-len 1024 --output-len 64
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from smg_grpc_proto import vllm_engine_pb2_grpc

from pdserve.bench.deployments import Hardware, PdserveStack, StockVllm
from pdserve.tiny_model import ensure_tiny_model
from pdserve.v1 import common_pb2
from pdserve.services.edge.engine_requests import decode_request


def _timed(chunks) -> tuple[float, float]:
    """(TTFT ms, TPOT ms) of an iterator of (n_tokens) as they arrive."""
    start = time.perf_counter()
    first = last = None
    n = 0
    for k in chunks:
        if not k:
            continue
        last = time.perf_counter()
        first = first or last
        n += k
    return (first - start) * 1000, (last - first) * 1000 / max(1, n - 1)


def _worker_decode(stub, ids: list[int], out_len: int):
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    rid = f"local-{time.monotonic_ns()}"
    for resp in stub.Generate(decode_request(rid, ids, sampling, None), timeout=300):
        yield len(resp.chunk.token_ids)


def _stock_completion(url: str, model: str, ids: list[int], out_len: int):
    body = {"model": model, "prompt": ids, "max_tokens": out_len, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data: {"):
                yield 1 if json.loads(line[6:])["choices"][0]["text"] is not None else 0


def _run(label: str, once, prompts: list[list[int]], out_len: int) -> dict:
    for ids in prompts[:2]:
        _timed(once(ids, 4))  # warm-up, untimed
    samples = [_timed(once(ids, out_len)) for ids in prompts]
    res = {"ttft_ms": statistics.median(s[0] for s in samples),
           "tpot_ms": statistics.median(s[1] for s in samples)}
    print(f"{label:<34} TTFT p50 {res['ttft_ms']:7.1f} ms   TPOT p50 {res['tpot_ms']:6.2f} ms",
          flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench local", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-llama", help="model dir")
    p.add_argument("--prompts", type=int, default=12, help="prompts, one at a time")
    p.add_argument("--input-len", type=int, default=1024, help="tokens of each prompt")
    p.add_argument("--output-len", type=int, default=64, help="tokens each request makes")
    p.add_argument("--max-ratio", type=float, default=1.15,
                   help="exit 1 when a pdserve / stock ratio is above this")
    a = p.parse_args(argv)
    model = (str(ensure_tiny_model(Path(a.model)).resolve()) if a.model.endswith("tiny-llama")
             else a.model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 4000, a.input_len).tolist() for _ in range(a.prompts)]

    hw = Hardware(units=tuple(sorted(os.sched_getaffinity(0))))
    decode_cores = hw.halves()[1]           # `pdserve up` gives decode the upper half
    stack = PdserveStack("local-path", model, 0, hw)
    stack.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{stack.ports['decode']}") as ch:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
            mine = _run(f"pdserve decode worker (cores {decode_cores})",
                        lambda ids, n: _worker_decode(stub, ids, n), prompts, a.output_len)
    finally:
        stack.stop()
    stock = StockVllm("stock", model, [decode_cores], hw)
    url = stock.start()[0]
    try:
        theirs = _run(f"stock vLLM server (cores {decode_cores})",
                      lambda ids, n: _stock_completion(url, model, ids, n), prompts, a.output_len)
    finally:
        stock.stop()
    ratios = {k: mine[k] / theirs[k] for k in mine}
    print(f"{'ratio pdserve / stock':<34} TTFT {ratios['ttft_ms']:.3f}x{'':>9}"
          f"TPOT {ratios['tpot_ms']:.3f}x   (target <= {a.max_ratio}x)")
    return 0 if max(ratios.values()) <= a.max_ratio else 1

