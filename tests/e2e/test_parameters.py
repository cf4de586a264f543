"""Every request parameter against the reference vLLM server (tests/e2e/parity.py):
honoured as vLLM honours it, or refused with a 400 naming it."""
from __future__ import annotations

import json

import pytest

from conftest import post_any
from parity import CASES, REFUSED, assemble, differences


@pytest.mark.parametrize("name", sorted(CASES))
def test_parameter_is_honoured_as_vllm_does_or_refused_by_name(stack, reference, name):
    kind, body = CASES[name]
    path = "chat/completions" if kind == "chat" else "completions"
    status, ours = post_any(f"{stack.url}/v1/{path}", {"model": stack.model, **body})
    if name in REFUSED:
        assert status == 400 and ours["error"]["param"] == REFUSED[name], ours
        return
    ref_status, theirs = reference[f"parity/{name}"]
    assert ref_status == 200, f"the reference refused {name}: {theirs}"
    assert status == 200, ours
    assert not differences(kind, ours, theirs), (differences(kind, ours, theirs), ours, theirs)


def test_structured_outputs_are_what_they_promise(stack):
    """The schema'd answer parses as JSON of that schema; the named tool's arguments too."""
    _, answer = post_any(f"{stack.url}/v1/chat/completions",
                         {"model": stack.model, **CASES["json_schema"][1], "max_tokens": 200})
    if answer["choices"][0]["finish_reason"] == "stop":
        person = json.loads(answer["choices"][0]["message"]["content"])
        assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    _, called = post_any(f"{stack.url}/v1/chat/completions",
                         {"model": stack.model, **CASES["named-tool"][1], "max_tokens": 200})
    call = called["choices"][0]["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert call["id"].startswith("call")
    if called["choices"][0]["finish_reason"] == "stop":
        assert set(json.loads(call["function"]["arguments"])) == {"city"}


def test_usage_reports_cached_prompt_tokens(stack):
    """A repeated prompt is a prefix-cache hit where it is computed: usage says so."""
    kind, body = CASES["baseline-completion"]
    body = body | {"prompt": body["prompt"] * 12}       # over one KV block (128 tokens)
    for _ in range(2):
        _, answer = post_any(f"{stack.url}/v1/completions", {"model": stack.model, **body})
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128, answer["usage"]


@pytest.mark.parametrize("name", ["logprobs-chat", "logprobs-completion", "echo-logprobs", "n",
                                  "n-chat", "named-tool", "required-tool", "json_schema"])
def test_streamed_answer_is_the_same_answer(stack, reference, name):
    """Streamed (OpenAI's framing, choices interleaved), the answer put back together is
    the reference's non-streamed one."""
    import urllib.request
    kind, body = CASES[name]
    path = "chat/completions" if kind == "chat" else "completions"
    req = urllib.request.Request(f"{stack.url}/v1/{path}", data=json.dumps(
        {"model": stack.model, **body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        lines = [line.decode().rstrip("\n") for line in r if line.strip()]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    if body.get("n"):                           # interleaved: every choice before any ends
        indices = [c["index"] for e in events for c in e["choices"] if not c["finish_reason"]]
        assert len(set(indices)) == body["n"]
    ours = assemble(kind, events)
    _, theirs = reference[f"parity/{name}"]
    assert not differences(kind, ours, theirs), (differences(kind, ours, theirs), ours, theirs)
