"""`pdserve bench router`: the simulator runs the real placement and tells policies apart."""
from __future__ import annotations

import json
import subprocess
import sys

from support import ROOT


def test_bench_router_json_compares_policies_on_one_trace():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "router", "--json",
                          "--sessions", "400", "--workers", "4"], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    result = json.loads(out)
    assert result["n_workers"] == 4 and result["decision_p99_us"] > 0
    p = result["policies"]
    assert set(p) == {"pdserve", "round_robin", "least_loaded", "consistent_hash", "oracle"}
    for figures in p.values():
        assert set(figures) >= {"hit_rate", "max_over_mean_load", "moved_fraction_on_leave",
                                "min_worker_share"}
    # Prefix-aware placement keeps most of the cache hits an oracle gets; load-only
    # policies lose them, and move most sessions when a worker leaves.
    assert p["pdserve"]["hit_rate"] >= 0.9 * p["oracle"]["hit_rate"]
    assert p["round_robin"]["hit_rate"] < 0.85 * p["pdserve"]["hit_rate"]
    assert p["pdserve"]["moved_fraction_on_leave"] < 0.6 * p["round_robin"][
        "moved_fraction_on_leave"]
    # The load bound holds where plain consistent hashing piles up.
    assert p["pdserve"]["max_over_mean_load"] <= 1.35
    for name, f in p.items():
        # w0 leaving first is one of the N choices the mean and the worst are over
        assert (f["moved_fraction_mean_over_leavers"] <= f["moved_fraction_worst_leaver"]
                and f["moved_fraction_on_leave"] <= f["moved_fraction_worst_leaver"]), name
        assert f["moved_off_kv_fraction_on_leave"] <= f["moved_fraction_on_leave"], name
    # Unbounded consistent hashing moves only the sessions of the worker that left.
    ch = p["consistent_hash"]
    assert ch["moved_off_kv_fraction_on_leave"] == ch["moved_fraction_on_leave"] > 0
    assert "moved_mean_over_leavers_le_1.1_over_n" in result["targets"]


def test_bench_router_summarises_several_seeds():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "router", "--json",
                          "--sessions", "200", "--workers", "3", "--seed", "4", "--seeds", "2"],
                         cwd=ROOT, check=True, capture_output=True, text=True,
                         timeout=300).stdout
    result = json.loads(out)
    over = result["over_seeds"]
    assert over["seeds"] == [4, 5]
    for name, figures in over["policies"].items():
        for k, (lo, mid, hi) in figures.items():
            assert lo <= mid <= hi, (name, k)
        # seed 4's own figures are the top-level ones, and lie within the range
        for k, v in result["policies"][name].items():
            assert figures[k][0] <= v <= figures[k][2], (name, k)
    assert all(len(met) == 2 and set(met) <= {True, False}
               for met in over["targets_met_by_seed"].values())
    p = result["policies"]["pdserve"]
    assert p["max_over_mean_load_steady"] <= p["max_over_mean_load"]


def test_tenant_salts_cost_only_the_system_prompt_tenants_of_a_group_share():
    """8 tenants in 4 groups: a salt each loses the group's shared system prompt across
    its tenants; salting after the system prompt keeps every hit of one cache for all
    (the rest of each session is its own anyway), and every tenant is reported."""
    from pdserve.bench.router_sim import SimConfig
    from pdserve.bench.tenant_sim import compare_isolation, table

    result = compare_isolation(SimConfig(workers=2, sessions=80, tenants=8))
    modes = result["modes"]
    for policy in ("pdserve", "oracle"):
        none, tenant, shared = (modes[m][policy] for m in ("none", "tenant", "shared"))
        assert tenant["hit_rate"] < none["hit_rate"] == shared["hit_rate"], policy
        assert sorted(none["hit_rate_by_tenant"]) == list(range(8))
    assert "t7" in table(result)
