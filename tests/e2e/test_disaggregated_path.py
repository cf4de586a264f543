"""One real request through edge -> router -> prefill -> NIXL -> decode, on vLLM."""
from __future__ import annotations

import json
import secrets
import time
import urllib.request

import grpc
import openai
import pytest

from cases import CASES, MAX_TOKENS, Case
from support import metric_sum, parse_sse
from engine_client import flush_prefix_cache, generate
from smg_grpc_proto import vllm_engine_pb2_grpc
from pdserve.transfer.params import request_params_for_decode, request_params_for_prefill


def _piece(case: Case, choice: dict) -> str:
    """The text one streamed choice adds (chat deltas and completion text differ)."""
    return (choice["delta"].get("content") or "") if case.kind == "chat" else choice["text"]


def _sse_stream(stack, case: Case) -> tuple[str, dict, dict]:
    """Stream one case over raw HTTP: (text, usage, headers)."""
    path = "chat/completions" if case.kind == "chat" else "completions"
    body = case.body(stack.model, True) | {"stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{stack.url}/v1/{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text, usage = [], None
    with urllib.request.urlopen(req, timeout=120) as r:
        headers = dict(r.headers)
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = parse_sse(r.read().decode())
    # OpenAI's framing (data lines only); resumable by their count from the stream id.
    assert [i for i, _ in events] == [None] * len(events)
    assert headers["x-pdserve-stream-id"].startswith("str_")
    assert events[-1][1] == "[DONE]", events[-3:]
    for _, ev in events[:-1]:
        data = json.loads(ev)
        if data.get("usage"):
            usage = data["usage"]
        for choice in data["choices"]:
            text.append(_piece(case, choice))
    return "".join(text), usage, headers


def _metric(stack, name: str) -> float:
    return metric_sum(f"{stack.url}/metrics", name)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_streamed_text_equals_single_vllm_engine(stack, reference, case):
    before = _metric(stack, "pdserve:kv_transferred_tokens_total")
    text, usage, headers = _sse_stream(stack, case)
    ref = reference[case.name]
    assert headers["x-pdserve-path"] == "disaggregated"
    assert usage["prompt_tokens"] == ref["usage"]["prompt_tokens"] > 2 * 128
    assert usage["completion_tokens"] == ref["usage"]["completion_tokens"] == MAX_TOKENS
    assert text == ref["text"]
    # The decode engine took the prompt's KV from the prefill worker instead
    # of computing it: every prompt token but the last (which it recomputes).
    moved = _metric(stack, "pdserve:kv_transferred_tokens_total") - before
    assert usage["prompt_tokens"] - 1 <= moved <= usage["prompt_tokens"]


def test_unmodified_openai_client_streams_chat_and_completion(stack, reference):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    chat_case = next(c for c in CASES if c.kind == "chat")
    chunks = list(client.chat.completions.create(
        model=stack.model, messages=chat_case.payload["messages"], temperature=0,
        max_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        reference[chat_case.name]["text"]

    comp_case = next(c for c in CASES if c.kind == "completion")
    stream = client.completions.create(model=stack.model, prompt=comp_case.payload["prompt"],
                                       temperature=0, max_tokens=MAX_TOKENS, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == reference[comp_case.name]["text"]

    full = client.completions.create(model=stack.model, prompt=comp_case.payload["prompt"],
                                     temperature=0, max_tokens=MAX_TOKENS,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].text == reference[comp_case.name]["text"]
    assert full.usage.completion_tokens == MAX_TOKENS


def test_short_prompt_takes_local_path(stack):
    req = urllib.request.Request(f"{stack.url}/v1/completions", data=json.dumps(
        {"model": stack.model, "prompt": "hi", "max_tokens": 4}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["x-pdserve-path"] == "local"
        body = json.loads(r.read())
    assert body["usage"]["completion_tokens"] >= 1


def test_decode_uses_the_transferred_kv_not_its_own(stack, model_dir):
    """Hand decode prompt B together with the KV of prompt A (same length, same
    last token): if the blocks really travelled, decode continues A, not B."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    a = tok.encode(CASES[1].payload["prompt"])[:400]
    b = list(a)
    b[1:200] = tok.encode(CASES[0].payload["prompt"])[1:200]
    assert len(a) == len(b) and a[-1] == b[-1] and a != b

    with grpc.insecure_channel(stack.prefill) as pch, grpc.insecure_channel(stack.decode) as dch:
        prefill = vllm_engine_pb2_grpc.VllmEngineStub(pch)
        decode = vllm_engine_pb2_grpc.VllmEngineStub(dch)
        local_a, _ = generate(decode, "swap-local-a", a, 12)
        local_b, _ = generate(decode, "swap-local-b", b, 12)
        assert local_a != local_b
        flush_prefix_cache(decode)          # nothing of B's own KV left on the decode side
        first, done = generate(prefill, "swap-a", a, 1, kv=request_params_for_prefill())
        params = json.loads(done.kv_transfer_params_json)
        assert len(params["remote_block_ids"][0]) == 4 and first[0] == local_a[0]
        try:
            swapped, done = generate(decode, "swap-b-with-a", b, 12,
                                     kv=request_params_for_decode(params))
        finally:
            # The decode engine now holds A's KV under B's block hashes, and B
            # shares its first block with CASES[0]: later tests would hit it.
            flush_prefix_cache(decode)
    assert done.cached_tokens >= len(a) - 1
    assert swapped == local_a


async def test_concurrent_streams_each_equal_the_single_engine(stack, reference):
    """8 streams at once: decode batches them (and their KV pulls) continuously;
    every stream must still be exactly its own single-request answer."""
    import asyncio

    import aiohttp

    async def stream(session, case: Case) -> tuple[str, str]:
        path = "chat/completions" if case.kind == "chat" else "completions"
        text = []
        async with session.post(f"{stack.url}/v1/{path}", json=case.body(stack.model, True)) as r:
            assert r.status == 200
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    text.append(_piece(case, json.loads(line[6:])["choices"][0]))
            return r.headers["x-pdserve-path"], "".join(text)

    cases = CASES * 2
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        results = await asyncio.gather(*(stream(session, c) for c in cases))
    assert [path for path, _ in results] == ["disaggregated"] * len(cases)
    assert [text for _, text in results] == [reference[c.name]["text"] for c in cases]


def _decode_counts(stack) -> tuple[float, float, float]:
    """The decode engine's requests, prompt tokens and generated tokens so far."""
    return tuple(metric_sum(stack.decode_metrics, f"vllm:{name}_total")
                 for name in ("request_success", "prompt_tokens", "generation_tokens"))


def _settled_decode_counts(stack, requests: float) -> tuple[float, float, float]:
    """The decode engine's counts once it has reported `requests` finished (engines
    publish their stats at their next step)."""
    deadline = time.monotonic() + 15
    while (counts := _decode_counts(stack))[0] < requests and time.monotonic() < deadline:
        time.sleep(0.2)
    return counts


@pytest.mark.parametrize("sampling, continues", [
    ({"temperature": 0}, True),
    ({"temperature": 0.8}, True),
    # A seed would start the decode engine's generator one draw late; presence and
    # frequency penalties count output tokens only: the prefill's token stays out.
    ({"temperature": 0.8, "seed": 7}, False),
    ({"temperature": 0.8, "presence_penalty": 0.5}, False),
], ids=["greedy", "sampled", "seeded", "presence-penalty"])
def test_the_prefills_token_goes_out_first_and_the_decode_goes_on_after_it(
        stack, sampling, continues):
    case = CASES[0]
    body = case.body(stack.model, True) | sampling | {
        "prompt": f"{secrets.token_hex(6)} {case.payload['prompt']}",
        "stream_options": {"include_usage": True}}
    before = _decode_counts(stack)
    req = urllib.request.Request(f"{stack.url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["x-pdserve-path"] == "disaggregated"
        events = parse_sse(r.read().decode())
    usage = next(json.loads(e)["usage"] for _, e in reversed(events[:-1])
                 if json.loads(e).get("usage"))
    assert usage["completion_tokens"] == MAX_TOKENS
    after = _settled_decode_counts(stack, before[0] + 1)
    requests, prompt, generated = (a - b for a, b in zip(after, before))
    assert requests == 1
    if continues:
        assert (prompt, generated) == (usage["prompt_tokens"] + 1, MAX_TOKENS - 1)
    else:
        assert (prompt, generated) == (usage["prompt_tokens"], MAX_TOKENS)


def test_one_token_asked_for_is_the_prefills_alone(stack):
    """max_tokens 1: the prefill's token is the whole answer; no decode runs, and the
    lease on the prefill's blocks ends at once (aborted, not left to expire)."""
    case = CASES[0]
    body = case.body(stack.model, False) | {
        "prompt": f"{secrets.token_hex(6)} {case.payload['prompt']}", "max_tokens": 1}
    before = _decode_counts(stack)
    aborted = metric_sum(stack.prefill_metrics, "pdserve:kv_leases_total",
                         'outcome="aborted"')
    req = urllib.request.Request(f"{stack.url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["x-pdserve-path"] == "disaggregated"
        out = json.loads(r.read())
    assert out["usage"]["completion_tokens"] == 1
    assert out["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 10      # the prefill worker counts its leases each second
    while (metric_sum(stack.prefill_metrics, "pdserve:kv_leases_total", 'outcome="aborted"')
           == aborted and time.monotonic() < deadline):
        time.sleep(0.2)
    assert metric_sum(stack.prefill_metrics, "pdserve:kv_leases_total",
                      'outcome="aborted"') == aborted + 1
    assert _decode_counts(stack) == before
