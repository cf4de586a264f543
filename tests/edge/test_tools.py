"""Tests for pdserve.services.edge.tools and pdserve.services.edge.tool_parsers: tool requests,
forcing schemas, tool turns in messages, and model output turned into calls,
streamed and whole."""

from __future__ import annotations

import json
import random
import re

import pytest

from pdserve.services.edge.openai_protocol import APIError
from pdserve.services.edge.tool_parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    ToolCall,
    ToolParser,
    ToolStream,
    collect,
    parser_for,
)
from pdserve.services.edge.tools import (
    ToolRequest,
    check_parser,
    finish_reason,
    forced_calls,
    output_stream,
    parse_tools,
    split_output,
    template_message,
)

CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER_PARAMS,
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters at all


def tool_request(**fields) -> ToolRequest:
    request = parse_tools({"tools": [WEATHER, TIME]} | fields)
    assert request is not None
    return request


def bad(body: dict, param: str) -> APIError:
    with pytest.raises(APIError) as info:
        parse_tools(body)
    err = info.value
    assert (err.status, err.param) == (400, param), err.message
    assert err.body()["error"]["message"]
    return err


def named_calls(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in calls]


# --- parse_tools -----------------------------------------------------------------


@pytest.mark.parametrize("body", [
    {},
    {"tools": None, "tool_choice": None, "parallel_tool_calls": None},
    {"tool_choice": "none"},
    {"parallel_tool_calls": False},
])  # fmt: skip
def test_a_request_without_tools_has_no_tool_request(body):
    assert parse_tools(body) is None


def test_tools_alone_mean_auto_with_parallel_calls():
    request = parse_tools({"tools": [WEATHER]})
    assert request == ToolRequest(tools=(WEATHER,), choice="auto", named=None, parallel=True)
    assert request.tools[0] is WEATHER  # kept as given, for the chat template


@pytest.mark.parametrize("fields, choice, named, parallel", [
    ({"tool_choice": "none"}, "none", None, True),
    ({"tool_choice": "auto", "parallel_tool_calls": True}, "auto", None, True),
    ({"tool_choice": "required", "parallel_tool_calls": False}, "required", None, False),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "named", "get_time", True),
    ({"tool_choice": {"function": {"name": "get_weather"}}}, "named", "get_weather", True),
])  # fmt: skip
def test_tool_choice_forms(fields, choice, named, parallel):
    request = tool_request(**fields)
    assert (request.choice, request.named, request.parallel) == (choice, named, parallel)


@pytest.mark.parametrize("body, param", [
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [WEATHER] * 129}, "tools"),
    ({"tools": [WEATHER, "get_time"]}, "tools[1]"),
    ({"tools": [WEATHER, {"type": "retrieval", "function": {"name": "r"}}]}, "tools[1].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": "get_time"}]}, "tools[0].function"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": 5}}]}, "tools[1].function.name"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": ""}}]},
     "tools[1].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"function": {"name": "f", "description": 1}}]}, "tools[0].function.description"),
    ({"tools": [{"function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": ["auto"]}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search", "function": {"name": "x"}}},
     "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": {"function": {}}}, "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": ""}}}, "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "parallel_tool_calls": 1}, "parallel_tool_calls"),
])  # fmt: skip
def test_malformed_tool_fields_name_the_parameter(body, param):
    bad(body, param)


def test_legacy_functions_point_to_tools():
    assert "tools" in bad({"functions": [{"name": "f"}]}, "functions").message


def test_required_refuses_tools_whose_defs_conflict():
    one = {"function": {"name": "a", "parameters": {"$defs": {"P": {"type": "string"}}}}}
    two = {"function": {"name": "b", "parameters": {"$defs": {"P": {"type": "integer"}}}}}
    bad({"tools": [one, two], "tool_choice": "required"}, "tools[1].function.parameters.$defs")
    bad({"tools": [{"function": {"name": "a", "parameters": {"$defs": []}}}],
         "tool_choice": "required"}, "tools[0].function.parameters.$defs")  # fmt: skip
    assert tool_request(tool_choice="auto").choice == "auto"  # only "required" merges them


# --- template tools and constraints ---------------------------------------------------


def test_template_tools_are_shaped_as_vllm_passes_them():
    strict = {"type": "function", "extra": 1,
              "function": {"name": "s", "strict": True, "parameters": {}, "x": 2}}  # fmt: skip
    request = parse_tools({"tools": [WEATHER, TIME, strict]})
    assert request.template_tools() == [
        {"type": "function", "function": {"name": "get_weather",
                                          "description": "Current weather in a city",
                                          "parameters": WEATHER_PARAMS}},
        {"type": "function", "function": {"name": "get_time", "description": None,
                                          "parameters": None}},
        {"type": "function", "function": {"name": "s", "description": None, "parameters": {},
                                          "strict": True}},
    ]  # fmt: skip


def test_tool_choice_none_keeps_tools_in_the_prompt_unless_excluded():
    request = tool_request(tool_choice="none")
    assert [t["function"]["name"] for t in request.template_tools()] == ["get_weather", "get_time"]
    assert request.template_tools(exclude_when_none=True) is None
    assert tool_request().template_tools(exclude_when_none=True) is not None


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_unforced_choices_have_no_constraint(choice):
    assert tool_request(tool_choice=choice).constraint() is None


def test_named_constraint_is_the_functions_parameters():
    named = tool_request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.constraint()) == WEATHER_PARAMS
    no_params = tool_request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(no_params.constraint()) == {"type": "object", "properties": {}}


def test_required_constraint_is_vllms_array_of_calls():
    def item(name, parameters):
        return {"properties": {"name": {"type": "string", "enum": [name]},
                               "parameters": parameters},
                "required": ["name", "parameters"]}  # fmt: skip

    schema = json.loads(tool_request(tool_choice="required").constraint())
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": [
            item("get_weather", WEATHER_PARAMS),
            item("get_time", {"type": "object", "properties": {}}),
        ]},
    }  # fmt: skip
    single = tool_request(tool_choice="required", parallel_tool_calls=False)
    single = json.loads(single.constraint())
    assert single["maxItems"] == 1


def test_forced_outputs_satisfy_their_schemas():
    jsonschema = pytest.importorskip("jsonschema")
    named = tool_request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    jsonschema.validate({"city": "Paris", "unit": "celsius"}, json.loads(named.constraint()))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"unit": "celsius"}, json.loads(named.constraint()))

    calls = [{"name": "get_weather", "parameters": {"city": "Paris"}},
             {"name": "get_time", "parameters": {}}]  # fmt: skip
    required = json.loads(tool_request(tool_choice="required").constraint())
    jsonschema.validate(calls, required)
    for wrong in ([], [{"name": "get_stock", "parameters": {}}],
                  [{"name": "get_weather", "parameters": {"unit": "celsius"}}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, required)
    single = tool_request(tool_choice="required", parallel_tool_calls=False).constraint()
    jsonschema.validate(calls[:1], json.loads(single))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(calls, json.loads(single))


def test_required_constraint_hoists_defs_so_refs_resolve():
    jsonschema = pytest.importorskip("jsonschema")
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}},
              "required": ["p"],
              "$defs": {"Point": {"type": "object", "required": ["x"],
                                  "properties": {"x": {"type": "number"}}}}}  # fmt: skip
    tool = {"type": "function", "function": {"name": "plot", "parameters": params}}
    request = parse_tools({"tools": [tool, TIME], "tool_choice": "required"})
    schema = json.loads(request.constraint())
    assert schema["$defs"] == params["$defs"]
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in params  # the request's own tool is left as given
    jsonschema.validate([{"name": "plot", "parameters": {"p": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "plot", "parameters": {"p": {"x": "one"}}}], schema)


# --- forced output ----------------------------------------------------------------


NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def test_named_output_is_one_call_with_the_text_as_arguments():
    request = tool_request(tool_choice=NAMED_WEATHER)
    text = '{"city": "Paris",  "unit": "celsius"}'
    [call] = forced_calls(request, text)
    assert (call.name, call.arguments) == ("get_weather", text)  # verbatim, as vLLM sends it
    assert CALL_ID.fullmatch(call.id)
    assert forced_calls(request, " \n") == []  # a blank answer makes no call


def test_required_output_becomes_calls_with_arguments_re_encoded():
    text = ('[{"name": "get_weather", "parameters": {"city":"Zürich"}},\n'
            ' {"name": "get_time", "parameters": {}}]')  # fmt: skip
    calls = forced_calls(tool_request(tool_choice="required"), text)
    assert named_calls(calls) == [("get_weather", '{"city": "Zürich"}'), ("get_time", "{}")]
    assert len({call.id for call in calls}) == 2
    single = tool_request(tool_choice="required", parallel_tool_calls=False)
    assert named_calls(forced_calls(single, text)) == [("get_weather", '{"city": "Zürich"}')]


@pytest.mark.parametrize("text, expected", [
    ("", []),
    ('{"name": "get_time", "parameters": {}}', []),
    ('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"ci',
     [("get_time", "{}")]),
    ('[{"name": "get_time"}]', []),
    ('[{"name": "get_time", "parameters": {}}, 7]', [("get_time", "{}")]),
])  # fmt: skip
def test_required_output_keeps_only_complete_well_formed_calls(text, expected):
    assert named_calls(forced_calls(tool_request(tool_choice="required"), text)) == expected


def test_forced_calls_needs_a_forcing_choice():
    with pytest.raises(ValueError):
        forced_calls(tool_request(), "{}")


def test_named_stream_sends_arguments_as_they_arrive():
    stream = output_stream(tool_request(tool_choice=NAMED_WEATHER), None)
    assert stream.feed("  ") == []
    head, first = stream.feed('{"ci')
    assert CALL_ID.fullmatch(head["tool_calls"][0].pop("id"))
    assert head == {"tool_calls": [{"index": 0, "type": "function",
                                    "function": {"name": "get_weather", "arguments": ""}}]}
    assert first == {"tool_calls": [{"index": 0, "function": {"arguments": '  {"ci'}}]}
    assert stream.feed('ty": "Oslo"}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}]
    assert stream.finish() == []


REQUIRED_OUTPUTS = [
    '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]',
    '[\n  {"name": "get_weather", "parameters": {"city": "a \\"}]\\" b"}},\n'
    '  {"name": "get_time", "parameters": {}}\n]',
    '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"ci',
]


@pytest.mark.parametrize("text", REQUIRED_OUTPUTS)
def test_required_stream_matches_the_whole_answer_however_split(text):
    request = tool_request(tool_choice="required")
    expected = named_calls(forced_calls(request, text))
    for pieces in chunkings(text, seed=7):
        content, calls = streamed(output_stream(request, None), pieces)
        assert (content, named_calls(calls)) == ("", expected), pieces


def test_named_stream_matches_the_whole_answer_however_split():
    request = tool_request(tool_choice=NAMED_WEATHER)
    text = '\n{"city": "São Paulo", "unit": "celsius"}'
    for pieces in chunkings(text, seed=3):
        content, calls = streamed(output_stream(request, None), pieces)
        assert (content, named_calls(calls)) == ("", named_calls(forced_calls(request, text)))


# --- auto parsing: recorded outputs --------------------------------------------------
# Written as the models emit them: Qwen2.5-Instruct and Hermes-2-Pro/Hermes-3 put
# one JSON object per <tool_call> block on its own line; Llama-3.1-Instruct (with
# vLLM's JSON tool template) writes bare objects, sometimes after <|python_tag|>.

QWEN_ONE = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco, CA", '
            '"unit": "fahrenheit"}}\n</tool_call>')  # fmt: skip
QWEN_TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>')

HERMES_CALLS = [
    (QWEN_ONE, None,
     [("get_weather", '{"city": "San Francisco, CA", "unit": "fahrenheit"}')]),
    (QWEN_TWO, None,
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Tokyo"}')]),
    ("I'll check the weather in both cities.\n\n" + QWEN_TWO,
     "I'll check the weather in both cities.\n\n",
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Tokyo"}')]),
    ("\n\n" + QWEN_ONE, None,
     [("get_weather", '{"city": "San Francisco, CA", "unit": "fahrenheit"}')]),
    # Hermes-2-Pro writes the arguments first.
    ('<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n'
     "</tool_call>", None, [("get_stock_fundamentals", '{"symbol": "TSLA"}')]),
    ('<tool_call>\n{"name": "translate", "arguments": {"text": "温度 in Zürich", '
     '"to": "de"}}\n</tool_call>', None,
     [("translate", '{"text": "温度 in Zürich", "to": "de"}')]),
    ('<tool_call>\n{"name": "run_sql", "arguments": {"query": "SELECT \'}{\' AS \\"<tool_call>\\"",'
     ' "opts": {"tags": ["a", "b"], "limit": 10}}}\n</tool_call>', None,
     [("run_sql", '{"query": "SELECT \'}{\' AS \\"<tool_call>\\"", '
                  '"opts": {"tags": ["a", "b"], "limit": 10}}')]),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', None,
     [("get_time", "{}")]),
    # Generation that ends (EOS or a stop string) before the closing tag.
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n', None, [("get_time", "{}")]),
    # Text after the calls is dropped, as vLLM drops it.
    (QWEN_ONE + "\nLet me know if you need anything else.", None,
     [("get_weather", '{"city": "San Francisco, CA", "unit": "fahrenheit"}')]),
]

HERMES_CONTENT = [
    "The capital of France is Paris.",
    "",
    "Compare a < b, use <b>bold</b> and <tool> tags; a <tool_call",
    "  \n  ",
    # Malformed blocks are content, whole, as vLLM returns them.
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
    '<tool_call>\n{"name": "get_weather"}\n</tool_call>',
    "<tool_call>\n{'name': 'get_time', 'arguments': {}}\n</tool_call>",
    '<tool_call>\n{"name": "get_time", "arguments": {"x": NaN}}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": "{}"}\n</tool_call>',
    '\n<tool_call>\n["get_time"]\n</tool_call>',
    "<tool_call></tool_call>",
    "<tool_call>",
]

LLAMA_ONE = ('{"name": "get_weather", "parameters": {"city": "San Francisco", "state": "CA", '
             '"unit": "fahrenheit"}}')  # fmt: skip
LLAMA_ONE_ARGS = '{"city": "San Francisco", "state": "CA", "unit": "fahrenheit"}'

LLAMA_CALLS = [
    (LLAMA_ONE, [("get_weather", LLAMA_ONE_ARGS)]),
    ("<|python_tag|>" + LLAMA_ONE, [("get_weather", LLAMA_ONE_ARGS)]),
    ('<|python_tag|>{"name": "search", '
     '"parameters": {"query": "vLLM \\"disaggregated\\" {prefill}"}}',
     [("search", '{"query": "vLLM \\"disaggregated\\" {prefill}"}')]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
     [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/Paris"}')]),
    ('{"name": "get_time", "arguments": {"zones": [1, 2]}}', [("get_time", '{"zones": [1, 2]}')]),
    # Llama 3.2 sometimes adds a "type" key.
    ('{"type": "function", "name": "get_weather", "parameters": {"city": "Köln"}}',
     [("get_weather", '{"city": "Köln"}')]),
    ("\n " + LLAMA_ONE, [("get_weather", LLAMA_ONE_ARGS)]),
    (LLAMA_ONE + " Done.", [("get_weather", LLAMA_ONE_ARGS)]),
]

LLAMA_CONTENT = [
    "Hello! How can I help you today?",
    "",
    "I think {x} is a placeholder.",
    "<b>bold</b>",
    '{"result": 42}',  # a JSON answer, not a call
    '{"name": "get_weather", "parameters": {"city": "Paris"}',  # cut short
    '<|python_tag|>brave_search.call(query="weather in Paris")',
    "<|python_tag|>",
    "<|python",
    '{"name": "get_weather", "parameters": "Paris"}',
]


def random_split(text: str, rng: random.Random) -> list[str]:
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def chunkings(text: str, seed: int):
    """The text whole, a character at a time, split at every boundary, and 30 seeded
    random splits."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(30):
        yield random_split(text, rng)


def streamed(stream: ToolStream, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    for delta in deltas:  # every delta is one well-formed OpenAI delta
        if "content" in delta:
            assert set(delta) == {"content"} and delta["content"]
        else:
            [call] = delta["tool_calls"]
            if "id" in call:
                assert CALL_ID.fullmatch(call["id"]) and call["type"] == "function"
                assert call["function"]["arguments"] == "" and call["function"]["name"]
            else:
                assert set(call) == {"index", "function"} and call["function"]["arguments"]
    return collect(deltas)


@pytest.mark.parametrize("text, content, calls", HERMES_CALLS)
def test_hermes_extracts_calls(text, content, calls):
    got_content, got_calls = HermesParser().extract(text)
    assert (got_content, named_calls(got_calls)) == (content, calls)
    assert all(CALL_ID.fullmatch(call.id) for call in got_calls)


@pytest.mark.parametrize("text", HERMES_CONTENT)
def test_hermes_answer_without_a_well_formed_call_is_all_content(text):
    assert HermesParser().extract(text) == (text, [])


@pytest.mark.parametrize("text, calls", LLAMA_CALLS)
def test_llama3_extracts_calls(text, calls):
    content, got = Llama3JsonParser().extract(text)
    assert (content, named_calls(got)) == (None, calls)


@pytest.mark.parametrize("text", LLAMA_CONTENT)
def test_llama3_answer_without_a_well_formed_call_is_all_content(text):
    assert Llama3JsonParser().extract(text) == (text, [])


MIXED = [
    (HermesParser(), QWEN_ONE + '\n<tool_call>\n{"name": "oops"}\n</tool_call>'),
    (Llama3JsonParser(), '{"name": "get_time", "parameters": {}}; {"name": 3, "parameters": {}}'),
]
AUTO_CASES = (MIXED + [(HermesParser(), text) for text, _, _ in HERMES_CALLS]
              + [(HermesParser(), text) for text in HERMES_CONTENT]
              + [(Llama3JsonParser(), text) for text, _ in LLAMA_CALLS]
              + [(Llama3JsonParser(), text) for text in LLAMA_CONTENT])  # fmt: skip


@pytest.mark.parametrize("parser, text", AUTO_CASES)
def test_stream_matches_the_whole_answer_however_split(parser, text):
    content, calls = parser.extract(text)
    for pieces in chunkings(text, seed=len(text)):
        got_content, got_calls = streamed(parser.stream(), pieces)
        assert (got_content or None, named_calls(got_calls)) == (
            content or None, named_calls(calls)), pieces


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "<|python_tag|>", "<|python", "<", "\n", " ",
             "{", "}", "[", "]", '"', "\\", ";", ",", ":", "NaN", "hello", "é", '{"x": "}"}',
             '{"name": "f", "arguments": {"a": [1]}}', '{"name": "g", "parameters": {}}']


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()], ids=lambda p: p.name)
def test_stream_matches_the_whole_answer_on_random_fragments(parser):
    rng = random.Random(11)
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 10)))
        content, calls = parser.extract(text)
        if not calls:
            assert content == text
        for pieces in (list(text), random_split(text, rng)):
            got_content, got_calls = streamed(parser.stream(), pieces)
            assert (got_content or None, named_calls(got_calls)) == (
                content or None, named_calls(calls)), pieces


def test_a_malformed_call_after_good_ones_is_content_from_there_on():
    # vLLM would make the whole answer content; a stream cannot take back a call
    # it already sent, so both paths keep the good call.
    content, calls = MIXED[0][0].extract(MIXED[0][1])
    assert content == '<tool_call>\n{"name": "oops"}\n</tool_call>'
    assert [call.name for call in calls] == ["get_weather"]
    content, calls = MIXED[1][0].extract(MIXED[1][1])
    assert (content, named_calls(calls)) == ('{"name": 3, "parameters": {}}', [("get_time", "{}")])


def test_hermes_holds_back_only_what_may_be_a_tool_call_tag():
    stream = HermesParser().stream()
    assert stream.feed("Compare a <") == [{"content": "Compare a "}]
    assert stream.feed("tool") == []
    assert stream.feed("box> and <tool_c") == [{"content": "<toolbox> and "}]
    assert stream.feed("all>\n") == []
    assert stream.feed('{"name": "get_time", "arguments": {}}\n</tool_') == []
    head, arguments = stream.feed("call>")
    assert head["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert arguments == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert stream.finish() == []


def test_llama3_plain_text_streams_at_once_and_calls_wait_for_their_json():
    stream = Llama3JsonParser().stream()
    assert stream.feed("Hi") == [{"content": "Hi"}]
    assert stream.feed(" there") == [{"content": " there"}]
    stream = Llama3JsonParser().stream()
    assert stream.feed("<|py") == []
    assert stream.feed('thon_tag|>{"name": "get_time", "parameters": {') == []
    head, arguments = stream.feed('}};')
    assert head["tool_calls"][0]["index"] == 0
    assert arguments["tool_calls"][0]["function"]["arguments"] == "{}"
    assert stream.finish() == []


def test_each_call_gets_its_own_index_and_id():
    deltas = HermesParser().stream().feed(QWEN_TWO)
    heads = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
    assert [h["index"] for h in heads] == [0, 1]
    assert heads[0]["id"] != heads[1]["id"]


# --- choosing a parser ----------------------------------------------------------------

QWEN_TEMPLATE = ("{%- if tools %}...You are provided with function signatures within "
                 "<tools></tools> XML tags...<tool_call>\\n{\"name\": <function-name>, "
                 "\"arguments\": <args-json-object>}\\n</tool_call>...{%- endif %}")
LLAMA31_TEMPLATE = ("{%- if builtin_tools is defined or tools is not none %}Environment: ipython"
                    "...{{- '<|python_tag|>' + tool_call.name + '.call(' }}...")
QWEN3_CODER_TEMPLATE = "<tool_call>\n<function=example_function_name>\n<parameter=x>"


@pytest.mark.parametrize("model_type, template, name", [
    ("qwen2", QWEN_TEMPLATE, "hermes"),
    ("llama", QWEN_TEMPLATE, "hermes"),  # Hermes-3-Llama-3.1 speaks Hermes
    ("llama", LLAMA31_TEMPLATE, "llama3_json"),
    ("mistral", LLAMA31_TEMPLATE, None),
    ("llama", "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ("qwen3_moe", QWEN3_CODER_TEMPLATE, None),  # XML inside <tool_call>: not this syntax
    (None, None, None),
])  # fmt: skip
def test_parser_for_reads_the_chat_template(model_type, template, name):
    parser = parser_for(model_type, template)
    assert (parser.name if parser else None) == name


def test_parsers_by_name():
    assert sorted(PARSERS) == ["hermes", "llama3_json"]
    assert all(isinstance(p, ToolParser) and p.name == n for n, p in PARSERS.items())
    assert PARSERS["hermes"].keeps_special_tokens
    assert not PARSERS["llama3_json"].keeps_special_tokens


def test_auto_without_a_parser_is_refused_naming_tool_choice():
    with pytest.raises(APIError) as info:
        check_parser(tool_request(), None)
    assert (info.value.status, info.value.param) == (400, "tool_choice")
    check_parser(tool_request(), PARSERS["hermes"])
    check_parser(tool_request(tool_choice="required"), None)  # forced calls need no parser
    check_parser(tool_request(tool_choice="none"), None)
    check_parser(None, None)


# --- output glue -----------------------------------------------------------------------


def test_split_output_by_choice():
    hermes = PARSERS["hermes"]
    assert split_output(None, hermes, QWEN_ONE) == (QWEN_ONE, [])
    assert split_output(tool_request(tool_choice="none"), hermes, QWEN_ONE) == (QWEN_ONE, [])
    content, calls = split_output(tool_request(), hermes, "Sure.\n" + QWEN_TWO)
    assert (content, len(calls)) == ("Sure.\n", 2)
    content, calls = split_output(tool_request(parallel_tool_calls=False), hermes, QWEN_TWO)
    assert (content, named_calls(calls)) == (None, [("get_weather", '{"city": "Paris"}')])
    content, calls = split_output(tool_request(tool_choice=NAMED_WEATHER), None, '{"city": "Rome"}')
    assert (content, named_calls(calls)) == ("", [("get_weather", '{"city": "Rome"}')])


def test_output_stream_by_choice():
    assert output_stream(None, PARSERS["hermes"]) is None
    assert output_stream(tool_request(tool_choice="none"), PARSERS["hermes"]) is None
    assert output_stream(tool_request(), None) is None
    stream = output_stream(tool_request(parallel_tool_calls=False), PARSERS["hermes"])
    content, calls = streamed(stream, ["Two cities.\n", QWEN_TWO[:70], QWEN_TWO[70:]])
    assert content == "Two cities.\n"
    assert named_calls(calls) == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("choice, calls, engine, expected", [
    ("auto", [1], "stop", "tool_calls"),
    ("required", [1], "stop", "tool_calls"),
    ("named", [1], "stop", "stop"),
    ("auto", [], "stop", "stop"),
    ("auto", [1], "length", "length"),
    ("none", [], "length", "length"),
])  # fmt: skip
def test_finish_reason(choice, calls, engine, expected):
    fields = {"tool_choice": NAMED_WEATHER if choice == "named" else choice}
    assert finish_reason(tool_request(**fields), calls, engine) == expected
    assert finish_reason(None, [], engine) == engine


def test_tool_call_as_message_entry():
    call = ToolCall("call_x", "get_time", "{}")
    assert call.as_dict() == {"id": "call_x", "type": "function",
                              "function": {"name": "get_time", "arguments": "{}"}}


# --- messages --------------------------------------------------------------------------


def assistant_call(arguments, **call) -> dict:
    function = {"name": "get_weather", "arguments": arguments}
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": function} | call]}


def test_assistant_tool_calls_get_arguments_as_objects():
    msg = assistant_call('{"city": "Paris"}')
    assert template_message(msg, "messages[1]") == {
        "role": "assistant", "content": "",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }  # fmt: skip
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # not mutated


@pytest.mark.parametrize("arguments, parsed", [
    ({"city": "Oslo"}, {"city": "Oslo"}),
    ("", {}),
    (None, {}),
    ('{"city": ', {}),  # malformed history is coerced, as vLLM does, not refused
    ("[1, 2]", {}),
    ("42", {}),
])  # fmt: skip
def test_assistant_arguments_are_coerced_like_vllm(arguments, parsed):
    out = template_message(assistant_call(arguments), "messages[1]")
    assert out["tool_calls"][0]["function"]["arguments"] == parsed


def test_tool_and_named_messages_keep_their_keys():
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "18C", "name": "get_weather"}
    assert template_message(tool, "messages[2]") == tool
    parts = [{"type": "text", "text": "hi"}]
    user = {"role": "user", "content": parts, "tool_call_id": "ignored", "tool_calls": "ignored"}
    assert template_message(user, "messages[0]") == {"role": "user", "content": parts}
    plain = {"role": "assistant", "content": "hello", "tool_calls": []}
    assert template_message(plain, "messages[0]") == {"role": "assistant", "content": "hello"}


@pytest.mark.parametrize("msg, param", [
    (assistant_call(5), "messages[3].tool_calls[0].function.arguments"),
    (assistant_call(["a"]), "messages[3].tool_calls[0].function.arguments"),
    (assistant_call("{}", id=7), "messages[3].tool_calls[0].id"),
    (assistant_call("{}", type="code"), "messages[3].tool_calls[0].type"),
    (assistant_call("{}", function="get_weather"), "messages[3].tool_calls[0].function"),
    (assistant_call("{}", function={"arguments": "{}"}), "messages[3].tool_calls[0].function.name"),
    ({"role": "assistant", "content": None, "tool_calls": {"id": "x"}}, "messages[3].tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": ["x"]}, "messages[3].tool_calls[0]"),
    ({"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
     "messages[3].function_call"),
    ({"role": "tool", "content": "ok", "tool_call_id": 12}, "messages[3].tool_call_id"),
    ({"role": "user", "content": "hi", "name": ["me"]}, "messages[3].name"),
])  # fmt: skip
def test_malformed_tool_messages_name_the_parameter(msg, param):
    with pytest.raises(APIError) as info:
        template_message(msg, "messages[3]")
    assert (info.value.status, info.value.param) == (400, param), info.value.message
