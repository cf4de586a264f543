"""Workers answer bad gRPC requests with INVALID_ARGUMENT and keep serving."""
from __future__ import annotations

import grpc
import pytest

from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

GREEDY = common_pb2.SamplingParams(temperature=0, max_tokens=4)


@pytest.mark.parametrize("req", [
    decode_pb2.DecodeRequest(request_id="e1", prompt_token_ids=[], sampling=GREEDY),
    decode_pb2.DecodeRequest(request_id="e2", prompt_token_ids=[1, 99999], sampling=GREEDY),
    decode_pb2.DecodeRequest(request_id="e3", prompt_token_ids=[5] * 2048, sampling=GREEDY),
    decode_pb2.DecodeRequest(request_id="e4", prompt_token_ids=[5, 6],
                             sampling=common_pb2.SamplingParams(max_tokens=0)),
    decode_pb2.DecodeRequest(request_id="e5", prompt_token_ids=[5, 6], sampling=GREEDY,
                             kv=common_pb2.KVHandle(params_json="{not json")),
    decode_pb2.DecodeRequest(request_id="e6", prompt_token_ids=[5, 6], sampling=GREEDY,
                             generated_token_ids=[7, 8, 9, 10]),
], ids=["empty", "out-of-vocab", "too-long", "zero-max-tokens", "bad-kv-json",
        "already-done"])
def test_decode_rejects_bad_requests(stack, req):
    with grpc.insecure_channel(stack.decode) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Decode(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        ok = list(stub.Decode(decode_pb2.DecodeRequest(
            request_id=f"after-{req.request_id}", prompt_token_ids=[5, 6], sampling=GREEDY),
            timeout=60))
        assert sum(len(c.token_ids) for c in ok) == 4


def test_decode_resumes_after_generated_tokens(stack):
    """Resumption: prompt + tokens already streamed continue exactly where they stopped."""
    with grpc.insecure_channel(stack.decode) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        prompt = list(range(10, 60))
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        whole = [t for c in stub.Decode(decode_pb2.DecodeRequest(
            request_id="resume-whole", prompt_token_ids=prompt, sampling=sampling), timeout=60)
            for t in c.token_ids]
        rest = [t for c in stub.Decode(decode_pb2.DecodeRequest(
            request_id="resume-rest", prompt_token_ids=prompt, sampling=sampling,
            generated_token_ids=whole[:4]), timeout=60) for t in c.token_ids]
    assert len(whole) == 10 and rest == whole[4:]


def test_prefill_rejects_empty_prompt(stack):
    with grpc.insecure_channel(stack.prefill) as ch:
        with pytest.raises(grpc.RpcError) as e:
            prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
                request_id="p-empty", sampling=GREEDY), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
