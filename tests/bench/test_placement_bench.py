"""`pdserve bench placement`: the router's decision timed in C and in Python, each
path in a process that runs it, at every offered rate (tiny sizes: a smoke test)."""
from __future__ import annotations

import json
import subprocess
import sys

from support import ROOT


def test_bench_placement_times_the_c_and_the_python_decision_at_each_rate():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "placement", "--json",
                          "--workers", "3", "--prefixes", "20", "--prompt-tokens", "200",
                          "--rates", "2000,5000", "--seconds", "0.05"],
                         cwd=ROOT, check=True, capture_output=True, text=True, timeout=60).stdout
    result = json.loads(out)
    assert result["command"].startswith("pdserve bench placement --json")
    runs = result["runs"]
    assert {path: run["native"] for path, run in runs.items()} == {"c": "c", "python": "python"}
    # The same state either way: every prefix reported, as KV events, to the index.
    assert runs["c"]["keys"] == runs["python"]["keys"] > 0
    for run in runs.values():
        assert [r["rate"] for r in run["rates"]] == [2000, 5000]
        for r in run["rates"]:
            assert r["decisions"] == int(r["rate"] * 0.05)
            assert 0 < r["p50_us"] <= r["p99_us"] and r["cpu_us_mean"] > 0
            assert abs(r["core_share"] - r["rate"] * r["cpu_us_mean"] / 1e6) < 1e-3


def test_bench_placement_refuses_a_prompt_shorter_than_a_cached_prefix():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "placement",
                          "--prompt-tokens", "10"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "prompt_tokens must hold a whole cached prefix" in out.stderr
