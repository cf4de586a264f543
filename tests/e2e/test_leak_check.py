"""`python -m pdserve.bench.leak_check` against the running stack: requests cut off by the
client at random moments leave no lease and no KV block behind."""
from __future__ import annotations

import json
import subprocess
import sys

from support import ROOT


def test_cancelled_requests_leave_no_lease_and_no_block_behind(stack):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.bench.leak_check", "--requests", "24", "--concurrency", "4",
         "--cancel", "0.5", "--seed", "3", "--model", stack.model, "--url", stack.url,
         "--prefill", stack.prefill, "--prefill-metrics", stack.prefill_metrics,
         "--decode-metrics", stack.decode_metrics, "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["ok"] and result["leases_ended_once"] and result["kv_usage_back_to_idle"]
    cut = result["cut before the response"] + result["cut while streaming"]
    assert result["completed"] + cut == 24 and cut > 0
    leases = result["leases"]
    # Every request that got as far as a prefill opened one lease; the completed
    # ones were all pulled.
    assert leases["released"] >= result["completed"]
    assert leases["opened"] == leases["released"] + leases["aborted"] + leases["expired"]
