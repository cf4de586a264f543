"""`pdserve chaos` in short: the real stack (2 prefill + 2 decode workers), streaming
load, real workers SIGKILLed and SIGSTOPped; every accepted stream completes with
its uninterrupted text, and nothing leaks. (Full runs: bench/README.md.)"""
from __future__ import annotations

import json
import subprocess
import sys

from support import ROOT


def test_no_stream_is_lost_when_workers_die(model_dir):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "chaos", "--seed", "3", "--duration", "10",
         "--faults", "kill,stop", "--first-fault", "2", "--gap", "3", "--model", str(model_dir),
         "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.stdout.strip(), out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["faults"], r                               # something was broken...
    assert r["streams"] > 0 and r["completed"] == r["streams"], r
    assert (r["lost"], r["duplicated"], r["missing"], r["text_mismatches"]) == (0, 0, 0, 0), r
    assert (r["leaked_blocks"], r["open_leases"]) == (0, 0), r
    assert r["ok"] and out.returncode == 0, out.stderr[-3000:]
