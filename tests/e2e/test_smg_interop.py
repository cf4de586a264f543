"""The ecosystem's gateway in front of pdserve's workers: the Shepherd Model Gateway
(`smg launch --pd-disaggregation`, Rust) drives pdserve's prefill and decode workers
over vLLM's engine protocol; its completions equal a single stock vLLM engine's and
the KV travels from prefill to decode. And `pdserve bench gateways`' measurement,
pdserve's edge beside SMG over these same workers."""
from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2_grpc

from cases import CASES
from pdserve.bench import gateways
from pdserve.bench.deployments import SmgGateway, gateway_pids, worker_pids
from engine_client import external_kv_tokens, flush_prefix_cache


def _decode_log(stack, request_id: str) -> str | None:
    """The decode worker's log line for `request_id`, once it is there."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for line in stack.proc.lines:
            if f"generate {request_id} on decode" in line:
                return line
        time.sleep(0.1)
    return None


@pytest.fixture(scope="module")
def smg(stack, model_dir):
    gateway = SmgGateway("smg-test", str(model_dir), [stack.prefill], [stack.decode])
    try:
        gateway.start()
        yield gateway
    finally:
        gateway.stop()


@pytest.mark.parametrize("case", [c for c in CASES if c.kind == "completion"],
                         ids=lambda c: c.name)
def test_smg_over_pdserve_workers_equals_single_engine(smg, stack, reference, case):
    with grpc.insecure_channel(stack.prefill) as p, grpc.insecure_channel(stack.decode) as d:
        flush_prefix_cache(vllm_engine_pb2_grpc.VllmEngineStub(p),
                           vllm_engine_pb2_grpc.VllmEngineStub(d))   # earlier tests ran these
    before = external_kv_tokens(stack)
    req = urllib.request.Request(f"{smg.urls[0]}/v1/completions",
                                 data=json.dumps(case.body(stack.model, False)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        body = json.loads(r.read())
    # SMG encodes completion prompts without the tokenizer's special tokens (no BOS),
    # so its reference is the stock engine's answer to exactly those ids.
    ref = reference[f"{case.name}/no-special-tokens"]
    assert body["choices"][0]["text"] == ref["text"]
    prompt_tokens = ref["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    # The decode worker took the prompt's KV from the prefill worker: it computed
    # only the last prompt token itself (vLLM's own counter, on the worker's /metrics).
    line = _decode_log(stack, body["id"])
    assert line and "(KV pulled from a prefill worker)" in line, line
    pulled = external_kv_tokens(stack) - before
    assert prompt_tokens - 1 <= pulled <= prompt_tokens


def test_bench_gateways_measures_the_edge_and_smg_over_the_same_workers(smg, stack):
    # `pdserve bench gateways` starts a stack and SMG of its own, then measures this way.
    # The workers are told apart from the gateway (whose flags say "prefill" too).
    workers = worker_pids(stack.proc.popen.pid)
    assert [len(workers[f"{role}_worker"]) for role in ("prefill", "decode")] == [1, 1]
    assert not set(workers["prefill_worker"]) & set(gateway_pids(stack.proc.popen.pid))
    result = gateways.measure({"pdserve": ([stack.url], gateway_pids(stack.proc.popen.pid)),
                               "smg": (smg.urls, smg.pids())},
                              stack.model, n=2, rate=4, reps=1, seed=0,
                              workers=workers,
                              engines={"prefill": stack.prefill_metrics,
                                       "decode": stack.decode_metrics})
    assert set(result["gateways"]) == {"pdserve", "smg"}
    for name, g in result["gateways"].items():
        assert g["completed"] == 2 and g["failed"] == 0, (name, g)
        assert g["ttft_p50_ms"] > 0 and g["gateway_cpu_ms_per_request"] > 0, (name, g)
        # Both gateways' requests ran on the same workers: each cost their engines CPU.
        assert set(g["worker_cpu_ms_per_request"]) == {
            "prefill_worker", "prefill_engine", "decode_worker", "decode_engine"}, (name, g)
        assert g["worker_cpu_ms_per_request"]["decode_engine"] > 0, (name, g)
        # ... and the engines saw each request: a first token after arriving, per engine.
        engine = g["engine_mean_ms"]
        assert engine["prefill_ttft"] > 0 and engine["decode_ttft"] > 0, (name, g)
    assert result["ratios"]["ttft_p50_ms_pdserve_over_smg"] > 0
    assert set(result["targets"]) == {"ttft_p50_le_smg", "ttft_p99_le_smg",
                                      "tpot_le_1.05x_smg", "cpu_le_1.5x_smg"}
    assert result["targets_by_gateway"] == {"pdserve": result["targets"]}
