"""`pdserve chaos`'s arguments. Its run (load, faults, the checks) is tested on the
decode pool's stack: tests/e2e/test_decode_pool.py."""
from __future__ import annotations

import pytest

from pdserve.bench import chaos


@pytest.mark.parametrize("argv", [["--faults", "kill,bogus"], ["--duration", "0"],
                                  ["--concurrency", "0"], ["--prompts", "0"]])
def test_bad_arguments_exit_2_before_anything_starts(argv, capsys):
    assert chaos.main(argv) == 2
    assert "pdserve chaos: bad arguments" in capsys.readouterr().err


def test_a_run_passes_only_when_nothing_was_lost_changed_or_left_behind():
    clean = {"lost": 0, "duplicated": 0, "missing": 0, "text_mismatches": 0,
             "leaked_blocks": 0, "open_leases": 0, "streams": 5}
    assert chaos.passed(clean)
    for key in ("lost", "duplicated", "missing", "text_mismatches", "leaked_blocks",
                "open_leases"):
        assert not chaos.passed(clean | {key: 1}), key
    assert not chaos.passed(clean | {"streams": 0})
