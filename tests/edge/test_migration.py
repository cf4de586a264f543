"""A decode worker that dies or stalls mid-stream does not end the stream: the edge
moves the generation to another decode worker, resuming from the tokens already
sent. Two synthetic decode engines behind a real router; real HTTP clients.
(tests/e2e/test_migration_text.py shows the text is unchanged on real engines.)"""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from support import assert_logged_in_order, parse_sse
from synthetic_stack import edge_stack


@pytest.fixture(params=["per-request", "batched"])
def decode_calls(request) -> str:
    """Each case on a call per leg, and on the workers' shared batched call."""
    return request.param


def _running(stack) -> list[int]:
    """Indexes of the engines with a request running."""
    return [i for i, (engine, _) in enumerate(stack.engines) if engine.running]


async def _read_events(resp) -> list[tuple[int | None, str, float]]:
    """(id, data, arrival time) per SSE event until the stream ends."""
    events, buf = [], ""
    async for raw in resp.content.iter_any():
        buf += raw.decode()
        *blocks, buf = buf.split("\n\n")
        for ident, data in parse_sse("\n\n".join(blocks)):
            events.append((ident, data, time.monotonic()))
    return events


async def _stream_with_fault(stack, fault, max_tokens: int = 40, after_events: int = 5,
                             headers: dict | None = None):
    """Start a stream, apply `fault(engine index)` to the engine serving it once
    `after_events` events arrived; return (events, the faulted index, fault time).
    The events (OpenAI's framing, no ids) are checked to be the stream log's, each once
    and in order: no gap or repeat across the move."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.url}/v1/completions", json=stack.body(max_tokens),
                             headers=headers or {}) as r:
            assert r.status == 200, await r.text()
            sid = r.headers["x-pdserve-stream-id"]
            events, buf, faulted, at = [], "", None, None
            async for raw in r.content.iter_any():
                buf += raw.decode()
                *blocks, buf = buf.split("\n\n")
                for ident, data in parse_sse("\n\n".join(blocks)):
                    events.append((ident, data, time.monotonic()))
                if faulted is None and len(events) >= after_events:
                    [faulted] = _running(stack)
                    at = time.monotonic()
                    await fault(faulted)
        await assert_logged_in_order(http, stack.url, sid, [(i, d) for i, d, _ in events])
    return events, faulted, at


def _check_whole(events, max_tokens_chunks: bool = True) -> list[dict]:
    """No error, a finish chunk and [DONE] (the events are the log's, each once and in
    order: `_stream_with_fault`)."""
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d, _ in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    return chunks


def _migrations(stack) -> float:
    return stack.metrics.migrations.labels(stack.model)._value.get()


async def test_a_dead_decode_worker_hands_the_stream_on(model_dir, decode_calls):
    async with edge_stack(model_dir, decode_calls=decode_calls, rate=50.0, engines=2) as stack:
        async def kill(i):
            await stack.engines[i][1].stop(0)      # the server goes; its calls fail
        events, dead, _ = await _stream_with_fault(stack, kill)
        _check_whole(events)
        other = stack.engines[1 - dead][0]
        [(rid, (prompt, max_tokens))] = [(r, v) for r, v in other.requests.items()]
        # The new leg resumes from the prompt plus every token already sent, asking
        # only for the rest.
        [(first_rid, (first_prompt, _))] = list(stack.engines[dead][0].requests.items())
        assert rid == f"{first_rid}-m1"
        sent = prompt[len(first_prompt):]
        assert prompt[:len(first_prompt)] == first_prompt and sent
        assert max_tokens == 40 - len(sent)
        assert _migrations(stack) == 1


async def test_a_stalled_decode_worker_is_left_within_its_deadline(model_dir, decode_calls):
    async with edge_stack(model_dir, decode_calls=decode_calls,
                          rate=50.0, engines=2, decode_stall_seconds=0.5) as stack:
        async def freeze(i):
            stack.engines[i][0].freeze()           # calls stay open, nothing is sent
        events, frozen, at = await _stream_with_fault(stack, freeze)
        _check_whole(events)
        after = [t for _, _, t in events if t > at]
        assert after and after[0] - at < 1.5, f"{after[0] - at:.2f} s to continue"
        # The frozen worker was told to drop the request, not left holding it.
        assert not stack.engines[frozen][0].running
        assert _migrations(stack) == 1


async def test_the_only_decode_worker_takes_the_rest_once_its_exclusion_passes(
        model_dir, decode_calls):
    """A pool of one: the worker stalls for a moment, the generation is moved off it and
    waits; once the failed worker's exclusion window has passed it is placed there again
    (before, the exclusion was fixed when the wait began, and the stream failed when the
    wait ran out)."""
    async with edge_stack(model_dir, decode_calls=decode_calls,
                          rate=50.0, engines=1, decode_stall_seconds=0.5,
                          decode_exclude_seconds=1.0, decode_place_wait_seconds=8.0) as stack:

        async def hiccup(i):
            stack.engines[i][0].freeze()
            asyncio.get_running_loop().call_later(0.8, stack.engines[i][0].thaw)
        events, _, at = await _stream_with_fault(stack, hiccup)
        _check_whole(events)
        after = [t for _, _, t in events if t > at]
        # stalled at 0.5 s, excluded until 1.0 s after that: back on it well before 8 s
        assert 1.2 < after[0] - at < 4.0, f"{after[0] - at:.2f} s to continue"
        assert _migrations(stack) == 1
        assert len(stack.engine.requests) == 2      # the first leg, then the rest, one worker


async def test_moves_are_bounded(model_dir, decode_calls):
    async with edge_stack(model_dir, decode_calls=decode_calls,
                          rate=50.0, engines=2, max_migrations=0) as stack:
        async def kill(i):
            await stack.engines[i][1].stop(0)
        events, _, _ = await _stream_with_fault(stack, kill)
        assert events[-1][1] == "[DONE]"
        error = json.loads(events[-2][1])["error"]
        assert error["type"] == "service_unavailable" and "moved 0 times" in error["message"]


async def test_the_request_budget_ends_it_everywhere(model_dir, decode_calls):
    async with edge_stack(model_dir, decode_calls=decode_calls, rate=20.0, engines=1) as stack:
        async with aiohttp.ClientSession() as http:
            started = time.monotonic()
            async with http.post(f"{stack.url}/v1/completions", json=stack.body(100),
                                 headers={"x-pdserve-timeout-ms": "400"}) as r:
                assert r.status == 200
                events = await _read_events(r)
            assert time.monotonic() - started < 2.0
            error = json.loads(events[-2][1])["error"]
            assert error["code"] == "deadline_exceeded"
            await asyncio.sleep(0.1)
            assert not stack.engine.running         # the engine dropped it too
            body = stack.body(100) | {"stream": False}
            async with http.post(f"{stack.url}/v1/completions", json=body,
                                 headers={"x-pdserve-timeout-ms": "300"}) as r:
                assert r.status == 504
                assert (await r.json())["error"]["code"] == "deadline_exceeded"
            async with http.post(f"{stack.url}/v1/completions", json=body,
                                 headers={"x-pdserve-timeout-ms": "soon"}) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "x-pdserve-timeout-ms"


async def test_a_stream_the_edge_reads_late_is_not_moved_while_its_worker_talks(model_dir,
                                                                                decode_calls):
    """An overloaded edge reads some streams seconds late. A leg it has not read for
    longer than the stall deadline, on a worker whose other legs keep talking, is the
    edge's delay, not a stall: it must not be moved (or cut short)."""
    from pdserve.v1 import common_pb2
    from pdserve.services.edge.app import ORCH
    from pdserve.services.edge.generation import Generation

    async with edge_stack(model_dir, decode_calls=decode_calls,
                          rate=50.0, decode_stall_seconds=0.3) as stack:
        orch = stack.app[ORCH]

        async def start(rid: str, max_tokens: int):
            return await orch.start(Generation(
                request_id=rid, model=stack.model, prompt_token_ids=[1, 2, 3],
                sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        talker, late = await start("talker", 60), await start("late", 20)

        async def read(stream, pause_after: int = 0):
            chunks = stream.chunks()
            n = 0
            async for chunk in chunks:
                n += len(chunk.token_ids) and 1
                if n == pause_after:
                    await asyncio.sleep(1.0)        # the edge is busy elsewhere: 3x the deadline
            return n
        read_talker = asyncio.create_task(read(talker))
        assert await read(late, pause_after=3) == 20
        assert late.stats.migrations == [] and late.finish_reason == "length"
        await read_talker
        # A worker silent on every leg is still left within the deadline (see the freeze test).
