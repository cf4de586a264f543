"""`--decode-calls batched`: the edge reads every generation on a worker through one
shared `BatchedGenerate` call. Synthetic decode engines behind a real router, real
HTTP clients; the streams must be those of per-request calls, and the call must
really carry many streams' outputs per message. (Real engines:
tests/e2e/test_batched_decode.py.)"""
from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp

from pdserve.bench.synthetic import read_stamps
from support import assert_logged_in_order, parse_sse
from synthetic_stack import edge_stack


async def _stream(http, stack, max_tokens: int,
                  check_order: bool = False) -> list[tuple[int | None, str]]:
    """The events of a stream (OpenAI's framing: no ids); `check_order`: and they are
    the stream log's, each once and in order."""
    async with http.post(f"{stack.url}/v1/completions", json=stack.body(max_tokens)) as r:
        assert r.status == 200, await r.text()
        sid = r.headers["x-pdserve-stream-id"]
        events = parse_sse(await r.text())
    if check_order:
        await assert_logged_in_order(http, stack.url, sid, events)
    return events


def _texts(events) -> str:
    chunks = [json.loads(d) for _, d in events if d != "[DONE]"]
    assert not [c for c in chunks if "error" in c], chunks
    return "".join(c["choices"][0]["text"] for c in chunks)


async def test_concurrent_streams_share_one_call_and_its_messages(model_dir):
    async with edge_stack(model_dir, rate=50.0, decode_calls="batched") as stack:
        async with aiohttp.ClientSession() as http:
            streams = await asyncio.gather(*(_stream(http, stack, 30, check_order=True)
                                             for _ in range(40)))
        batched = stack.engine.batched
        for events in streams:
            assert events[-1][1] == "[DONE]"
            assert len(_texts(events).split()) == 30          # one stamp per token
        assert batched.calls == 1                             # one call for all 40
        # Every chunk and every end went through it: a stream's last chunk, its final
        # response and its end, produced in one turn, always share a message; chunks of
        # streams that coincide do too.
        assert batched.outputs == 40 * (30 + 1 + 1)
        assert batched.messages <= batched.outputs - 2 * 40, (batched.messages, batched.outputs)
        # Outputs the call's reader takes itself (LegCall._steady) are counted
        # as the stream's task counts them: a gap for every output after the first.
        itl = stack.metrics.itl.labels(stack.model, "local")
        assert sum(b.get() for b in itl._buckets) == 40 * 29


async def test_a_deleted_stream_stops_on_the_engine_at_once(model_dir):
    async with edge_stack(model_dir, rate=20.0, decode_calls="batched") as stack:
        async with aiohttp.ClientSession() as http:
            r = await http.post(f"{stack.url}/v1/completions", json=stack.body(400))
            sid = r.headers["x-pdserve-stream-id"]
            await r.content.readuntil(b"\n\n")
            assert stack.engine.running
            cancelled = time.monotonic()
            async with http.delete(f"{stack.url}/v1/streams/{sid}") as d:
                assert d.status == 200
            while stack.engine.running and time.monotonic() - cancelled < 2:
                await asyncio.sleep(0.005)
            assert not stack.engine.running
            assert time.monotonic() - cancelled < 0.1
            r.close()


async def test_a_dead_worker_moves_every_generation_on_its_call(model_dir):
    """The shared call breaking is each generation's call breaking: all move, none is lost."""
    async with edge_stack(model_dir, rate=50.0, engines=2, decode_calls="batched") as stack:
        async with aiohttp.ClientSession() as http:
            tasks = [asyncio.create_task(_stream(http, stack, 100, check_order=True))
                     for _ in range(6)]
            while sum(len(e.running) for e, _ in stack.engines) < 6:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            victim = max(range(2), key=lambda i: len(stack.engines[i][0].running))
            moved = len(stack.engines[victim][0].running)
            await stack.engines[victim][1].stop(0)             # the worker is gone
            streams = await asyncio.gather(*tasks)
        for events in streams:
            assert events[-1][1] == "[DONE]"
            stamps = read_stamps(_texts(events))               # send times: none repeated
            assert stamps == sorted(set(stamps)) and len(stamps) > 50
        survivor = stack.engines[1 - victim][0]
        assert moved and sum(rid.endswith("-m1") for rid in survivor.requests) == moved


async def test_a_stock_worker_gets_per_request_calls(model_dir):
    async with edge_stack(model_dir, rate=100.0, stock_engines=True,
                          decode_calls="batched") as stack:
        async with aiohttp.ClientSession() as http:
            events = await _stream(http, stack, 10)
        assert len(_texts(events).split()) == 10
        assert stack.engine.batched is None


async def test_the_first_legs_on_a_worker_get_calls_of_their_own(model_dir):
    """Below `batch_from` open legs a leg gets its own Generate call (cheaper alone);
    from then on new legs share the worker's call."""
    async with edge_stack(model_dir, rate=50.0, batch_from=3, decode_calls="batched") as stack:
        async with aiohttp.ClientSession() as http:
            alone = await _stream(http, stack, 10)
            assert stack.engine.batched.calls == 0              # one leg: a call of its own
            streams = [asyncio.create_task(_stream(http, stack, 40)) for _ in range(3)]
            while len(stack.engine.running) < 3:
                await asyncio.sleep(0.01)
            late = await asyncio.gather(*(_stream(http, stack, 10) for _ in range(4)))
            early = await asyncio.gather(*streams)
        for events in [alone, *early, *late]:
            assert events[-1][1] == "[DONE]" and len(_texts(events).split()) in (10, 40)
        assert stack.engine.batched.calls == 1
        assert stack.engine.batched.outputs == 4 * (10 + 1 + 1)   # the four late legs only


async def test_a_leg_hands_outputs_to_its_sink_only_in_order():
    """BatchedLeg.sink takes an output only while the reader waits with nothing queued;
    an output it declines, or any output behind a queued one, goes to the reader; a
    sink that fails ends its own leg (INTERNAL), not the shared call."""
    import grpc
    from smg_grpc_proto import vllm_engine_pb2

    from pdserve.services.edge.batched import BatchedLeg

    class Call:
        legs, aborted = {}, []

        def abort(self, rid):
            self.aborted.append(rid)

    def out(i: int):
        return vllm_engine_pb2.GenerateResponse(
            chunk=vllm_engine_pb2.GenerateStreamChunk(token_ids=[i]))

    taken, call = [], Call()
    leg = BatchedLeg(call, "r1")
    leg.sink = lambda resp: resp.chunk.token_ids[0] % 2 == 0 and not taken.append(resp)
    leg._push(out(0))                   # the reader is not waiting yet: queued
    assert [r.chunk.token_ids[0] for r in [await leg.__anext__()]] == [0] and not taken
    reading = asyncio.ensure_future(leg.__anext__())
    await asyncio.sleep(0)
    leg._push(out(2))                   # taken by the sink; the reader sleeps on
    leg._push(out(3))                   # declined: the reader gets it
    leg._push(out(4))                   # queued behind 3: not the sink's
    assert [r.chunk.token_ids[0] for r in taken] == [2]
    assert (await reading).chunk.token_ids[0] == 3
    assert (await leg.__anext__()).chunk.token_ids[0] == 4
    reading = asyncio.ensure_future(leg.__anext__())
    await asyncio.sleep(0)
    leg.sink = lambda resp: 1 / 0
    leg._push(out(6))
    try:
        await reading
        raise AssertionError("the leg should have failed")
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.INTERNAL
    assert call.aborted == ["r1"]


def test_a_small_receive_window_makes_a_lagging_reader_fewer_larger_messages(model_dir):
    """`--decode-window-bytes`: with the window fixed small, a worker whose edge stops
    reading stops writing, and the outputs it makes meanwhile come in a few large
    messages once the edge reads again; with gRPC's own window it keeps writing a
    message per turn, and the edge pays a loop turn for each. Same outputs either way."""
    from smg_grpc_proto import vllm_engine_pb2

    from pdserve.rpc import channel
    from pdserve.v1 import common_pb2
    from pdserve.services.edge.batched import BatchedCalls
    from pdserve.services.edge.engine_requests import decode_request
    from support import Proc, free_port

    port = free_port()
    worker = Proc([sys.executable, "-m", "pdserve.bench.synthetic", "--model", str(model_dir),
                   "--port", str(port), "--rate", "200"], name="synthetic worker")

    async def lag(window: int) -> tuple[int, int]:
        """40 streams of 100 tokens (0.5 s at 200/s), the reader's loop blocked for
        0.6 s meanwhile: (messages read, outputs read)."""
        calls = BatchedCalls(channel(f"127.0.0.1:{port}", window), batch_from=0)
        sampling = common_pb2.SamplingParams(max_tokens=100)
        legs = [calls.Generate(decode_request(f"w{window}-{i}", [1, 2, 3], sampling, None))
                for i in range(40)]
        await asyncio.sleep(0.05)                       # the requests are out
        time.sleep(0.6)                                 # the edge's loop, busy elsewhere
        outputs = 0
        for leg in legs:
            async for out in leg:
                outputs += isinstance(out, vllm_engine_pb2.GenerateResponse)
        messages = calls.messages_read
        await calls.close()
        return messages, outputs

    try:
        worker.wait_listening(port, timeout=60)
        small, default = asyncio.run(lag(4096)), asyncio.run(lag(0))
    finally:
        worker.stop()
    assert small[1] == default[1] >= 40 * 100           # every token, both ways
    assert small[0] * 2 <= default[0], (small, default)


def test_a_message_larger_than_the_window_arrives_whole():
    """`pdserve bench window`: a 30 KB message through an 8 KB window is read whole
    (the reader opens the window for it), each of 20, and the bench says how long."""
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "window",
                          "--sizes", "30000", "--windows", "8192", "--messages", "20"], cwd=root,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(r"message\s+30000 B, window\s+8192: p50 (\d+) us, p90 (\d+) us", out.stdout)
    assert m and 0 < int(m.group(1)) <= int(m.group(2)) < 1_000_000, out.stdout
