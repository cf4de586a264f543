"""Time-to-first-token of the two paths, measured on a running stack's workers.

For each prompt: Prefill on the prefill worker, then Decode with its KV handle
(disaggregated), then Decode of the same prompt without a handle (local
prefill on the decode worker). Prints per-prompt times and the medians.

    .venv/bin/python scripts/pd_latency.py --prefill 127.0.0.1:50061 \\
        --decode 127.0.0.1:50071 --model models/tiny-llama --prompts 8 --sentences 30
"""
from __future__ import annotations

import argparse
import statistics
import time

import grpc
from transformers import AutoTokenizer

from pdserve.tiny_model import synthetic_corpus
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc


def _decode(stub, rid: str, ids: list[int], sampling, kv=None) -> tuple[float, float]:
    """(ms to first token, ms to last token) of one Decode call."""
    start, first = time.perf_counter(), None
    for chunk in stub.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=ids,
                                                      sampling=sampling, kv=kv), timeout=300):
        if chunk.token_ids and first is None:
            first = time.perf_counter()
    return (first - start) * 1000, (time.perf_counter() - start) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", default="127.0.0.1:50061")
    p.add_argument("--decode", default="127.0.0.1:50071")
    p.add_argument("--model", default="models/tiny-llama", help="for the tokenizer")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--sentences", type=int, default=30, help="prompt length (~11 tokens each)")
    p.add_argument("--max-tokens", type=int, default=16)
    a = p.parse_args()

    tok = AutoTokenizer.from_pretrained(a.model)
    prefill = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(a.prefill))
    decode = decode_pb2_grpc.DecodeStub(grpc.insecure_channel(a.decode))
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    rows = []
    stamp = time.time_ns()
    for i in range(a.prompts):
        ids = tok.encode(" ".join(synthetic_corpus(1000 + i, a.sentences)))
        t0 = time.perf_counter()
        handle = prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id=f"lat-{stamp}-{i}-p", prompt_token_ids=ids, sampling=sampling), timeout=300)
        prefill_ms = (time.perf_counter() - t0) * 1000
        kv_first, kv_total = _decode(decode, f"lat-{stamp}-{i}-d", ids, sampling, handle.kv)
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


if __name__ == "__main__":
    main()
