"""A load record on the KV-event stream the moment a request ends.

The servicer's relay stamps the engine's load (running + waiting requests, KV
usage) on every KV-event batch and checks for a change every 0.1 s while no
batch flows. A request that ends publishes no event of its own, so for up to
that tick a router still counts it on its worker; a session's next turn, sent
a few milliseconds after the last token, then found its worker one request too
full and was placed away from its KV (docs/design/2026-12-05-load-pushed-at-request-end.md).

So each subscriber gets a nudge when a Generate call ends, and the stream sends
the current record at once: a `load_only` batch repeating the last batch's
sequence number and record sample, as the relay's own heartbeat does between
batches. By then the engine's figures already leave the request out (the step
that finished it is the one whose output ended the call). Before the publisher's
first batch there is no sequence to repeat: a subscriber that asks for records
then (`load_records_before_first_batch`, as pdserve's router does) gets them
numbered 0, as the protocol has it; any other gets nothing until that batch.

It is sent even when the figures read as before: a request that started and
ended between two of the relay's checks moved nothing it would see, and the end
is still news to a router, which counts each placement on its worker until a
record covers it (services/router/registry.py). Without it such a placement
counted for its full second: a pool fed short requests one after another, all
ended, read one worker busy and sent every next session to the other.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from typing import AsyncIterator, Callable

from smg_grpc_proto.generated import common_pb2

log = logging.getLogger(__name__)


class LoadNudges:
    """One event per open KV-event stream, set when a request ends."""

    def __init__(self) -> None:
        self._streams: set[asyncio.Event] = set()

    def ended(self) -> None:
        for event in self._streams:
            event.set()

    async def stream(self, batches: AsyncIterator[common_pb2.KvEventBatch],
                     record: Callable[[int | None], common_pb2.EngineLoad | None],
                     before_first: bool = False) -> AsyncIterator[common_pb2.KvEventBatch]:
        """`batches` (the relay's), with a load-only batch after each nudge, its
        record from `record(rank)` (the servicer's load source); `before_first`:
        the subscriber takes them before the relay's first batch too."""
        nudged = asyncio.Event()
        self._streams.add(nudged)
        batches = aiter(batches)
        nxt = asyncio.ensure_future(_next(batches))
        nudge = asyncio.ensure_future(nudged.wait())
        last: common_pb2.KvEventBatch | None = None
        try:
            while True:
                await asyncio.wait((nxt, nudge), return_when=asyncio.FIRST_COMPLETED)
                if nxt.done():
                    batch = nxt.result()
                    if batch is None:
                        return
                    if batch.HasField("load"):
                        last = batch
                    yield batch
                    nxt = asyncio.ensure_future(_next(batches))
                if nudge.done():
                    nudged.clear()
                    nudge = asyncio.ensure_future(nudged.wait())
                    extra = _load_only(last, record, before_first)
                    if extra is not None:
                        last = extra
                        yield extra
        finally:
            self._streams.discard(nudged)
            for task in (nxt, nudge):
                task.cancel()
            await asyncio.wait((nxt,))            # the relay's read has stopped
            error = None if nxt.cancelled() else nxt.exception()
            if error is not None and error is not sys.exc_info()[1]:
                log.warning("KV-event relay failed as its stream closed: %r", error)
            with contextlib.suppress(Exception):
                await batches.aclose()


async def _next(batches: AsyncIterator[common_pb2.KvEventBatch]
                ) -> common_pb2.KvEventBatch | None:
    """The relay's next batch, None once it has ended. vLLM's relay ends by returning
    even when cancelled: a task around `anext` then ends in StopAsyncIteration that
    nobody reads once the stream is closing (asyncio logs it, on every shutdown)."""
    try:
        return await anext(batches)
    except StopAsyncIteration:
        return None


def _load_only(last, record, before_first: bool) -> common_pb2.KvEventBatch | None:
    """A load-only batch with the current record, repeating `last`'s sequence and
    sample; before any batch (`last` None) one numbered 0 if `before_first`, else None."""
    if last is None and not before_first:
        return None
    rank = last.dp_rank if last is not None and last.HasField("dp_rank") else None
    current = record(rank)
    if current is None:
        return None
    batch = common_pb2.KvEventBatch(sequence_number=last.sequence_number if last else 0,
                                    timestamp=time.time())
    if rank is not None:
        batch.dp_rank = rank
    batch.load.CopyFrom(current)
    if last is not None:
        batch.load.sample = last.load.sample
    batch.load.load_only = True
    return batch
