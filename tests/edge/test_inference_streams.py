"""The Inference gRPC API's streams: stream ids and event numbers on every chunk,
following a generation from another call, Abort by stream id, cancel = abort."""
from __future__ import annotations

import asyncio

import aiohttp
import grpc
import pytest

from pdserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from pdserve.bench.synthetic import read_stamps
from synthetic_stack import edge_stack


@pytest.fixture
async def stack(model_dir):
    async with edge_stack(model_dir, rate=200.0, stream_resume_seconds=1.0) as s:
        yield s


@pytest.fixture
async def api(stack):
    async with grpc.aio.insecure_channel(stack.inference) as ch:
        yield inference_pb2_grpc.InferenceStub(ch)


def _request(n: int, **kw) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(prompt="hello", sampling=common_pb2.SamplingParams(
        max_tokens=n), **kw)


async def test_chunks_carry_stream_ids_and_a_follower_gets_the_same(api):
    chunks = [c async for c in api.Generate(_request(20))]
    sid = chunks[0].stream_id
    assert sid.startswith("str_") and {c.stream_id for c in chunks} == {sid}
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
    assert len(read_stamps("".join(c.text for c in chunks))) == 20
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    follow = [c async for c in api.Generate(inference_pb2.GenerateRequest(
        follow=inference_pb2.Follow(stream_id=sid, after_seq=5)))]
    assert [(c.seq, c.text) for c in follow] == [(c.seq, c.text) for c in chunks[5:]]


async def test_abort_by_stream_id_and_cancelling_the_call_stop_the_engine(api, stack):
    call = api.Generate(_request(1500))
    first = await call.read()
    assert (await api.Abort(inference_pb2.AbortRequest(stream_id=first.stream_id))).found
    with pytest.raises(grpc.aio.AioRpcError) as e:
        while await call.read() is not grpc.aio.EOF:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED
    await asyncio.sleep(0.05)
    assert stack.engine.running == {}

    call = api.Generate(_request(1500))
    await call.read()
    call.cancel()                       # the caller's own cancel is an explicit cancel
    for _ in range(50):
        if not stack.engine.running:
            break
        await asyncio.sleep(0.01)
    assert stack.engine.running == {}
    assert not (await api.Abort(inference_pb2.AbortRequest(stream_id="str_" + "0" * 32))).found


async def test_following_bad_streams_gets_a_proper_status(api, stack):
    cases = [(inference_pb2.Follow(stream_id="str_" + "1" * 32), grpc.StatusCode.NOT_FOUND)]
    done = [c async for c in api.Generate(_request(3))]
    cases.append((inference_pb2.Follow(stream_id=done[0].stream_id, after_seq=99),
                  grpc.StatusCode.OUT_OF_RANGE))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.url}/v1/completions", json=stack.body(3)) as r:
            sid = r.headers["x-pdserve-stream-id"]
            await r.read()
    cases.append((inference_pb2.Follow(stream_id=sid), grpc.StatusCode.FAILED_PRECONDITION))
    for follow, code in cases:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [c async for c in api.Generate(inference_pb2.GenerateRequest(follow=follow))]
        assert e.value.code() == code, follow
