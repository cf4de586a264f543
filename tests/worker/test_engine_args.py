"""The arguments a worker builds its vLLM engine from carry its config's knobs, as
resolved for its device, and vLLM takes them (no engine is started)."""
from __future__ import annotations

import pytest

from pdserve.config import EngineConfig, KVTransferConfig
from pdserve.services.worker.engine import engine_args

KNOBS = ("dtype", "enforce_eager", "block_size", "max_num_batched_tokens",
         "enable_chunked_prefill", "max_num_seqs", "max_model_len")


@pytest.mark.parametrize("device,expected", [
    ("cpu", ("float32", True, 128, 2048, True, 64, 2048)),
    ("cuda", ("bfloat16", False, 16, 8192, True, 64, 2048)),
])
def test_the_engine_gets_its_devices_knobs(device, expected):
    args = engine_args(EngineConfig(model="m", device=device), "decode", None)
    assert tuple(args[k] for k in KNOBS) == expected


def test_the_engine_gets_the_knobs_it_was_given():
    cfg = EngineConfig(model="m", device="cuda", enforce_eager=True, block_size=32,
                       max_num_batched_tokens=4096, enable_chunked_prefill=False,
                       dtype="float16", max_num_seqs=128, max_model_len=4096)
    args = engine_args(cfg, "prefill", KVTransferConfig())
    assert tuple(args[k] for k in KNOBS) == ("float16", True, 32, 4096, False, 128, 4096)


def test_cpu_sizes_the_kv_cache_in_bytes_and_cuda_by_memory_share():
    cpu = engine_args(EngineConfig(model="m", kv_cache_bytes=2 << 30), "decode", None)
    assert cpu["kv_cache_memory_bytes"] == 2 << 30 and "gpu_memory_utilization" not in cpu
    cuda = engine_args(EngineConfig(model="m", device="cuda", gpu_memory_utilization=0.8),
                       "decode", None)
    assert cuda["gpu_memory_utilization"] == 0.8 and "kv_cache_memory_bytes" not in cuda


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_vllm_takes_every_argument(device):
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    args = arg_utils.AsyncEngineArgs(**engine_args(EngineConfig(model="m", device=device),
                                                   "decode", KVTransferConfig()))
    assert (args.enforce_eager, args.block_size) == (device == "cpu",
                                                     128 if device == "cpu" else 16)
