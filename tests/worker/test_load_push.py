"""A worker's KV-event stream carries its load the moment a request ends, not at the
relay's next 0.1 s check (a session's next turn comes sooner than that), even when the
figures read as before (the end itself tells the router its placement is over)."""
from __future__ import annotations

import asyncio
import contextlib
import gc

from smg_grpc_proto.generated import common_pb2

from pdserve.services.worker.load_push import LoadNudges


async def test_a_request_that_ends_sends_the_load_at_once():
    relayed: asyncio.Queue = asyncio.Queue()

    async def batches():
        while True:
            yield await relayed.get()

    running = {"now": 2}
    nudges = LoadNudges()
    stream = nudges.stream(batches(), lambda rank: common_pb2.EngineLoad(
        running_requests=running["now"], max_running_requests=4))
    async with _reading(stream) as got:
        await asyncio.sleep(0.01)
        running["now"] = 1
        nudges.ended()                   # before any batch, not asked for: nothing
        await asyncio.sleep(0.01)
        assert got.empty()
        relayed.put_nowait(common_pb2.KvEventBatch(
            sequence_number=7, load=common_pb2.EngineLoad(running_requests=1, max_running_requests=4,
                                                          sample=3)))
        assert (await asyncio.wait_for(got.get(), 1)).sequence_number == 7
        nudges.ended()                   # the figures have not moved: sent all the same
        same = await asyncio.wait_for(got.get(), 1)
        assert same.load.load_only and same.load.running_requests == 1 and not same.events
        running["now"] = 0
        nudges.ended()
        extra = await asyncio.wait_for(got.get(), 1)
        assert extra.sequence_number == 7 and not extra.events
        assert extra.load.load_only and extra.load.sample == 3
        assert extra.load.running_requests == 0 and extra.load.max_running_requests == 4
        relayed.put_nowait(common_pb2.KvEventBatch(sequence_number=8))
        assert (await asyncio.wait_for(got.get(), 1)).sequence_number == 8   # relayed on


async def test_a_subscriber_that_asks_gets_records_before_the_first_batch_numbered_0():
    """`load_records_before_first_batch`: a request that ends before the publisher's
    first batch (a short prompt fills no block: no event) still reaches the router."""
    async def batches():
        await asyncio.sleep(30)
        yield common_pb2.KvEventBatch()

    for before_first in (True, False):
        nudges = LoadNudges()
        stream = nudges.stream(batches(), lambda rank: common_pb2.EngineLoad(
            running_requests=0, max_running_requests=4), before_first=before_first)
        async with _reading(stream) as got:
            await asyncio.sleep(0.01)
            nudges.ended()
            await asyncio.sleep(0.05)
            if before_first:
                first = got.get_nowait()
                assert first.sequence_number == 0 and first.load.load_only
                assert first.load.max_running_requests == 4 and not first.events
            else:
                assert got.empty()


@contextlib.asynccontextmanager
async def _reading(stream):
    """A queue that `stream`'s batches land in while the block runs."""
    got: asyncio.Queue = asyncio.Queue()

    async def read():
        async for batch in stream:
            got.put_nowait(batch)

    reader = asyncio.create_task(read())
    try:
        yield got
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def test_a_stream_cancelled_on_shutdown_leaves_no_task_with_an_unread_exception():
    """vLLM's relay ends quietly when cancelled (it catches CancelledError and returns),
    so the read it was in ends in StopAsyncIteration: the stream must take that in,
    not leave asyncio to log "Task exception was never retrieved" when it is collected."""
    async def batches():
        try:
            yield common_pb2.KvEventBatch(sequence_number=1)
            await asyncio.sleep(30)
            yield common_pb2.KvEventBatch(sequence_number=2)
        except asyncio.CancelledError:
            pass                          # as smg_grpc_servicer.kv_relay.relay does

    loop = asyncio.get_running_loop()
    unhandled = []
    handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    try:
        stream = LoadNudges().stream(batches(), lambda rank: None)
        async with _reading(stream) as got:
            assert (await asyncio.wait_for(got.get(), 1)).sequence_number == 1
            await asyncio.sleep(0.01)        # the relay's next read is pending
        del stream
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(handler)
    assert not unhandled, [c.get("message") for c in unhandled]
