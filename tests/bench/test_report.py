"""The comparison report: which colocated variant is the baseline, ratios, targets, table."""
from __future__ import annotations

import pytest

from pdserve.bench.cli import format_table
from pdserve.bench.compare import QUICK, report
from pdserve.bench.deployments import Hardware
from pdserve.bench.slo import DEFAULT_MIXES, SLO, parse_slo


def _run(dep: str, itl99: float, ttft99: float, gp: dict, wl="long_prompts", rate=2.0,
         tpot=5.0) -> dict:
    return {"deployment": dep, "workload": wl, "rate": rate, "completed": 40, "failed": 0,
            "itl_p99_ms": itl99, "itl_p50_ms": 5.0, "ttft_p99_ms": ttft99, "ttft_p50_ms": 80.0,
            "tpot_p50_ms": tpot, "goodput": gp, "samples": {"ttft_ms": [], "itl_ms": []}}


def _gp(itl, ttft, bal):
    return {"itl_strict": itl, "ttft_strict": ttft, "balanced": bal}


HW = Hardware("cpu", (0, 1))

RUNS = [
    _run("disaggregated", 10.0, 300.0, _gp(1.8, 0.5, 1.6)),
    _run("conditional", 12.0, 250.0, _gp(1.8, 0.9, 1.7)),
    _run("colocated_1x2", 80.0, 150.0, _gp(0.4, 1.2, 1.5)),
    _run("colocated_2x1", 60.0, 200.0, _gp(0.6, 1.0, 1.4)),
    _run("disaggregated", 9.0, 900.0, _gp(0, 0, 0), wl="random_1024", rate=1.0, tpot=5.5),
    _run("colocated_2x1", 60.0, 90.0, _gp(0, 0, 0), wl="random_1024", rate=1.0, tpot=5.0),
]


def test_baseline_is_the_colocated_variant_with_more_balanced_goodput():
    r = report(RUNS, QUICK, DEFAULT_MIXES, "cmd", HW)
    assert set(r["modes"]) == {"disaggregated", "colocated", "conditional"}
    assert r["modes"]["colocated"]["variant"] == "colocated_1x2"
    assert r["modes"]["colocated"]["itl_p99_ms"] == 80.0
    for mode in r["modes"].values():
        assert set(mode["goodput"]) == set(DEFAULT_MIXES)
        assert {"itl_p99_ms", "ttft_p99_ms"} <= mode.keys()


def test_ratios_and_targets():
    r = report(RUNS, QUICK, DEFAULT_MIXES, "cmd", HW)
    assert r["ratios"]["itl_p99_disaggregated_over_colocated"] == 0.125
    assert r["ratios"]["goodput_itl_strict_disaggregated_over_colocated"] == 4.5
    assert r["targets"]["itl_p99_a_le_half_b"] is True
    assert r["targets"]["goodput_itl_strict_a_ge_1.5x_b"] is True
    # conditional: 1.8 >= max(1.8, 0.4); 0.9 < max(0.5, 1.2); 1.7 >= max(1.6, 1.5)
    assert r["targets"]["goodput_itl_strict_c_ge_best"] is True
    assert r["targets"]["goodput_ttft_strict_c_ge_best"] is False
    assert r["ratios"]["goodput_ttft_strict_conditional_over_best"] == 0.75
    assert r["tpot_check"]["ratio"] == 1.1
    assert r["targets"]["tpot_pdserve_le_1.1x_stock_one_core"] is True
    assert "samples" not in r["runs"][0]


def test_table_prints_every_mode_and_marks_missed_targets():
    text = format_table(report(RUNS, QUICK, DEFAULT_MIXES, "cmd", HW))
    for word in ("disaggregated", "colocated", "conditional", "colocated_1x2", "MISSED", "met"):
        assert word in text


def test_slo_flag_parses_and_rejects_bad_specs():
    assert parse_slo("balanced=ttft:500,itl:80") == ("balanced", SLO(500.0, 80.0))
    for bad in ("balanced=ttft:500", "nope=ttft:1,itl:1", "balanced", "itl_strict=ttft:0,itl:5"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_hardware_splits_units_and_rejects_nonsense():
    assert Hardware("cuda", (0, 1, 2, 3)).halves() == ([0, 1], [2, 3])
    assert Hardware("cpu", (0,)).halves() == ([0], [0])
    for bad in (lambda: Hardware("tpu", (0,)), lambda: Hardware("cpu", ())):
        with pytest.raises(ValueError):
            bad()
