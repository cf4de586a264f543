"""A choice's output as OpenAI shapes it (services/edge/choices.py): plain deltas, chat
and completions logprobs (vLLM's alternatives), echo, finish reasons; each checked
against the OpenAI SDK's own types."""
from __future__ import annotations

import pytest
from smg_grpc_proto import vllm_engine_pb2

from pdserve.services.edge.choices import Choice, TokenText, _completion_top
from pdserve.services.edge.output import Chunk
from pdserve.services.edge.prompts import PromptEncoder


@pytest.fixture(scope="module")
def tokens(model_dir):
    return TokenText(PromptEncoder(str(model_dir)).tokenizer)


def logprobs(*steps) -> vllm_engine_pb2.OutputLogProbs:
    """OutputLogProbs of (sampled id, its logprob, [(alternative id, logprob)...]) steps,
    the sampled token first among the alternatives, as the engine lists them."""
    out = vllm_engine_pb2.OutputLogProbs()
    for tid, lp, alternatives in steps:
        out.token_ids.append(tid)
        out.token_logprobs.append(lp)
        out.top_logprobs.append(vllm_engine_pb2.TopLogProbs(
            token_ids=[a for a, _ in alternatives], values=[v for _, v in alternatives]))
    return out


def test_plain_chat_opens_with_the_role_once_and_ends_with_its_finish():
    choice = Choice(1, "chat")
    assert choice.plain and choice.text_delta("hi") == {
        "index": 1, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}
    assert choice.opening()[0]["delta"] == {"role": "assistant", "content": ""}
    assert choice.opening() == []
    assert choice.closing("length") == [{"index": 1, "delta": {}, "logprobs": None,
                                         "finish_reason": "length"}]


def test_chat_logprobs_name_each_token_and_its_alternatives(tokens):
    choice = Choice(0, "chat", tokens=tokens, logprobs=2)
    lps = logprobs((65, -0.5, [(65, -0.5), (66, -1.5)]), (67, -float("inf"), [(67, -1e9)]))
    deltas = choice.deltas(Chunk([65, 67], "ab", logprobs=lps))
    assert deltas[0]["delta"]["role"] == "assistant"
    content = deltas[1]["logprobs"]["content"]
    assert [e["token"] for e in content] == [tokens(65), tokens(67)]
    assert content[0]["top_logprobs"] == [
        {"token": tokens(65), "logprob": -0.5, "bytes": list(tokens(65).encode())},
        {"token": tokens(66), "logprob": -1.5, "bytes": list(tokens(66).encode())}]
    assert content[1]["logprob"] == -9999.0        # OpenAI's -inf, as vLLM clamps it


def test_completion_alternatives_are_the_sampled_token_and_the_top_k():
    top = vllm_engine_pb2.TopLogProbs
    # Sampled token outside the top 2: it and both of them.
    assert _completion_top(top(token_ids=[9, 1, 2], values=[-3.0, -0.25, -0.5]), 2) == [
        (9, -3.0), (1, -0.25), (2, -0.5)]
    # Sampled token among the top 2: it and the other one (the engine's third is extra).
    assert _completion_top(top(token_ids=[1, 2, 3], values=[-0.25, -0.5, -0.75]), 2) == [
        (1, -0.25), (2, -0.5)]
    assert _completion_top(top(token_ids=[4, 1], values=[-2.0, -0.25]), 0) == [(4, -2.0)]


def test_completion_echo_and_logprobs_count_offsets_from_the_answer_start(tokens):
    choice = Choice(0, "completion", tokens=tokens, logprobs=1, echo="ab")
    prompt = vllm_engine_pb2.InputLogProbs(token_ids=[65, 66])
    prompt.token_logprobs.add()                      # the first prompt token has none
    prompt.token_logprobs.add(value=-1.0)
    prompt.top_logprobs.add()
    prompt.top_logprobs.add(token_ids=[66, 67], values=[-1.0, -0.5])
    choice.add(Chunk([67], "c", logprobs=logprobs((67, -0.25, [(67, -0.25), (65, -2.0)]))),
               prompt)
    whole = choice.whole("length")
    assert whole["text"] == "abc" and whole["finish_reason"] == "length"
    lp = whole["logprobs"]
    assert lp["token_logprobs"] == [None, -1.0, -0.25] and lp["top_logprobs"][0] is None
    assert lp["tokens"] == [tokens(65), tokens(66), tokens(67)]
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(tokens(65))


def test_shapes_validate_against_the_openai_sdk_types(tokens):
    chat = pytest.importorskip("openai.types.chat")
    completion = pytest.importorskip("openai.types")
    choice = Choice(0, "chat", tokens=tokens, logprobs=1)
    choice.add(Chunk([65], "a", logprobs=logprobs((65, -0.5, [(65, -0.5)]))))
    envelope = {"id": "chatcmpl-1", "created": 5, "model": "m",
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    full = chat.ChatCompletion.model_validate(
        {**envelope, "object": "chat.completion", "choices": [choice.whole("stop")]})
    assert full.choices[0].logprobs.content[0].top_logprobs[0].logprob == -0.5
    streamed = Choice(0, "chat", tokens=tokens, logprobs=1)
    for delta in streamed.deltas(Chunk([65], "a", logprobs=logprobs((65, -0.5, [(65, -0.5)])))):
        chat.ChatCompletionChunk.model_validate(
            {**envelope, "object": "chat.completion.chunk", "choices": [delta]})
    text = Choice(0, "completion", tokens=tokens, logprobs=0)
    text.add(Chunk([65], "a", logprobs=logprobs((65, -0.5, [(65, -0.5)]))))
    answer = completion.Completion.model_validate(
        {**envelope, "object": "text_completion", "choices": [text.whole("length")]})
    assert answer.choices[0].logprobs.token_logprobs == [-0.5]


def test_each_choice_draws_with_the_next_seed_within_int64():
    """Choice i samples with seed + i (vLLM's children of an n > 1 request), wrapping
    inside the int64 the field holds."""
    from pdserve.services.edge.app import _sampling
    from pdserve.services.edge.openai_protocol import parse_request
    req = parse_request("completion", b'{"model": "m", "prompt": "x", "n": 2, "seed": '
                        + str(2**63 - 1).encode() + b"}", {"m"})
    assert [_sampling(req, 5, i).seed for i in (0, 1)] == [2**63 - 1, -(2**63)]
