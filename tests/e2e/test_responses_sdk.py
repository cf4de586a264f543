"""/v1/responses against the live stack, through the OpenAI Python SDK unmodified:
streamed events, background runs resumed with starting_after, cancel, and a chain
of previous_response_id turns whose prompts hit the prefix cache more each turn."""
from __future__ import annotations

import json

import pytest
from openai import NotFoundError, OpenAI

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def sdk(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_openai_sdk_streams_a_response_with_the_chat_answers_text(sdk, stack):
    chat = sdk.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=12,
                                       temperature=0)
    events = list(sdk.responses.create(model=stack.model, input=MESSAGES, temperature=0,
                                       max_output_tokens=12, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == chat.choices[0].message.content
    final = events[-1].response
    assert final.output_text == text
    assert final.usage.input_tokens == chat.usage.prompt_tokens
    assert final.usage.output_tokens == chat.usage.completion_tokens
    whole = sdk.responses.create(model=stack.model, input=MESSAGES, temperature=0,
                                 max_output_tokens=12)
    assert whole.output_text == text and whole.status == final.status


def test_openai_sdk_background_response_resumes_after_a_dropped_stream(sdk, stack):
    whole = sdk.responses.create(model=stack.model, input="Count to twenty.", temperature=0,
                                 max_output_tokens=40)
    stream = sdk.responses.create(model=stack.model, input="Count to twenty.", temperature=0,
                                  max_output_tokens=40, stream=True, background=True)
    got = []
    for event in stream:
        got.append(event)
        if len(got) == 8:
            break
    stream.close()                              # the client goes away mid-answer
    rid = got[0].response.id
    rest = list(sdk.responses.retrieve(rid, stream=True, starting_after=got[-1].sequence_number))
    events = got + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    done = sdk.responses.retrieve(rid)
    assert done.status == whole.status and done.output_text == whole.output_text
    with pytest.raises(NotFoundError):
        sdk.responses.retrieve("resp_" + "0" * 32)


def test_openai_sdk_cancels_a_background_response(sdk, stack):
    r = sdk.responses.create(model=stack.model, input="Tell a long story.",
                             max_output_tokens=1500, background=True, temperature=0)
    assert r.status == "in_progress" and r.background
    cancelled = sdk.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    events = list(sdk.responses.retrieve(r.id, stream=True))
    assert events[-1].type == "response.cancelled"
    assert sdk.responses.retrieve(r.id).status == "cancelled"
    sdk.responses.delete(r.id)
    with pytest.raises(NotFoundError):
        sdk.responses.retrieve(r.id)


def test_openai_sdk_streams_a_function_call_and_continues_after_its_output(sdk, stack):
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                "required": ["city"], "additionalProperties": False}}
    events = list(sdk.responses.create(
        model=stack.model, input="What is the weather in Paris?", tools=[tool], stream=True,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
        temperature=0))
    final = events[-1].response
    call = next(item for item in final.output if item.type == "function_call")
    assert call.name == "get_weather" and call.call_id
    pieces = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert pieces == call.arguments
    if final.status == "completed":
        assert set(json.loads(call.arguments)) == {"city"}
    after = sdk.responses.create(model=stack.model, previous_response_id=final.id,
                                 input=[{"type": "function_call_output",
                                         "call_id": call.call_id, "output": "sunny"}],
                                 max_output_tokens=8, temperature=0)
    assert after.usage.input_tokens > final.usage.input_tokens


def test_a_chain_of_four_responses_hits_the_cache_more_each_turn(sdk, stack):
    """Each turn adds over one KV block (128 tokens) to the conversation: the next turn's
    prompt finds more of it cached where it is computed, on the chain's workers."""
    previous, cached, worker = None, [], set()
    for turn in ("Hello there.", "Tell me more.", "And then?", "Thanks, bye."):
        raw = sdk.responses.with_raw_response.create(
            model=stack.model, input=f"{turn} " + "Say more about colours and light. " * 25,
            temperature=0, max_output_tokens=16, instructions="You are terse.",
            previous_response_id=previous)
        r = raw.parse()
        worker.add(raw.headers["x-pdserve-worker"])
        cached.append(r.usage.input_tokens_details.cached_tokens)
        assert r.previous_response_id == previous
        previous = r.id
    assert len(worker) == 1
    assert 0 < cached[1] < cached[2] < cached[3], cached
