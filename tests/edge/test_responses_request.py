"""A /v1/responses body as the chat request it becomes, and its mistakes refused by the
Responses field's name (pure: no server)."""
from __future__ import annotations

import json

import pytest

from pdserve.services.edge import openai_protocol as oai
from pdserve.services.edge.responses_request import chat_error, parse_response_request


def chat_of(body: dict, history=(), session=None) -> dict:
    req = parse_response_request(json.dumps({"model": "m", **body}).encode())
    return json.loads(req.chat_body(list(history), session))


def test_items_become_chat_turns_after_the_history_with_instructions_first():
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    chat = chat_of({"instructions": "be brief", "input": [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"role": "user", "content": [{"type": "input_text", "text": "next"}]}]},
        history, session="resp_1")
    messages = chat["messages"]
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[1:3] == history
    assert [c["id"] for c in messages[3]["tool_calls"]] == ["c1", "c2"]   # one turn
    assert messages[4] == {"role": "tool", "tool_call_id": "c1", "content": "1"}
    assert messages[5]["content"] == [{"type": "text", "text": "next"}]
    assert chat["session_id"] == "resp_1"


def test_fields_map_to_their_chat_names():
    chat = chat_of({"input": "hi", "max_output_tokens": 9, "temperature": 0.5,
                    "text": {"format": {"type": "json_schema", "name": "x",
                                        "schema": {"type": "object"}, "strict": True}},
                    "tools": [{"type": "function", "name": "f", "parameters": {}}],
                    "tool_choice": {"type": "function", "name": "f"}})
    assert chat["max_completion_tokens"] == 9 and chat["temperature"] == 0.5
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}}
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["messages"] == [{"role": "user", "content": "hi"}]


def test_chat_errors_name_the_responses_field():
    for raw, param in ((json.dumps({"model": "m", "input": "x", "max_output_tokens": 0}),
                        "max_output_tokens"),
                       (json.dumps({"model": "m", "input": "x", "text": {"format": {
                           "type": "json_schema"}}}), "text.format.json_schema")):
        req = parse_response_request(raw.encode())
        with pytest.raises(oai.APIError) as e:
            try:
                oai.parse_request("chat", req.chat_body([], None), {"m"})
            except oai.APIError as error:
                raise chat_error(error) from None
        assert e.value.status == 400 and e.value.param == param, e.value.message
        assert param.split(".")[0] in e.value.message


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"), ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "conversation": "c"}, "conversation"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "previous_response_id": ""}, "previous_response_id"),
    ({"input": "x", "stream": "yes"}, "stream"),
])
def test_bad_fields_are_refused_by_name(body, param):
    with pytest.raises(oai.APIError) as e:
        parse_response_request(json.dumps({"model": "m", **body}).encode())
    assert e.value.status == 400 and e.value.param == param
