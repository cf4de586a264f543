"""Time-to-first-token of the two paths, measured on a running stack's workers.

For each prompt, over vLLM's engine protocol: the prefill leg on the prefill
worker, then the decode leg with its kv_transfer_params (disaggregated), then
the decode leg of the same prompt without them (local prefill on the decode
worker). Prints per-prompt times and the medians.

    pdserve bench legs --prefill 127.0.0.1:50061 \\
        --decode 127.0.0.1:50071 --model models/tiny-llama --prompts 8 --sentences 30
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import grpc
from smg_grpc_proto import vllm_engine_pb2_grpc
from transformers import AutoTokenizer

from pdserve.tiny_model import synthetic_corpus
from pdserve.v1 import common_pb2
from pdserve.services.edge.engine_requests import decode_request, prefill_request


def _decode(stub, rid: str, ids: list[int], sampling, params=None) -> tuple[float, float]:
    """(ms to first token, ms to last token) of one decode leg."""
    start, first = time.perf_counter(), None
    for resp in stub.Generate(decode_request(rid, ids, sampling, params), timeout=300):
        if resp.chunk.token_ids and first is None:
            first = time.perf_counter()
    return (first - start) * 1000, (time.perf_counter() - start) * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench legs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", default="127.0.0.1:50061", help="the prefill worker's gRPC address")
    p.add_argument("--decode", default="127.0.0.1:50071", help="the decode worker's gRPC address")
    p.add_argument("--model", default="models/tiny-llama", help="for the tokenizer")
    p.add_argument("--prompts", type=int, default=8, help="prompts, one at a time")
    p.add_argument("--sentences", type=int, default=30, help="prompt length (~11 tokens each)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each decode leg makes")
    a = p.parse_args(argv)

    tok = AutoTokenizer.from_pretrained(a.model)
    prefill = vllm_engine_pb2_grpc.VllmEngineStub(grpc.insecure_channel(a.prefill))
    decode = vllm_engine_pb2_grpc.VllmEngineStub(grpc.insecure_channel(a.decode))
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    rows = []
    stamp = time.time_ns()
    for i in range(a.prompts):
        ids = tok.encode(" ".join(synthetic_corpus(1000 + i, a.sentences)))
        t0 = time.perf_counter()
        done = list(prefill.Generate(prefill_request(f"lat-{stamp}-{i}", ids, sampling),
                                     timeout=300))[-1].complete
        prefill_ms = (time.perf_counter() - t0) * 1000
        params = json.loads(done.kv_transfer_params_json)
        kv_first, kv_total = _decode(decode, f"lat-{stamp}-{i}", ids, sampling, params)
        local_first, local_total = _decode(decode, f"lat-{stamp}-{i}-l", ids, sampling)
        rows.append((len(ids), prefill_ms, kv_first, prefill_ms + kv_first, local_first,
                     kv_total, local_total))
        print(f"{len(ids):5d} tokens  prefill {prefill_ms:6.1f} ms  decode-with-KV first "
              f"{kv_first:6.1f} ms  => TTFT disaggregated {prefill_ms + kv_first:6.1f} ms | "
              f"local TTFT {local_first:6.1f} ms")
    med = [statistics.median(col) for col in zip(*rows)]
    print(f"median over {len(rows)}: prompt {med[0]:.0f} tokens, prefill {med[1]:.1f} ms, "
          f"decode first token with pulled KV {med[2]:.1f} ms, TTFT disaggregated {med[3]:.1f} ms"
          f" vs local {med[4]:.1f} ms; {a.max_tokens} tokens: {med[5]:.0f} ms with KV vs "
          f"{med[6]:.0f} ms local")
    return 0

