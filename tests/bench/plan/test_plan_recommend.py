"""`pdserve plan recommend` and `check` without engines: what the planner picks over
hand-made profiles, the trace format, and the command line's errors."""
import json

import pytest

from pdserve.bench.plan import check
from pdserve.bench.plan.candidates import candidates, how_to_run
from pdserve.bench.plan.cli import main
from pdserve.bench.plan.demand import load_trace
from pdserve.bench.plan.profile import Profile
from pdserve.bench.plan.recommend import Setting, Workload, parse_slo, recommend
from pdserve.bench.slo import SLO

from test_plan_sim import profile

ITL_STRICT = {"itl": SLO(ttft_ms=3000, itl_ms=40)}


def _pick(p, slos=ITL_STRICT, rate=3.0) -> str:
    only = [d for d in candidates(2, conditional=False)]
    s = Setting(p, Workload("long_prompts"), requests=40, reps=1, span_s=4)
    return recommend(s, 2, slos, [rate], only=only)["best"]["itl"]["name"]


def test_recommend_disaggregates_when_long_prefills_stall_decodes():
    # a 1,600-token prefill takes ~160 ms: colocated, every decode beside it misses 40 ms
    assert _pick(profile(prefill_per_token=0.1, decode=8.0)).startswith("disaggregated")


def test_recommend_colocates_when_moving_the_kv_costs_more_than_the_stall():
    # a 0.5 s transfer: every disaggregated request's second token is 0.5 s late
    p = profile(prefill_per_token=0.01, decode=8.0, transfer=500.0)
    assert _pick(p, {"itl": SLO(ttft_ms=3000, itl_ms=100)}).startswith("colocated")


def test_candidates_for_two_units_are_the_benchmarks_deployments():
    names = [d.name for d in candidates(2)]
    assert names[:3] == ["colocated_2x1", "colocated_1x2", "disaggregated_1p1d"]
    assert all(n.startswith("conditional_1p1d_") for n in names[3:])
    assert {d.units for d in candidates(8)} == {8}


def test_the_pick_is_printed_as_pdserve_up_flags_and_replica_counts():
    d = next(d for d in candidates(8) if d.name == "conditional_3p5d_below512_sat2")
    run = how_to_run(d, 1)
    assert run["pdserve_up"][2:6] == ["--prefill-workers", "3", "--decode-workers", "5"]
    assert "--local-prefill-below=512" in run["k8s"]["router_args"]
    assert run["k8s"]["pdserve-prefill"] == 3 and run["k8s"]["pdserve-decode"] == 5


def test_a_trace_with_sessions_chains_each_turn_on_the_conversation_before(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in [
        {"t": 0.5, "prompt": 500, "output": 20, "session": "a"},
        {"t": 0.0, "prompt": 100, "output": 10},
        {"t": 9.0, "prompt": 600, "output": 20, "session": "a"}]) + "\n")
    d = load_trace(trace)
    assert d.arrivals == [0.0, 0.5]
    later = d.sessions[1][1]
    assert later.prefixes == (("a-0", 520),)


def test_a_trace_line_without_lengths_is_refused(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"t": 0, "prompt": 10}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_trace(trace)


def test_slo_specs():
    assert parse_slo("ttft_p99=250,itl_p99=40")[1] == SLO(250, 40)
    assert parse_slo("balanced")[1] == SLO(750, 100)
    with pytest.raises(ValueError, match="--slo"):
        parse_slo("ttft=fast")


@pytest.mark.parametrize("args, message", [
    (["--workload", "nope"], "--workload"),
    (["--slo", "itl=3"], "--slo"),
    (["--devices", "0"], "--devices"),
    (["--rate", "2,x"], "--rate"),
    (["--rate", "-1"], "--rate"),
])
def test_recommend_refuses_bad_arguments(tmp_path, capsys, args, message):
    path = tmp_path / "p.json"
    profile().save(path)
    base = {"--profile": str(path), "--workload": "short_chat", "--slo": "itl_strict",
            "--devices": "2"}
    base.update(dict(zip(args[::2], args[1::2])))
    argv = ["recommend", *[x for kv in base.items() for x in kv]]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_recommend_refuses_a_missing_profile(capsys):
    assert main(["recommend", "--profile", "/nonexistent.json", "--workload", "short_chat",
                 "--slo", "balanced", "--devices", "2"]) == 2
    assert "--profile" in capsys.readouterr().err


MIXES = ("itl_strict", "ttft_strict", "balanced")


def _rows(*goodputs: tuple[str, list[float]]) -> dict:
    """A recommend result: each candidate's goodput at each rate (every mix alike)."""
    return {"candidates": [
        {"name": n, "sustained": dict.fromkeys(MIXES, 1.0),
         "at": [{"goodput": dict.fromkeys(MIXES, g), "attainment": dict.fromkeys(MIXES, 0.9)}
                for g in gs]}
        for n, gs in goodputs]}


def test_check_cases_pair_each_pick_with_another_familys_best():
    result = _rows(("colocated_2x1", [1.0]), ("colocated_1x2", [2.0]),
                   ("conditional_1p1d_below512_sat2", [3.0]),
                   ("conditional_1p1d_below256_sat0", [2.9]))
    cases = check.cases_for(result, "long_prompts", 4.0)
    assert {c["recommended"] for c in cases} == {"conditional_1p1d_below512_sat2"}
    assert {c["alternative"] for c in cases} == {"colocated_1x2"}
    assert cases[0]["predicted_goodput"] == 3.0


def test_check_runs_where_the_picks_stand_furthest_from_their_rivals():
    result = _rows(("colocated_2x1", [4.0, 5.0, 6.0]), ("disaggregated_1p1d", [4.0, 5.5, 4.0]))
    by_rate = [check.cases_for(result, "w", r, i) for i, r in enumerate((4, 5, 6))]
    assert check.check_rate(by_rate) == 2               # 6.0 against 5.5's rival 4.0
    for c in by_rate[2]:
        c["predicted_attainment"] = 0.5                 # a pick that cannot keep up there
    assert check.check_rate(by_rate) == 1


def test_a_check_outcome_is_judged_by_the_runs_own_spread():
    assert check.outcome([3.0, 3.2], [3.0, 3.1]) == "won"
    assert check.outcome([3.0, 3.2], [3.2, 3.3]) == "tie"       # 0.15 apart, runs 0.2 apart
    assert check.outcome([3.0, 3.0], [3.5, 3.6]) == "lost"
    assert check.outcome([], [3.0]) is None
    assert check.requests_at("sessions", (2.0, 64), 3.0) == 96
    assert check.requests_at("sessions", (2.0, 64), 2.5) == 80
    assert check.requests_at("short_chat", (8.0, 80), 14.0) == 140


def test_sessions_sustain_a_rate_counted_in_sessions():
    from pdserve.bench.plan.recommend import sustained
    from pdserve.bench.plan.sim import Deployment
    s = Setting(profile(prefill_per_token=0.5, decode=5.0), Workload("sessions"),
                requests=24, reps=1, span_s=5)
    got, _ = sustained(s, Deployment("one", decode=1, gateway=False),
                       {"loose": SLO(ttft_ms=2000, itl_ms=200)})
    assert got["loose"] > 0.1


def test_a_cpu_profiles_serving_step_cost_comes_from_its_measured_decode_leg():
    from pdserve.bench.plan.recommend import host_knobs
    legs = {"overhead_prompt_tokens": 256, "overhead_output_tokens": 32,
            "decode_engine_ms": 32 * 15.0}
    p = profile(decode=10.0, sweep={"legs": legs})
    assert host_knobs(p).serve_step_ms == pytest.approx(15.0 - 10.0 - host_knobs(p).serve_token_ms)
    gpu = Profile.from_json({**profile(decode=10.0, sweep={"legs": legs}).to_json(),
                             "device": "cuda"})
    assert host_knobs(gpu).serve_step_ms == 0.0


def test_a_check_run_accounts_cpu_to_each_kind_of_process_it_started():
    import subprocess
    import sys
    import time

    import psutil
    busy = ("import time\nend = time.process_time() + 0.5\n"
            "while time.process_time() < end: pass\ntime.sleep(30)")
    before = check.cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", busy, "router"])
    try:
        deadline = time.monotonic() + 20
        while sum(psutil.Process(child.pid).cpu_times()[:2]) < 0.5:
            assert time.monotonic() < deadline, "the child never spent its CPU"
            time.sleep(0.05)
        during = check.cpu_seconds()
    finally:
        child.kill()
        child.wait(timeout=30)
    assert during.get("router", 0.0) >= 0.5 > before.get("router", 0.0)
    assert during["client"] >= before["client"] > 0
