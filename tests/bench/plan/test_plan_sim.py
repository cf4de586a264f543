"""The planner's simulator over small hand-made profiles: each figure it yields follows
from the profile's numbers and the scheduler's rules."""
import numpy as np
import pytest

from pdserve.bench.plan.demand import Demand, Turn, arrival_times, chat_sessions
from pdserve.bench.plan.engine import fixed_step_ms
from pdserve.bench.plan.profile import Overheads, Profile
from pdserve.bench.plan.sim import Deployment, simulate

COLOCATED = Deployment("colocated", prefill=0, decode=1, gateway=False)
PD = Deployment("pd", prefill=1, decode=1, local_cached_fraction=1.0)


def profile(prefill_per_token=0.1, fixed=5.0, decode=10.0, transfer=2.0, **kw) -> Profile:
    """Prefill `fixed + per_token x tokens` (uncached tokens), a flat decode step and
    transfer."""
    pre = [{"tokens": t, "cached_fraction": c, "ms": fixed + prefill_per_token * t * (1 - c)}
           for t in (128, 1024, 4096) for c in (0.0, 0.5)]
    dec = [{"batch": b, "context": x, "step_ms": decode} for b in (1, 64) for x in (128, 4096)]
    return Profile(model="hand", device="cpu", prefill=pre, decode=dec,
                   transfer=[{"tokens": 128, "ms": transfer}, {"tokens": 4096, "ms": transfer}],
                   **kw)


def one(prompt: int, output: int) -> Demand:
    return Demand("one", requests=[Turn(prompt, output)], arrivals=[0.0])


def test_a_lone_requests_ttft_is_its_prefill_plus_the_gateways_overheads():
    o = Overheads(edge_request_ms=3.0, edge_token_ms=0.5, router_request_ms=1.5)
    p = profile(overheads=o)
    through_edge = Deployment("colocated", prefill=0, decode=1, gateway=True)
    stock = simulate(p, COLOCATED, one(1024, 4), rate=1).outcomes[0]
    edge = simulate(p, through_edge, one(1024, 4), rate=1).outcomes[0]
    assert stock.ttft_ms == pytest.approx(p.prefill_ms(1024))
    assert edge.ttft_ms == pytest.approx(p.prefill_ms(1024) + 3.0 + 0.5 + 1.5)


def test_a_lone_requests_token_gap_is_one_decode_step():
    p = profile(decode=12.5)
    out = simulate(p, COLOCATED, one(128, 8), rate=1).outcomes[0]
    assert out.max_gap_ms == pytest.approx(12.5)


def test_the_fixed_step_cost_is_the_prefill_curves_intercept():
    assert fixed_step_ms(profile(fixed=5.0, decode=10.0)) == pytest.approx(5.0)
    assert fixed_step_ms(profile(fixed=30.0, decode=10.0)) == pytest.approx(10.0)  # capped


def _short_then_long() -> Demand:
    # the short one is decoding when the long prompt arrives
    return Demand("mix", requests=[Turn(128, 40), Turn(2000, 4)], arrivals=[0.0, 0.1])


def test_a_long_prefill_stalls_a_running_decode_colocated_but_not_disaggregated():
    p = profile(prefill_per_token=0.1, decode=10.0, max_num_batched_tokens=4096)
    colocated = simulate(p, COLOCATED, _short_then_long(), rate=1).outcomes
    pd = simulate(p, PD, _short_then_long(), rate=1).outcomes
    short_colocated = min(colocated, key=lambda o: o.sent_s)
    short_pd = min(pd, key=lambda o: o.sent_s)
    # colocated: the step carrying the 2,000-token prefill lasts ~200 ms more
    assert short_colocated.max_gap_ms >= 0.1 * 2000
    assert short_pd.max_gap_ms < 0.1 * 2000 / 4


def test_chunked_prefill_bounds_the_stall_by_the_step_budget():
    whole = profile(max_num_batched_tokens=4096)
    chunked = profile(max_num_batched_tokens=512)
    gap = {name: min(simulate(p, COLOCATED, _short_then_long(), rate=1).outcomes,
                     key=lambda o: o.sent_s).max_gap_ms
           for name, p in (("whole", whole), ("chunked", chunked))}
    assert gap["chunked"] < gap["whole"] / 3


def test_the_first_token_comes_from_the_prefill_engine_and_the_transfer_delays_the_second():
    p = profile(transfer=50.0, decode=10.0)
    out = simulate(p, PD, one(1024, 3), rate=1).outcomes[0]
    assert out.ttft_ms == pytest.approx(p.prefill_ms(1024) + sum(vars(p.overheads).values()))
    assert out.max_gap_ms >= 50.0 + 10.0   # the KV's trip, then a decode step


def test_goodput_falls_below_the_offered_rate_as_the_rate_rises():
    from pdserve.bench.plan.demand import long_prompts
    p = profile(prefill_per_token=0.1, decode=8.0)
    att = [simulate(p, COLOCATED, long_prompts(80, 1), rate=r, seed=1).attainment(600, 100)
           for r in (0.5, 4.0, 16.0)]
    assert att[0] > att[1] > att[2]


def test_a_sessions_later_turn_reuses_its_cache_on_the_same_engine():
    p = profile(prefill_per_token=0.2, decode=5.0)
    d = chat_sessions(2, seed=0, turns=2, first=2000, later=64, output=4)
    out = sorted(simulate(p, COLOCATED, d, rate=0.01).outcomes, key=lambda o: o.sent_s)
    assert out[1].ttft_ms < out[0].ttft_ms / 3      # most of turn 2 was cached


def test_arrivals_are_vllms_poisson_draws_for_the_seed():
    np.random.seed(7)
    gaps = np.cumsum([np.random.gamma(shape=1.0, scale=1 / 2.0) for _ in range(10)])
    expected = gaps * (10 / 2.0) / gaps[-1]
    assert arrival_times(10, 2.0, 7) == pytest.approx(list(expected))
    assert arrival_times(10, 2.0, 7)[-1] == pytest.approx(5.0)


def test_a_deployment_needs_a_decode_engine():
    with pytest.raises(ValueError, match="decode engine"):
        Deployment("none", prefill=1, decode=0)
