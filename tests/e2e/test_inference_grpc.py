"""The internal Inference gRPC API on the edge: same answers, gRPC errors, Abort."""
from __future__ import annotations


import grpc
import pytest

from cases import CASES, MAX_TOKENS
from pdserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc


@pytest.fixture
def inference(stack):
    with grpc.insecure_channel(stack.inference) as ch:
        yield inference_pb2_grpc.InferenceStub(ch)


def _greedy(max_tokens: int = MAX_TOKENS) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_generate_streams_the_same_text_as_a_single_engine(inference, stack, reference):
    case = next(c for c in CASES if c.kind == "completion")
    chunks = list(inference.Generate(inference_pb2.GenerateRequest(
        model=stack.model, prompt=case.payload["prompt"], sampling=_greedy()), timeout=120))
    assert {c.path for c in chunks} == {"disaggregated"}
    assert "".join(c.text for c in chunks) == reference[case.name]["text"]
    last = chunks[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.completion_tokens == MAX_TOKENS == sum(len(c.token_ids) for c in chunks)
    assert last.prompt_tokens == reference[case.name]["usage"]["prompt_tokens"]


@pytest.mark.parametrize("req,code", [
    (inference_pb2.GenerateRequest(model="nope", prompt="hi"), grpc.StatusCode.NOT_FOUND),
    (inference_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    (inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=[1, 10**6])),
     grpc.StatusCode.INVALID_ARGUMENT),
    (inference_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(
        temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT),
    (inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=[5] * 2048)),
     grpc.StatusCode.INVALID_ARGUMENT),
], ids=["unknown-model", "no-input", "out-of-vocab", "negative-temperature", "too-long"])
def test_bad_requests_get_grpc_status(inference, req, code):
    with pytest.raises(grpc.RpcError) as e:
        list(inference.Generate(req, timeout=30))
    assert e.value.code() == code


def test_abort_ends_a_running_generate(inference):
    call = inference.Generate(inference_pb2.GenerateRequest(
        request_id="abort-me", prompt="the dog " * 40, sampling=_greedy(1500)), timeout=120)
    first = next(call)
    assert first.request_id == "abort-me"
    assert inference.Abort(inference_pb2.AbortRequest(request_id="abort-me"), timeout=10).found
    received = []
    with pytest.raises(grpc.RpcError) as e:
        for chunk in call:
            received.append(chunk)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert len(received) < 1400
    assert not inference.Abort(inference_pb2.AbortRequest(request_id="abort-me"), timeout=10).found
