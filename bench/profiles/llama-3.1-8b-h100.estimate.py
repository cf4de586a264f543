"""Writes llama-3.1-8b-h100.estimate.json beside it (run from the repository root): an
estimate from published figures, not a measurement; docs/planning.md#on-gpus says where
each number comes from."""
import json

# Llama-3.1-8B (its config.json): 32 layers, hidden 4096, 8 KV heads x 128, 8.03e9 parameters.
P, L, D = 8.03e9, 32, 4096
KV = L * 2 * 8 * 128 * 2            # bytes of KV per token: 131,072
# H100 SXM (datasheet): 989 TFLOP/s dense bf16, 3.35 TB/s HBM3.
FLOPS = 989e12 * 0.6                # assumed 60% of peak in prefill
BW = 3.35e12 * 0.77                 # 77% of HBM bandwidth in decode (a measured A100 figure)
FIXED = 2.0                         # ms a step (scheduling, sampling, CUDA-graph launch), assumed
TOKENS = [128, 512, 1024, 2048, 4096, 8192, 16384]


def prefill(n: int, cf: float = 0.0) -> float:
    """The new tokens' weights FLOPs plus causal attention over the whole prompt."""
    new = n * (1 - cf)
    att = 2 * L * D * (n * n - (n * cf) ** 2)
    return round(FIXED + (2 * P * new + att) / FLOPS * 1000, 2)


def decode(b: int, ctx: int) -> float:
    """Reading the weights and every sequence's KV, plus the batch's FLOPs."""
    return round(FIXED + (2 * P + b * ctx * KV) / BW * 1000 + b * 2 * P / FLOPS * 1000, 2)


def transfer(n: int) -> float:
    """NIXL over NVLink inside the node: 100 GB/s effective and 1 ms a transfer, assumed."""
    return round(1.0 + n * KV / 100e9 * 1000, 2)


PROFILE = {
    "format": "pdserve-profile/1", "model": "meta-llama/Llama-3.1-8B-Instruct (estimate)",
    "device": "cuda", "units_per_engine": 1, "block_size": 16, "max_num_batched_tokens": 8192,
    "max_num_seqs": 64, "max_model_len": 16384, "transport": "ucx/cuda_ipc (NVLink), estimated",
    "command": "hand-written estimate from published hardware and model figures: "
               "docs/planning.md#on-gpus",
    "commit": "",
    "prefill": [{"tokens": n, "cached_fraction": c, "ms": prefill(n, c)}
                for c in (0.0, 0.5, 0.9) for n in TOKENS],
    "decode": [{"batch": b, "context": x, "step_ms": decode(b, x)}
               for b in (1, 16, 64) for x in (512, 2048, 8192, 16384)],
    "transfer": [{"tokens": n, "ms": transfer(n)} for n in TOKENS],
    "overheads": {"edge_request_ms": 1.0, "edge_token_ms": 0.02, "router_request_ms": 0.5}}

if __name__ == "__main__":
    with open("bench/profiles/llama-3.1-8b-h100.estimate.json", "w") as f:
        f.write(json.dumps(PROFILE, indent=1) + "\n")
