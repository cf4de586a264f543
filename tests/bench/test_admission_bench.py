"""`pdserve bench admission --smoke`: the JSON contract end to end (synthetic engine, router,
two edges sharing it, with and without admission control), and nothing left running
afterwards."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil

from pdserve.bench.admission import Outcome, Settings, figures

ROOT = Path(__file__).resolve().parents[2]
TAG = "PDSERVE_BENCH_ADMISSION_TAG"


def _left_behind(tag: str) -> list[str]:
    """Processes the benchmark started that still run (they carry its tag)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get(TAG) == tag and p.pid != os.getpid():
                found.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_smoke_sheds_with_admission_and_loses_nothing(tmp_path):
    tag = uuid.uuid4().hex
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "admission", "--smoke",
                           "--edges", "2", "--fairness-duration", "2.5", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=100,
                          env={**os.environ, TAG: tag, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)                # stdout is the one JSON object
    assert {"settings", "capacity", "slo", "rates_rps", "overload", "fairness", "targets",
            "command"} <= set(result)
    assert result["settings"]["backend"] == "synthetic" and result["settings"]["edges"] == 2
    # the fairness phases run for --fairness-duration, the overload phases for --duration
    assert result["settings"]["fairness_duration"] == 2.5
    assert result["fairness"]["steady_alone"]["wall_s"] >= 2.5
    assert result["capacity"]["throughput_rps"] > 0
    assert set(result["overload"]) == {"admission", "no_admission"}
    assert {"steady_alone", "with_burst_admission", "with_burst_no_admission",
            "steady_ttft_p99_ratio_admission"} <= set(result["fairness"])

    adm = result["overload"]["admission"]
    # 3x the pool: some are refused, with 503/429 and Retry-After; nothing accepted is lost
    assert adm["completed"] > 0 and sum(adm["rejected"].values()) > 0
    assert adm["accepted"] + sum(adm["rejected"].values()) == adm["offered"]
    assert adm["rejected_with_retry_after"] == sum(adm["rejected"].values())
    assert adm["lost"]["total"] == 0 and adm["completed"] == adm["accepted"]
    assert not adm["other_status"]
    assert adm["queue_wait"]["admitted"] >= adm["completed"]
    assert adm["queue_ms"]["p99"] >= adm["queue_ms"]["p50"] >= 0    # from x-pdserve-queue-ms
    assert sum(adm["rejections_by_reason"].values()) == sum(adm["rejected"].values())
    assert adm["edge_rss_mib"]["peak"] > 0
    burst = result["fairness"]["with_burst_admission"]
    assert burst["lost"]["total"] == 0 and set(burst["tenants"]) == {"steady", "burst"}
    # without admission nothing is refused: everything queues on the engine
    assert sum(result["overload"]["no_admission"]["rejected"].values()) == 0
    assert isinstance(result["targets"]["overload_nothing_accepted_lost"], bool)
    assert not _left_behind(tag)


def test_figures_split_completed_rejected_and_lost():
    st = Settings(max_tokens=4)
    ok = Outcome("steady", status=200, headers_at=0.1, ttft=0.1, e2e=0.4, tokens=4, done=True,
                 finish="length", queue=0.03)
    short = Outcome("steady", status=200, headers_at=0.1, ttft=0.1, e2e=0.2, tokens=2,
                    finish="length")
    shed = Outcome("burst", status=503, headers_at=0.004, retry_after=True)
    limited = Outcome("burst", status=429, headers_at=0.002, retry_after=True)
    gone = Outcome("burst", error="ServerDisconnectedError")
    f = figures([ok, short, shed, limited, gone], st,
                slo={"ttft_p99_ms": 150.0, "tpot_p99_ms": 50.0})
    assert f["offered"] == 5 and f["accepted"] == 2 and f["completed"] == 1
    assert f["rejected"] == {"429": 1, "503": 1} and f["rejected_with_retry_after"] == 2
    assert f["lost"] == {"cut_or_incomplete": 1, "no_response": 1, "total": 2}
    assert f["ttft_ms"]["p50"] == 100.0 and f["tpot_ms"]["p50"] == 100.0
    assert f["rejection_ms"]["p99"] <= 4.0
    assert f["completed_within_slo"] == 0              # TPOT 100 ms > 50 ms
    # the edge's x-pdserve-queue-ms splits the completed request's TTFT
    assert f["queue_ms"]["p50"] == 30.0 and f["ttft_after_queue_ms"]["p50"] == 70.0
