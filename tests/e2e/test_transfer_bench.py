"""`python -m pdserve.bench.kv_transfer`: real NIXL transfers between two processes, checked
block by block, and the figures the contract names."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support import ROOT
from pdserve.bench.engine_run import histogram_quantile
from pdserve.bench.kv_layout import LAYOUTS
from pdserve.bench.kv_pair import Setting, measure


def test_llama_8b_layout_is_128_kib_per_token():
    layout = LAYOUTS["llama-3.1-8b"]
    assert layout.bytes(1024) == 1024 * 128 * 1024
    assert layout.regions * layout.blocks(1024) == 64 * 64       # descriptors for 1k tokens


def test_histogram_quantile_interpolates_within_the_crossing_bucket():
    buckets = [(0.001, 0.0), (0.005, 4.0), (0.01, 10.0), (float("inf"), 10.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.005 + 0.005 * 1 / 6)
    assert histogram_quantile(buckets, 0.2) == pytest.approx(0.001 + 0.004 * 2 / 4)
    with pytest.raises(ValueError):
        histogram_quantile([(1.0, 0.0), (float("inf"), 0.0)], 0.5)


def test_every_way_moves_the_blocks_where_they_belong():
    # measure() spot-checks 64 blocks per way and raises if one arrived wrong.
    seconds = measure(Setting("ucx-default", (("UCX_NET_DEVICES", "lo"),)), LAYOUTS["tiny"],
                      tokens=4096, reps=1)
    assert set(seconds) == {"contiguous", "blocks", "blocks_sequential"}
    assert all(0 < s < 30 for s in seconds.values())


def test_bench_prints_the_contract_fields(stack):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.bench.kv_transfer", "--layout", "tiny", "--tokens", "1024,4096",
         "--reps", "1", "--settings", "ucx-default,ucx-tcp", "--requests", "2",
         "--model", stack.model, "--url", stack.url, "--decode-metrics", stack.decode_metrics,
         "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["bytes"] == LAYOUTS["tiny"].bytes(4096)
    assert result["layout"]["name"] == "tiny"
    for field in ("memcpy_gib_s", "nixl_contiguous_gib_s", "pdserve_gib_s"):
        assert result[field] > 0, field
    assert result["setting"] in ("ucx-default", "ucx-tcp")
    assert [r["tokens"] for r in result["sizes"]] == [1024, 4096]
    # The engines' own figures: real disaggregated requests through `pdserve up`.
    assert result["transfers"] == 2 and result["request_bytes"] > 0
    assert 0 < result["request_ms_p50"] < 1000
