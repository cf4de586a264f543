"""A worker's drain waits for its Generate calls, up to its limit or a second signal."""
from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time
from types import SimpleNamespace

from pdserve.lifecycle import until_signalled
from pdserve.services.worker.main import drain


async def _finish_later(servicer, after: float) -> None:
    await asyncio.sleep(after)
    servicer.in_flight = 0


async def test_drain_ends_when_the_last_call_does(caplog):
    servicer = SimpleNamespace(in_flight=2)
    finishing = asyncio.create_task(_finish_later(servicer, 0.3))
    started = time.monotonic()
    with caplog.at_level(logging.INFO):
        await drain(servicer, 10, asyncio.get_running_loop().create_future(), "decode worker d")
    assert 0.25 < time.monotonic() - started < 2
    await finishing
    assert "decode worker d draining: 2 Generate calls in flight (up to 10 s)" in caplog.text
    assert "decode worker d drained in 0." in caplog.text


async def test_drain_is_cut_short_by_its_limit(caplog):
    started = time.monotonic()
    await drain(SimpleNamespace(in_flight=1), 0.3, asyncio.get_running_loop().create_future(),
                "decode worker d")
    assert 0.25 < time.monotonic() - started < 2
    assert re.search(r"decode worker d: drain cut short after 0\.\d s with 1 Generate calls "
                     r"still running", caplog.text)


async def test_drain_is_cut_short_by_a_second_signal():
    again = asyncio.create_task(until_signalled())
    await asyncio.sleep(0)                       # its handlers are in place
    asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
    started = time.monotonic()
    await drain(SimpleNamespace(in_flight=1), 30, again, "decode worker d")
    assert time.monotonic() - started < 5
    assert again.result() == signal.SIGTERM
