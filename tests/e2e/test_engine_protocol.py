"""pdserve's workers speak vLLM's own engine protocol (`vllm.grpc.engine.VllmEngine`):
a client of that protocol alone runs prefill on one worker and decode on the other,
the KV travels, and the tokens equal a single stock vLLM engine's."""
from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from cases import CASES, MAX_TOKENS
from engine_client import external_kv_tokens, flush_prefix_cache, generate
from pdserve.services.edge.openai_protocol import parse_request
from pdserve.services.edge.prompts import PromptEncoder
from pdserve.transfer.params import request_params_for_decode, request_params_for_prefill


def _ids(model_dir, case) -> list[int]:
    """The case's prompt tokenized exactly as the edge (and vLLM's server) would."""
    kind = "chat" if case.kind == "chat" else "completion"
    req = parse_request(kind, json.dumps(case.body(str(model_dir), False)).encode(),
                        [str(model_dir)])
    return PromptEncoder(str(model_dir)).encode(req)


@pytest.fixture(scope="module")
def stubs(stack):
    with grpc.insecure_channel(stack.prefill) as p, grpc.insecure_channel(stack.decode) as d:
        yield pb_grpc.VllmEngineStub(p), pb_grpc.VllmEngineStub(d)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_prefill_then_decode_over_vllm_protocol_equals_single_engine(stubs, stack, model_dir,
                                                                     reference, case):
    prefill, decode = stubs
    ids = _ids(model_dir, case)
    flush_prefix_cache(prefill, decode)     # earlier tests ran these prompts
    before = external_kv_tokens(stack)
    first, done = generate(prefill, f"proto-p-{case.name}", ids, 1,
                            kv=request_params_for_prefill())
    params = json.loads(done.kv_transfer_params_json)
    assert params["remote_block_ids"] and params["remote_engine_id"]
    out, done = generate(decode, f"proto-d-{case.name}", ids, MAX_TOKENS,
                          kv=request_params_for_decode(params))
    assert out[0] == first[0] and len(out) == MAX_TOKENS
    # The decode engine computed only the last prompt token; the rest came over NIXL.
    assert done.prompt_tokens == len(ids) and done.cached_tokens >= len(ids) - 1
    assert len(ids) - 1 <= external_kv_tokens(stack) - before <= len(ids)
    from transformers import AutoTokenizer
    text = AutoTokenizer.from_pretrained(model_dir).decode(out, skip_special_tokens=True)
    assert text == reference[case.name]["text"]


def test_server_info_health_and_reflection(stubs, stack):
    infos = [s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10) for s in stubs]
    assert all(i.kv_engine_id for i in infos) and infos[0].kv_engine_id != infos[1].kv_engine_id
    assert all(s.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy for s in stubs)
    with grpc.insecure_channel(stack.decode) as ch:
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]), timeout=10))
    names = {s.name for s in resp.list_services_response.service}
    assert {"vllm.grpc.engine.VllmEngine", "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize("worker", ["prefill", "decode"])
@pytest.mark.parametrize("ids,max_tokens,kv,why", [
    ([], 4, None, "empty"), ([1, 2, 99999], 4, None, "vocabulary"),
    ([1] * 4096, 4, None, "context"), ([5, 6], 0, None, "max_tokens"),
    ([5, 6], 4, "{not json", "kv_transfer_params_json")],
    ids=["empty", "out-of-vocab", "too-long", "zero-max-tokens", "bad-kv-json"])
def test_bad_requests_are_invalid_argument_and_the_worker_keeps_serving(stubs, worker, ids,
                                                                         max_tokens, kv, why):
    stub = stubs[worker == "decode"]
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, f"bad-{why}-{worker}", ids, max_tokens, kv=kv)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()
    out, _ = generate(stub, f"after-bad-{why}-{worker}", [5, 6, 7, 8], 3)
    assert len(out) == 3


def test_prompt_plus_generated_tokens_continues_exactly(stubs):
    """What stream resumption relies on: sending prompt + the tokens already
    streamed, with max_tokens reduced by as many, continues where it stopped."""
    _, decode = stubs
    prompt = list(range(10, 60))
    whole, _ = generate(decode, "resume-whole", prompt, 10)
    rest, _ = generate(decode, "resume-rest", prompt + whole[:4], 6)
    assert len(whole) == 10 and rest == whole[4:]


def test_abort_from_another_call_ends_a_runninggenerate(stubs):
    _, decode = stubs
    result: dict = {}

    def run() -> None:
        try:
            result["out"] = generate(decode, "proto-abort-me", [5, 6, 7, 8] * 10, 1500)
        except grpc.RpcError as e:
            result["error"] = e.code()

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.0)
    decode.Abort(pb.AbortRequest(request_ids=["proto-abort-me"]), timeout=10)
    t.join(timeout=30)
    assert not t.is_alive()
    if "out" in result:
        tokens, complete = result["out"]
        assert complete.finish_reason == "abort" and len(tokens) < 1500
    else:
        assert result["error"] in (grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED)
