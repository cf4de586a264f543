"""Tests for pdserve.services.edge.openai_protocol: request validation and response shapes."""

from __future__ import annotations

import json
import random
import re

import pytest

from pdserve.services.edge.events import payload
from pdserve.services.edge.sse import chunked_events, frame, plain_chunked_events, plain_frame
from pdserve.services.edge.stream_log import Event
from pdserve.services.edge.openai_protocol import (
    APIError,
    CompletionRequest,
    SamplingOptions,
    check_context,
    completion_id,
    parse_request,
)

MODELS = frozenset({"m", "other-model"})
DROP = object()  # marks a base field to remove from the body

BASE = {
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "completion": {"model": "m", "prompt": "hi"},
}


USAGE_PARAM = "stream_options.include_usage"


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def body(kind: str, **fields) -> bytes:
    """The minimal valid body for kind, with fields overridden (or removed via DROP)."""
    out = dict(BASE[kind])
    for key, value in fields.items():
        if value is DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return json.dumps(out).encode()


def parse(kind: str, **fields) -> CompletionRequest:
    return parse_request(kind, body(kind, **fields), MODELS)


def error(kind: str, raw: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(kind, raw, MODELS)
    err = info.value
    # Whatever failed, the client must get a well-formed OpenAI error object.
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    assert err.body()["error"]["message"]
    json.dumps(err.body())
    return err


def bad(kind: str, param: str | None, **fields) -> APIError:
    err = error(kind, body(kind, **fields))
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param), err.message
    return err


# --- happy paths ---------------------------------------------------------------


def test_chat_minimal_uses_openai_defaults():
    req = parse("chat")
    assert req == CompletionRequest(
        kind="chat",
        model="m",
        messages=({"role": "user", "content": "hi"},),
        prompt=None,
        sampling=SamplingOptions(),
        stream=False,
        include_usage=False,
        echo=False,
        user=None,
        session_id=None,
    )
    assert SamplingOptions() == SamplingOptions(
        temperature=1.0, top_p=1.0, top_k=0, max_tokens=None, seed=None, stop=(),
        ignore_eos=False, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
    )  # fmt: skip


def test_chat_full_request():
    req = parse(
        "chat",
        model="other-model",
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "system", "content": "sys", "name": "ops"},
            {"role": "user", "content": [text_part("a"), text_part("b")]},
            {"role": "assistant", "content": ""},
            {"role": "tool", "content": [], "tool_call_id": "x"},
        ],
        temperature=0,
        top_p=0.5,
        top_k=40,
        max_tokens=10,
        max_completion_tokens=20,
        seed=-7,
        stop="###",
        ignore_eos=True,
        presence_penalty=-2,
        frequency_penalty=2.0,
        repetition_penalty=1.1,
        n=1,
        stream=True,
        stream_options={"include_usage": True},
        user="u-1",
        session_id="s-1",
        logprobs=True,
        response_format={"type": "text"},
        tool_choice="none",
    )
    assert req.kind == "chat" and req.model == "other-model" and req.prompt is None
    assert req.messages == (
        {"role": "developer", "content": "be brief"},
        {"role": "system", "content": "sys", "name": "ops"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "", "tool_call_id": "x"},
    )
    assert req.sampling == SamplingOptions(
        temperature=0.0, top_p=0.5, top_k=40, max_tokens=20, seed=-7, stop=("###",),
        ignore_eos=True, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1.1,
        logprobs=0,
    )  # fmt: skip
    assert isinstance(req.sampling.temperature, float)
    assert isinstance(req.sampling.presence_penalty, float)
    assert (req.stream, req.include_usage, req.echo) == (True, True, False)
    assert (req.user, req.session_id) == ("u-1", "s-1")


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_tokens": 5}, 5),
        ({"max_completion_tokens": 6}, 6),
        ({"max_tokens": 5, "max_completion_tokens": 6}, 6),
        ({"max_tokens": 5, "max_completion_tokens": None}, 5),
        ({"max_tokens": 10**12}, 10**12),  # check_context's job, not the parser's
    ],
)
def test_chat_max_tokens_aliases(fields, expected):
    assert parse("chat", **fields).sampling.max_tokens == expected


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", "hello"),
        (["hello"], "hello"),
        ([1, 2, 0], (1, 2, 0)),
        ([[3, 4]], (3, 4)),
        ([2**31 - 1], (2**31 - 1,)),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    req = parse("completion", prompt=prompt)
    assert req.kind == "completion" and req.messages == () and req.prompt == expected


def test_completion_full_request():
    req = parse(
        "completion",
        max_tokens=3,
        stop=["a", "b", "c", "d"],
        top_k=-1,
        echo=False,
        stream=True,
        stream_options={"include_usage": False},
    )
    assert req.sampling.max_tokens == 3
    assert req.sampling.stop == ("a", "b", "c", "d")
    assert req.sampling.top_k == 0
    assert (req.stream, req.include_usage, req.echo) == (True, False, False)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_null_optional_fields_mean_default(kind):
    nulls = dict.fromkeys(
        ["temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "ignore_eos", "n",
         "presence_penalty", "frequency_penalty", "repetition_penalty", "stream",
         "stream_options", "user", "session_id", "echo", "tools"]
    )  # fmt: skip
    req = parse(kind, **nulls)
    assert req.sampling == SamplingOptions()
    assert (req.stream, req.include_usage, req.user, req.session_id) == (False, False, None, None)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2), ("temperature", 0.0), ("top_p", 1), ("top_p", 1e-9),
        ("presence_penalty", -2), ("frequency_penalty", 2), ("repetition_penalty", 1e-6),
        ("top_k", 0), ("seed", 2**63 - 1), ("seed", -(2**63)), ("stop", []),
    ],
)  # fmt: skip
def test_boundary_values_accepted(field, value):
    parse("chat", **{field: value})


def test_utf8_body_and_bom():
    raw = json.dumps(BASE["chat"] | {"messages": [{"role": "user", "content": "héllo ✓"}]},
                     ensure_ascii=False).encode()  # fmt: skip
    assert parse_request("chat", raw, MODELS).messages[0]["content"] == "héllo ✓"
    assert parse_request("chat", b"\xef\xbb\xbf" + raw, MODELS).model == "m"


# --- body and model errors -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"not json", "not valid JSON"),
        (b"\xff\xfe\xfa\x00garbage", "not valid JSON"),
        (b'{"model": "m", "temperature": NaN}', "not valid JSON"),
        (b'{"model": "m", "temperature": -Infinity}', "not valid JSON"),
        (b"[" * 100_000, "not valid JSON"),
        (b'{"x": ' + b"9" * 5000 + b"}", "not valid JSON"),  # int-digits limit
        (b"[]", "must be a JSON object"),
        (b'"x"', "must be a JSON object"),
        (b"null", "must be a JSON object"),
        (b"1", "must be a JSON object"),
        (b"[{}]", "must be a JSON object"),
    ],
)
def test_body_must_be_a_json_object(kind, raw, message):
    err = error(kind, raw)
    assert (err.status, err.param) == (400, None)
    assert message in err.message


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("model", [DROP, None, 1, ["m"], {"m": 1}, True])
def test_model_must_be_a_string(kind, model):
    bad(kind, "model", model=model)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("model", ["nope", "", "M", "m "])
def test_unknown_model_is_404(kind, model):
    err = error(kind, body(kind, model=model))
    assert (err.status, err.type, err.param, err.code) == (
        404, "invalid_request_error", "model", "model_not_found"
    )  # fmt: skip
    assert err.body() == {
        "error": {
            "message": f"The model `{model}` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


# --- chat messages -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (DROP, "messages"),
        (None, "messages"),
        ("hi", "messages"),
        ({"role": "user", "content": "hi"}, "messages"),
        ([], "messages"),
        ([1], "messages[0]"),
        (["hi"], "messages[0]"),
        ([{"role": "user", "content": "a"}, None], "messages[1]"),
        ([{"content": "a"}], "messages[0].role"),
        ([{"role": "robot", "content": "a"}], "messages[0].role"),
        ([{"role": ["user"], "content": "a"}], "messages[0].role"),
        ([{"role": {"x": 1}, "content": "a"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": {"type": "text", "text": "a"}}], "messages[0].content"),
        ([{"role": "user", "content": ["a"]}], "messages[0].content[0]"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0]",
        ),
        ([{"role": "user", "content": [{"text": "a"}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
        (
            [{"role": "user", "content": [text_part("a"), {"type": "text", "text": 1}]}],
            "messages[0].content[1].text",
        ),
    ],
)
def test_invalid_messages(messages, param):
    bad("chat", param, messages=messages)


# --- completion prompt --------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (DROP, "required"),
        (None, "required"),
        ("", "empty"),
        ([], "empty"),
        ([""], "empty"),
        ([[]], "empty"),
        (["a", "b"], "only one prompt per request is supported"),
        ([[1], [2]], "only one prompt per request is supported"),
        (["a", [1]], "only one prompt per request is supported"),
        ([-1], "non-negative"),
        ([1.5], "non-negative"),
        ([True], "non-negative"),
        ([1, "a"], "non-negative"),
        ([None], "non-negative"),
        ([["a"]], "non-negative"),
        ([2**31], "non-negative"),
        (5, "string or an array"),
        ({"text": "a"}, "string or an array"),
        (True, "string or an array"),
    ],
)
def test_invalid_prompt(prompt, message):
    err = bad("completion", "prompt", prompt=prompt)
    assert message in err.message


# --- sampling and flags ------------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.0), ("max_tokens", 5.5),
        ("max_tokens", True), ("max_tokens", "5"), ("max_tokens", [5]),
        ("temperature", -0.1), ("temperature", 2.01), ("temperature", True), ("temperature", "1"),
        ("temperature", 10**400),
        ("top_p", 0), ("top_p", 1.01), ("top_p", -1), ("top_p", False), ("top_p", [1]),
        ("top_k", -2), ("top_k", 1.5), ("top_k", True), ("top_k", 2**31),
        ("presence_penalty", -2.01), ("presence_penalty", 3), ("presence_penalty", "0"),
        ("frequency_penalty", 2.5), ("frequency_penalty", -10), ("frequency_penalty", {}),
        ("repetition_penalty", 0), ("repetition_penalty", -1), ("repetition_penalty", False),
        ("repetition_penalty", 10**400),
        ("seed", 1.5), ("seed", "1"), ("seed", True), ("seed", 2**63), ("seed", -(2**63) - 1),
        ("stop", ""), ("stop", [""]), ("stop", ["a", "b", "c", "d", "e"]), ("stop", [1]),
        ("stop", 5), ("stop", {"a": 1}), ("stop", [["a"]]), ("stop", ["a", None]),
        ("ignore_eos", 1), ("ignore_eos", "true"),
        ("stream", "yes"), ("stream", 1), ("stream", "true"), ("stream", []),
        ("user", 1), ("user", ["u"]),
        ("session_id", 1), ("session_id", ""), ("session_id", {"id": "s"}),
    ],
)  # fmt: skip
def test_invalid_field(kind, field, value):
    bad(kind, field, **{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_completion_tokens", v) for v in (0, -3, 1.0, False, "2")],
)
def test_invalid_max_completion_tokens(field, value):
    bad("chat", field, **{field: value})


def test_inf_from_overflowing_float_literal_rejected():
    raw = body("chat")[:-1] + b', "repetition_penalty": 1e999}'
    err = error("chat", raw)
    assert (err.status, err.param) == (400, "repetition_penalty")


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_n_choices_and_best_of(kind):
    assert parse(kind, n=3).n == 3 and parse(kind, n=2, best_of=2).n == 2
    assert "best_of" in bad(kind, "best_of", n=1, best_of=3).message
    bad(kind, "n", n=100)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("n", [0, -1, 1.0, "1", True])
def test_n_must_be_positive_int(kind, n):
    bad(kind, "n", n=n)


@pytest.mark.parametrize(("kind", "field", "value"), [
    ("completion", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("chat", "tools", "x"),
    ("chat", "functions", [{"name": "f"}]),
    ("completion", "functions", [{"name": "f"}]),
    ("chat", "x_unknown", 1),
    ("completion", "top_logprobs", 2),
    ("chat", "echo", True),
    ("chat", "use_beam_search", True),
    ("completion", "suffix", "tail"),
])
def test_parameters_not_honoured_are_refused_by_name(kind, field, value):
    bad(kind, field, **{field: value})


@pytest.mark.parametrize("key", ["chat_template", "add_generation_prompt", "tools"])
def test_template_kwargs_may_not_set_the_template_or_the_request_fields(key):
    bad("chat", f"chat_template_kwargs.{key}", chat_template_kwargs={key: "x"})
    assert parse("chat", chat_template_kwargs={"enable_thinking": False}).template_options


def test_unknown_parameters_at_default_are_accepted():
    req = parse("chat", use_beam_search=False, skip_special_tokens=True, store=False, n=1)
    assert req.n == 1


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {}}, "stream_options"),
        ({"stream": True, "stream_options": True}, "stream_options"),
        ({"stream": True, "stream_options": ["include_usage"]}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, USAGE_PARAM),
        ({"stream": True, "stream_options": {"include_usage": 1}}, USAGE_PARAM),
    ],
)
def test_invalid_stream_options(kind, fields, param):
    bad(kind, param, **fields)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_include_usage(kind):
    assert parse(kind, stream=True, stream_options={"include_usage": True}).include_usage
    assert not parse(kind, stream=True, stream_options={}).include_usage
    assert not parse(kind, stream=True).include_usage


@pytest.mark.parametrize(("echo", "message"), [("no", "boolean"), (1, "boolean")])
def test_completion_echo(echo, message):
    assert message in bad("completion", "echo", echo=echo).message
    assert parse("completion", echo=True).echo


# --- check_context -------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_tokens", "max_tokens", "max_model_len", "expected"),
    [(10, 5, 100, 5), (95, 5, 100, 5), (10, None, 100, 90), (99, None, 100, 1), (0, None, 8, 8)],
)
def test_check_context_fits(prompt_tokens, max_tokens, max_model_len, expected):
    assert check_context(prompt_tokens, max_tokens, max_model_len) == expected


@pytest.mark.parametrize(
    ("prompt_tokens", "max_tokens", "max_model_len", "message"),
    [
        (
            96, 5, 100,
            "This model's maximum context length is 100 tokens. However, you requested 101 "
            "tokens (96 in the messages, 5 in the completion). Please reduce the length of the "
            "messages or completion.",
        ),
        (
            100, 1, 100,
            "This model's maximum context length is 100 tokens. However, you requested 101 "
            "tokens (100 in the messages, 1 in the completion). Please reduce the length of the "
            "messages or completion.",
        ),
        (
            10, 10**12, 4096,
            "This model's maximum context length is 4096 tokens. However, you requested "
            "1000000000010 tokens (10 in the messages, 1000000000000 in the completion). Please "
            "reduce the length of the messages or completion.",
        ),
        (
            100, None, 100,
            "This model's maximum context length is 100 tokens. However, your request has 100 "
            "input tokens. Please reduce the length of the input messages.",
        ),
        (
            150, None, 100,
            "This model's maximum context length is 100 tokens. However, your request has 150 "
            "input tokens. Please reduce the length of the input messages.",
        ),
    ],
)  # fmt: skip
def test_check_context_exceeded(prompt_tokens, max_tokens, max_model_len, message):
    with pytest.raises(APIError) as info:
        check_context(prompt_tokens, max_tokens, max_model_len)
    err = info.value
    assert (err.status, err.type) == (400, "invalid_request_error")
    assert err.code == "context_length_exceeded"
    assert err.message == message


# --- errors and builders -------------------------------------------------------------


def test_api_error_shape():
    err = APIError(429, "slow down", type="rate_limit_error", param="x", code="busy")
    assert isinstance(err, Exception) and str(err) == "slow down"
    assert (err.status, err.message, err.type, err.param, err.code) == (
        429, "slow down", "rate_limit_error", "x", "busy"
    )  # fmt: skip
    assert err.body() == {
        "error": {"message": "slow down", "type": "rate_limit_error", "param": "x", "code": "busy"}
    }
    plain = APIError(400, "no")
    assert plain.body() == {
        "error": {"message": "no", "type": "invalid_request_error", "param": None, "code": None}
    }


@pytest.mark.parametrize(("kind", "prefix"), [("chat", "chatcmpl-"), ("completion", "cmpl-")])
def test_completion_id(kind, prefix):
    ids = {completion_id(kind) for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(re.escape(prefix) + "[0-9a-f]{32}", i) for i in ids)



@pytest.mark.parametrize(
    ("data", "seq", "expected"),
    [
        ("[DONE]", 1, b"id: 1\ndata: [DONE]\n\n"),
        ({"a": 1, "b": [1, None]}, 2, b'id: 2\ndata: {"a":1,"b":[1,null]}\n\n'),
        # Line breaks inside JSON strings are escaped, so they cannot break framing.
        ({"t": "a\nb\r"}, 3, b'id: 3\ndata: {"t":"a\\nb\\r"}\n\n'),
        # Payloads are ASCII JSON: any text, even a lone surrogate, is a valid escape.
        ({"t": "é✓\ud800"}, 4, b'id: 4\ndata: {"t":"\\u00e9\\u2713\\ud800"}\n\n'),
    ],
)
def test_sse_frames(data, seq, expected):
    event = Event(seq, data if isinstance(data, str) else payload(data))
    assert frame([event]) == expected
    assert plain_frame([event]) == expected.split(b"\n", 1)[1]       # no id: line


@pytest.mark.parametrize("count", [1, 3])
def test_the_pushed_writers_chunks_hold_the_same_frames(count):
    data = [payload({"t": f"é{i}\n"}) for i in range(count)]
    events = [Event(7 + i, d) for i, d in enumerate(data)]
    for chunked, render in ((chunked_events, frame), (plain_chunked_events, plain_frame)):
        body = render(events)
        assert chunked(7, data) == b"%x\r\n" % len(body) + body + b"\r\n"


def test_sse_frame_round_trips_a_chunk():
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": None,
                          "finish_reason": None}]}
    raw = frame([Event(1, payload(chunk))])
    assert raw.startswith(b"id: 1\ndata: ") and raw.endswith(b"\n\n")
    assert json.loads(raw[len(b"id: 1\ndata: "):-2]) == chunk
    assert frame([]) == b": keepalive\n\n"


# --- fuzz ----------------------------------------------------------------------

KEYS = [
    "model", "messages", "prompt", "role", "content", "type", "text", "max_tokens",
    "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
    "stream_options", "include_usage", "ignore_eos", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "tools", "functions", "echo", "user", "session_id", "logprobs", "x",
]  # fmt: skip
SCALARS = [
    None, True, False, 0, 1, -1, 2, 2**31, 2**63, -(2**70), 10**30, 0.0, 0.5, -0.5, 1.5, 2.5,
    1e308, -1e-300, "", "m", "user", "text", "hi", "é\u2028",
    "\ud800", "x" * 300,
]  # fmt: skip


def random_value(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if roll < 0.01:
        return rng.choice([float("nan"), float("inf")])  # serialised as invalid JSON
    if depth > 3 or roll < 0.55:
        return rng.choice(SCALARS)
    if roll < 0.75:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {rng.choice(KEYS): random_value(rng, depth + 1) for _ in range(rng.randrange(5))}


def random_body(rng: random.Random, kind: str) -> bytes:
    roll = rng.random()
    if roll < 0.1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
    if roll < 0.25:
        return json.dumps(random_value(rng)).encode()
    # Mostly: a valid body with a few fields damaged, so fuzzing reaches deep
    # validation instead of stopping at "model".
    out = json.loads(body(kind))
    for _ in range(rng.randrange(1, 4)):
        out[rng.choice(KEYS)] = random_value(rng)
    raw = json.dumps(out).encode()
    if rng.random() < 0.1:
        raw = raw[: rng.randrange(len(raw))]
    return raw


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_fuzz_only_api_errors_escape(kind):
    rng = random.Random(20240601)
    outcomes = {"ok": 0, 400: 0, 404: 0}
    for _ in range(300):
        raw = random_body(rng, kind)
        try:
            req = parse_request(kind, raw, MODELS)
        except APIError as err:
            assert err.status in (400, 404), (raw, err.status)
            json.dumps(err.body())
            outcomes[err.status] += 1
        else:
            assert isinstance(req, CompletionRequest) and req.kind == kind
            outcomes["ok"] += 1
    # Guard against a generator that never reaches one of the outcomes.
    assert all(outcomes.values()), outcomes
