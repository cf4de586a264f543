"""A leg whose prefill sampled the first token sends it before the decode engine
answers (its call started just before, so that the handover begins at once), and
asks the decode engine for what follows it (the prompt plus that token, the rest
of max_tokens). A fake engine stub behind the decode leg; the
real path, on vLLM engines and NIXL: tests/e2e/test_disaggregated_path.py."""
from __future__ import annotations

import asyncio

import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb

from pdserve.config import EdgeConfig
from pdserve.v1 import common_pb2
from pdserve.services.edge.detokenizer import StopRule, TextStream
from pdserve.services.edge.generation import Generation
from pdserve.services.edge.generation_stream import GenerationStream
from pdserve.services.edge.leg import DecodeLeg
from pdserve.services.edge.stats import GenerationStats, Placed

EOS = 3
PROMPT = [100, 200, 300, 400, 500]


class _Call:
    """A streaming Generate call answering `tokens` one chunk each, then complete."""

    def __init__(self, engine: "_Engine", tokens: list[int], cached: int):
        self.engine = engine
        self.responses = [pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
            token_ids=[t], cached_tokens=cached)) for t in tokens]
        self.responses.append(pb.GenerateResponse(complete=pb.GenerateComplete(
            finish_reason="length")))

    def cancel(self) -> bool:
        return False

    async def __aiter__(self):
        for resp in self.responses:
            await asyncio.sleep(0)
            self.engine.read += 1
            yield resp


class _Engine:
    """The decode worker's stub: records each Generate request; Abort is a no-op."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.requests: list[pb.GenerateRequest] = []
        self.read = 0                       # responses the edge has read

    def Generate(self, req, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        self.requests.append(req)
        return _Call(self, self.tokens, cached=len(req.tokenized.input_ids) - 1)

    async def Abort(self, req, timeout=None):  # noqa: N802
        return pb.AbortResponse()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def _stream(tokenizer, engine: _Engine, first_token: int | None, max_tokens: int,
            stop_ids=frozenset({EOS})) -> GenerationStream:
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens)
    gen = Generation("r1", "m", list(PROMPT), sampling, deadline=10**12)
    params = {"remote_block_ids": [[1]], "remote_num_tokens": len(PROMPT)}
    leg = DecodeLeg("r1", "decode-0", engine, params, first_token=first_token)
    text = TextStream(tokenizer, list(PROMPT), StopRule(stop_token_ids=frozenset(stop_ids)))
    stats = GenerationStats(Placed("test", "test"), "disaggregated")
    return GenerationStream(gen, leg, text, stats, EdgeConfig(model="-"))


async def _chunks(stream: GenerationStream, engine: _Engine) -> list[tuple]:
    """(token ids, finish reason, decode calls started, decode responses read when the
    chunk arrived) per chunk."""
    return [(c.token_ids, c.finish_reason, len(engine.requests), engine.read)
            async for c in stream.chunks()]


async def test_the_prefills_token_goes_out_before_the_decode_answers(tokenizer):
    engine = _Engine([11, 12, 13])
    stream = _stream(tokenizer, engine, first_token=10, max_tokens=4)
    got = await _chunks(stream, engine)
    assert got[0] == ([10], None, 1, 0)         # the call started, nothing read from it
    assert [c[0] for c in got if c[0]] == [[10], [11], [12], [13]]
    assert got[-1][1] == "length"
    [req] = engine.requests
    assert list(req.tokenized.input_ids) == PROMPT + [10]   # it goes on after the token
    assert req.sampling_params.max_tokens == 3
    assert stream.output.ids == [10, 11, 12, 13]
    assert stream.path == "disaggregated" and stream.leg.pulled
    assert stream.stats.prefill_first_token             # pdserve:prefill_first_tokens_total


async def test_without_the_token_the_decode_engine_sends_the_first(tokenizer):
    engine = _Engine([10, 11, 12, 13])
    stream = _stream(tokenizer, engine, first_token=None, max_tokens=4)
    got = await _chunks(stream, engine)
    assert got[0] == ([10], None, 1, 1)
    [req] = engine.requests
    assert list(req.tokenized.input_ids) == PROMPT and req.sampling_params.max_tokens == 4
    assert not stream.stats.prefill_first_token


@pytest.mark.parametrize("first, max_tokens, reason", [
    (10, 1, "length"),          # all that was asked for
    (EOS, 8, "stop"),           # the engine would stop on it
])
async def test_a_token_that_ends_the_generation_needs_no_decode(tokenizer, first, max_tokens,
                                                                reason):
    engine = _Engine([11, 12])
    stream = _stream(tokenizer, engine, first_token=first, max_tokens=max_tokens)
    got = await _chunks(stream, engine)
    assert [c[:2] for c in got] == [([first], None), ([], reason)]
    assert engine.requests == [] and stream.output.ids == [first]
    assert stream.finish_reason == reason
