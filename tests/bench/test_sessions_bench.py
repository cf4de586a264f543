"""The pieces of `pdserve bench sessions` that need no engines."""
from __future__ import annotations

from pdserve.bench.sessions import _figures, _targets, conversations, table


def test_conversations_share_system_prompts_and_are_reproducible():
    convs = conversations(12, 4, seed=3)
    assert convs == conversations(12, 4, seed=3)
    assert conversations(12, 4, seed=4) != convs
    assert len({c.key for c in convs}) == 12
    assert 1 < len({c.system for c in convs}) <= 3           # shared among sessions
    assert all(len(c.messages) == 4 for c in convs)
    assert all(len(c.messages[0]) > 3 * len(c.messages[1]) for c in convs)


def test_figures_count_failures_and_the_decode_hit_rate():
    runs = [{"first": [100.0, None], "later": [20.0, 30.0, 40.0]}]
    f = _figures(runs, hits=300.0, queries=400.0)
    assert f["turns"] == 4 and f["failed"] == 1
    assert f["decode_prefix_hit_rate"] == 0.75
    assert f["first_turns_ttft_p50_ms"] == 100.0 and f["later_turns_ttft_p50_ms"] == 30.0


def test_targets_compare_pdserve_with_the_best_smg_policy():
    g = lambda hit, p50, p99: {"decode_prefix_hit_rate": hit, "ttft_p50_ms": p50,  # noqa: E731
                               "ttft_p99_ms": p99, "later_turns_ttft_p50_ms": p50,
                               "failed": 0}
    out = {"pdserve": g(0.8, 50, 90), "smg_cache_aware": g(0.7, 60, 80),
           "smg_consistent_hashing": g(0.9, 70, 100)}
    assert _targets(out) == {"decode_hit_rate_ge_best_smg": False,
                             "ttft_p50_le_best_smg": True, "ttft_p99_le_best_smg": False}
    text = table({"workload": "w", "gateways": out, "targets": _targets(out)})
    assert "smg_consistent_hashing" in text and "MISSED" in text
