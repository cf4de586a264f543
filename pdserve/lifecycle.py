"""Process lifecycle: every pdserve process stops the same way on SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import signal


async def until_signalled() -> int:
    """Wait for SIGINT or SIGTERM; returns the signal number."""
    got: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda s=sig: got.done() or got.set_result(s))
    try:
        return await got
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
