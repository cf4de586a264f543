"""`pdserve up` keeps its children alive: when a dead one comes back, and when it gives up."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from pdserve.supervisor import (BACKOFF_CAP_S, HEALTHY_AFTER_S, Children, CrashLoop,
                                RestartPolicy, _stop)


def _deaths(policy: RestartPolicy, name: str, times: list[float]) -> list[float | None]:
    """The waits `policy` gives a child that dies at `times`, restarted each time
    as soon as its wait is over."""
    waits = []
    policy.started(name, 0.0)
    for t in times:
        wait = policy.died(name, t)
        waits.append(wait)
        if wait is not None:
            policy.started(name, t + wait)
    return waits


def test_backoff_doubles_to_its_cap():
    policy = RestartPolicy(limit=100, window=300)
    times = [float(t) for t in range(0, 90, 10)]         # dies 10 s after every start or so
    assert _deaths(policy, "router", times) == [0.5, 1, 2, 4, 8, 10, 10, 10, 10]
    assert max(policy.backoff.values()) == BACKOFF_CAP_S


def test_a_crash_loop_is_given_up_on_and_counted_per_child():
    policy = RestartPolicy(limit=5, window=300)
    assert _deaths(policy, "edge", [1, 2, 4, 8, 16, 32]) == [0.5, 1, 2, 4, 8, None]
    assert len(policy.deaths["edge"]) == 6
    assert policy.died("decode-0", 32) == 0.5             # another child starts afresh


def test_deaths_outside_the_window_do_not_count():
    policy = RestartPolicy(limit=2, window=100)
    # Never two deaths within 100 s (nor a minute up between them): no crash loop.
    assert _deaths(policy, "prefill-0", [10, 60, 110, 160]) == [0.5, 1, 2, 4]
    assert policy.deaths["prefill-0"] == [110, 160]


def test_a_child_that_stayed_up_starts_its_backoff_afresh():
    policy = RestartPolicy(limit=100, window=1000)
    assert _deaths(policy, "decode-0", [1, 2, 4]) == [0.5, 1, 2]
    # Restarted at 6; up for a minute before it dies again: back to the first wait.
    assert policy.died("decode-0", 6 + HEALTHY_AFTER_S) == 0.5
    policy.started("decode-0", 6.5 + HEALTHY_AFTER_S)
    assert policy.died("decode-0", 7 + HEALTHY_AFTER_S) == 1


def _python(code: str) -> tuple[list[str], dict]:
    return [sys.executable, "-c", code], {}


def _watch_until(children: Children, done, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "nothing happened in time"
        children.watch(time.monotonic())
        time.sleep(0.02)


def test_a_killed_child_comes_back_while_the_others_are_watched(capfd):
    """Real processes: SIGKILL one child; it is started again after its wait, and
    during that wait a second child's death is noticed too."""
    sleeper = _python("import time; time.sleep(60)")
    children = Children({"router": sleeper, "decode-0": sleeper, "edge": sleeper})
    try:
        now = time.monotonic()
        for name in children.commands:
            children.start(name, now)
        children.policy.backoff["router"] = 2.0             # as after two earlier deaths
        router, edge = children.procs["router"].pid, children.procs["edge"].pid
        os.kill(router, signal.SIGKILL)
        _watch_until(children, lambda: "router" in children.due)
        os.kill(edge, signal.SIGKILL)                          # while the router waits
        _watch_until(children, lambda: children.procs["edge"].pid != edge)
        assert "router" in children.due                        # still waiting its 2 s
        _watch_until(children, lambda: children.procs["router"].pid != router)
        assert all(p.running() for p in children.procs.values())
    finally:
        _stop(children.procs, grace=5)
    err = capfd.readouterr().err
    assert "pdserve: router exited (code -9); restarting it in 2 s" in err
    assert "pdserve: edge exited (code -9); restarting it in 0.5 s" in err
    assert not any(p.running() for p in children.procs.values())


def test_a_child_that_keeps_dying_stops_the_stack_loudly():
    children = Children({"decode-0": _python("raise SystemExit(3)"),
                         "edge": _python("import time; time.sleep(60)")},
                        RestartPolicy(limit=2, window=60))
    children.policy.backoff["decode-0"] = 0.05                # no need to wait in a test
    try:
        now = time.monotonic()
        for name in children.commands:
            children.start(name, now)
        with pytest.raises(CrashLoop) as e:
            _watch_until(children, lambda: False)
    finally:
        _stop(children.procs, grace=5)
    assert str(e.value) == ("pdserve: decode-0 exited (code 3), its 3 deaths in 60 s are a "
                            "crash loop; stopping the stack")
