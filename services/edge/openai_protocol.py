"""OpenAI-compatible request parsing and response building for the edge proxy.

Everything here is pure: bytes in, dataclasses or dicts out. The aiohttp layer
owns I/O and only has to send ``err.body()`` with ``err.status`` for an
``APIError``. Keeping it pure lets the client-facing contract be tested and
fuzzed without a server.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, replace
from typing import Any, Collection, Literal

from . import parameters

Kind = Literal["chat", "completion"]

_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # seed range, as vLLM checks it
# Cap for token ids and top_k: no vocabulary comes near it, and it keeps any
# downstream int32 conversion from overflowing.
_INT32_MAX = 2**31 - 1
_MAX_STOP = 4
_MAX_STOP_CHARS = 256
_MAX_MESSAGES = 1024
_MAX_CHOICES = 16
# Template arguments a request may not pass in chat_template_kwargs: the template itself
# (vLLM refuses a request's own template by default) and what the edge sets from fields.
_TEMPLATE_OWN = frozenset({"chat_template", "add_generation_prompt", "continue_final_message",
                           "tools", "documents", "conversation", "tokenize", "messages",
                           "return_dict", "return_assistant_tokens_mask"})
_TOOL_KEYS = frozenset({"tool_calls", "tool_call_id", "name", "function_call"})


class APIError(Exception):
    """An error that reaches the client as OpenAI-shaped JSON with an HTTP status."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error",
        param: str | None = None, code: str | None = None, headers: dict | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.headers = headers or {}          # sent with the error (Retry-After, x-ratelimit-*)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": error}


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Validated sampling parameters; defaults are OpenAI's (vLLM's for its extensions)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    max_tokens: int | None = None  # None = until the context is full
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None             # top alternatives per output token; None = none
    prompt_logprobs: int | None = None      # the same per prompt token (echo)
    constraint: tuple[str, Any] | None = None   # (kind, value): parameters.response_format


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated /v1/chat/completions or /v1/completions request.

    ``messages`` is set only for chat, ``prompt`` only for completion. Messages
    are normalised to ``{"role": str, "content": str}`` so the chat template
    never sees content-part lists or stray keys.
    """

    kind: Kind
    model: str
    messages: tuple[dict, ...]
    prompt: str | tuple[int, ...] | None
    sampling: SamplingOptions
    stream: bool
    include_usage: bool
    echo: bool
    user: str | None
    session_id: str | None
    n: int = 1
    tools: Any = None                       # tools.ToolRequest, when the request has tools
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None  # None: the endpoint's default
    template_options: tuple[tuple[str, Any], ...] = ()  # chat template arguments
    cache_salt: str = ""                    # vLLM's extension; combined with the tenant's


def _bad(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param)


# --- field readers ----------------------------------------------------------
# JSON null counts as "absent" throughout: OpenAI SDKs routinely send unset
# optional fields as null.


def _bool(obj: dict, key: str, *, param: str | None = None) -> bool:
    value = obj.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{key}' must be a boolean", param or key)
    return value


def _int(obj: dict, key: str, *, lo: int | None = None, hi: int | None = None) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    # bool is an int subclass in Python; `true` must not quietly become 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{key}' must be an integer", key)
    if lo is not None and value < lo:
        raise _bad(f"'{key}' must be at least {lo}, got {value}", key)
    if hi is not None and value > hi:
        raise _bad(f"'{key}' must be at most {hi}, got {value}", key)
    return value


def _float(
    obj: dict, key: str, default: float, lo: float, hi: float | None, rule: str,
    *, lo_open: bool = False,
) -> float:  # fmt: skip
    value = obj.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"'{key}' must be a number", key)
    try:
        number = float(value)
    except OverflowError:  # a JSON integer too big for a float
        number = math.inf
    # 1e999 decodes to inf, which would slip past an open-ended range.
    too_low = number <= lo if lo_open else number < lo
    if not math.isfinite(number) or too_low or (hi is not None and number > hi):
        raise _bad(f"'{key}' must be {rule}, got {value}", key)
    return number


def _optional_str(obj: dict, key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise _bad(f"'{key}' must be a string", key)
    return value


# --- structured fields --------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")  # Python's json accepts NaN/Infinity


def _load_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise _bad(f"Request body is not valid JSON: {exc.msg} (char {exc.pos})", None) from None
    # Bad UTF-8 and the int-digits limit raise ValueError; pathological nesting
    # exhausts the decoder's recursion.
    except (ValueError, RecursionError):
        raise _bad("Request body is not valid JSON", None) from None
    if not isinstance(body, dict):
        raise _bad("Request body must be a JSON object", None)
    return body


def text_parts(content: Any, param: str, kinds: tuple[str, ...] = ("text",)) -> str | list[str]:
    """A message's content: a string as it is, or the texts of its array of text parts
    (each part's type one of `kinds`); anything else is a 400 naming where."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"'{param}' must be a string or an array of text parts", param)
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in kinds:
            raise _bad(f"'{where}' must be a text part ({' or '.join(kinds)}); only text "
                       "content is supported", where)
        if not isinstance(part.get("text"), str):
            raise _bad(f"'{where}.text' must be a string", f"{where}.text")
        texts.append(part["text"])
    return texts


def _flatten_content(content: Any, param: str) -> str:
    texts = text_parts(content, param)
    # vLLM's joiner, so prompts (and prefix-cache hits) match a direct vLLM call.
    return texts if isinstance(texts, str) else "\n".join(texts)


def _parse_messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if messages is None:
        raise _bad("'messages' is a required property", "messages")
    if not isinstance(messages, list):
        raise _bad("'messages' must be an array", "messages")
    if not messages:
        raise _bad("'messages' must contain at least one message", "messages")
    if len(messages) > _MAX_MESSAGES:
        raise _bad(f"'messages' must hold at most {_MAX_MESSAGES} messages, got "
                   f"{len(messages)}", "messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad(f"'{where}' must be an object", where)
        role = msg.get("role")
        # isinstance first: an unhashable role would make the set lookup raise.
        if not isinstance(role, str) or role not in _ROLES:
            raise _bad(f"'{where}.role' must be one of {sorted(_ROLES)}", f"{where}.role")
        if _TOOL_KEYS.intersection(msg) or (role == "assistant" and msg.get("content") is None):
            from .tools import template_message     # tools.py raises this module's APIError
            shaped = template_message(msg, where)
            shaped["content"] = _flatten_content(shaped["content"], f"{where}.content")
            out.append(shaped)
            continue
        content = _flatten_content(msg.get("content"), f"{where}.content")
        out.append({"role": role, "content": content})
    return tuple(out)


def _parse_prompt(body: dict) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("'prompt' is a required property", "prompt")
    # OpenAI accepts a batch of prompts; unwrap a batch of one and refuse more,
    # since each request maps to exactly one engine sequence here.
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise _bad("only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, (str, list)) and not prompt:
        raise _bad("'prompt' must not be empty", "prompt")
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        raise _bad("'prompt' must be a string or an array of token ids", "prompt")
    if not all(type(t) is int and 0 <= t <= _INT32_MAX for t in prompt):
        raise _bad("'prompt' token ids must be non-negative integers", "prompt")
    return tuple(prompt)


def _parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    ok = isinstance(value, list) and len(value) <= _MAX_STOP
    if not ok or not all(isinstance(s, str) and s for s in value):
        msg = f"'stop' must be a non-empty string or a list of up to {_MAX_STOP} non-empty strings"
        raise _bad(msg, "stop")
    if any(len(s) > _MAX_STOP_CHARS for s in value):
        raise _bad(f"each 'stop' sequence must be at most {_MAX_STOP_CHARS} characters", "stop")
    return tuple(value)


def _parse_sampling(kind: Kind, body: dict) -> SamplingOptions:
    max_tokens = _int(body, "max_tokens", lo=1)
    if kind == "chat":
        # OpenAI's chat API renamed max_tokens; the newer name wins when both are sent.
        newer = _int(body, "max_completion_tokens", lo=1)
        max_tokens = max_tokens if newer is None else newer
    top_k = _int(body, "top_k", lo=-1, hi=_INT32_MAX)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (isinstance(stop_ids, list) and all(
            type(t) is int and 0 <= t <= _INT32_MAX for t in stop_ids)):
        raise _bad("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    constraint = _constraint(body)
    return SamplingOptions(
        temperature=_float(body, "temperature", 1.0, 0.0, 2.0, "between 0 and 2"),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, "in (0, 1]", lo_open=True),
        top_k=0 if top_k is None or top_k == -1 else top_k,
        max_tokens=max_tokens,
        seed=_int(body, "seed", lo=_INT64_MIN, hi=_INT64_MAX),
        stop=_parse_stop(body.get("stop")),
        ignore_eos=_bool(body, "ignore_eos"),
        presence_penalty=_float(body, "presence_penalty", 0.0, -2.0, 2.0, "between -2 and 2"),
        frequency_penalty=_float(body, "frequency_penalty", 0.0, -2.0, 2.0, "between -2 and 2"),
        repetition_penalty=_float(
            body, "repetition_penalty", 1.0, 0.0, None, "greater than 0", lo_open=True
        ),
        min_p=_float(body, "min_p", 0.0, 0.0, 1.0, "between 0 and 1"),
        min_tokens=_int(body, "min_tokens", lo=0, hi=_INT32_MAX) or 0,
        logit_bias=_refusing(parameters.logit_bias, body.get("logit_bias"), _INT32_MAX),
        stop_token_ids=tuple(stop_ids or ()),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
        logprobs=_logprobs(kind, body),
        prompt_logprobs=_logprobs(kind, body) if kind == "completion" and _bool(body, "echo")
        else None,
        constraint=constraint,
    )


def _parse_tools(body: dict):
    from .tools import parse_tools          # tools.py raises this module's APIError
    return parse_tools(body)


def _refusing(read, *args):
    try:
        return read(*args)
    except parameters.Refused as e:
        raise _bad(str(e), e.param) from None


def _logprobs(kind: Kind, body: dict) -> int | None:
    """How many alternatives per token to return (None: no logprobs)."""
    cap = parameters.MAX_TOP_LOGPROBS[kind]
    if kind == "completion":
        return _int(body, "logprobs", lo=0, hi=cap)
    top = _int(body, "top_logprobs", lo=0, hi=cap)
    if not _bool(body, "logprobs"):
        if top:
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def _constraint(body: dict) -> tuple[str, Any] | None:
    formats = _refusing(parameters.response_format, body.get("response_format"))
    outputs = _refusing(parameters.structured_outputs, body.get("structured_outputs"))
    if formats and outputs:
        raise _bad("'response_format' and 'structured_outputs' cannot both constrain the "
                   "output", "structured_outputs")
    return formats or outputs


def _choices(body: dict) -> int:
    """`n`, and `best_of` where it asks for nothing more than n (vLLM has no best_of)."""
    n = _int(body, "n", lo=1, hi=_MAX_CHOICES) or 1
    best_of = _int(body, "best_of", lo=1)
    if best_of is not None and best_of != n:
        raise _bad("'best_of' other than 'n' is not supported", "best_of")
    return n


def _truncation(body: dict) -> int | None:
    """`truncate_prompt_tokens`: tokens to keep, or -1 for the context's length."""
    keep = _int(body, "truncate_prompt_tokens", lo=-1, hi=_INT32_MAX)
    if keep == 0:
        raise _bad("'truncate_prompt_tokens' must be -1 or at least 1", "truncate_prompt_tokens")
    return keep


def _template_options(kind: Kind, body: dict) -> tuple[tuple[str, Any], ...]:
    """The chat template's arguments a chat request may set."""
    if kind != "chat":
        return ()
    out = []
    for key in ("add_generation_prompt", "continue_final_message"):
        if body.get(key) is not None:
            out.append((key, _bool(body, key)))
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise _bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        for key in kwargs:
            if key in _TEMPLATE_OWN:     # set by the request's own fields, or not at all
                raise _bad(f"'chat_template_kwargs.{key}' is not allowed here",
                           f"chat_template_kwargs.{key}")
        out.append(("chat_template_kwargs", json.dumps(kwargs, sort_keys=True)))
    return tuple(out)


def _cache_salt(body: dict) -> str:
    """vLLM's `cache_salt`: a non-empty string of at most 256 bytes."""
    salt = _optional_str(body, "cache_salt")
    if salt is None:
        return ""
    if not salt or len(salt.encode()) > parameters.MAX_CACHE_SALT_BYTES:
        raise _bad(f"'cache_salt' must be a non-empty string of at most "
                   f"{parameters.MAX_CACHE_SALT_BYTES} bytes", "cache_salt")
    return salt


def parse_request(kind: Kind, raw: bytes, served_models: Collection[str]) -> CompletionRequest:
    """Parse and validate a request body; any client mistake raises ``APIError``."""
    body = _load_object(raw)
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("'model' is a required property and must be a string", "model")
    if model not in served_models:
        msg = f"The model `{model}` does not exist."
        raise APIError(404, msg, param="model", code="model_not_found")

    _refusing(parameters.check_known, kind, body)
    messages = _parse_messages(body) if kind == "chat" else ()
    prompt = _parse_prompt(body) if kind == "completion" else None
    tool_request = _parse_tools(body) if kind == "chat" else None
    sampling = _parse_sampling(kind, body)
    if tool_request is not None and (forced := tool_request.constraint()) is not None:
        if sampling.constraint is not None:
            raise _bad("a forced tool call cannot be combined with 'response_format'",
                       "tool_choice")
        sampling = replace(sampling, constraint=("json_schema", forced))

    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        if not stream:
            raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = _bool(options or {}, "include_usage", param="stream_options.include_usage")

    # Chat has no echo in OpenAI's API, so only completions read the field.
    echo = kind == "completion" and _bool(body, "echo")
    session_id = _optional_str(body, "session_id")
    if session_id == "":
        raise _bad("'session_id' must not be empty", "session_id")

    return CompletionRequest(
        kind=kind, model=model, messages=messages, prompt=prompt, sampling=sampling,
        stream=stream, include_usage=include_usage, echo=echo,
        user=_optional_str(body, "user"), session_id=session_id, n=_choices(body),
        tools=tool_request,
        truncate_prompt_tokens=_truncation(body),
        add_special_tokens=None if body.get("add_special_tokens") is None
        else _bool(body, "add_special_tokens"),
        template_options=_template_options(kind, body),
        cache_salt=_cache_salt(body),
    )  # fmt: skip


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """Return the effective max_tokens, or raise 400 if the request cannot fit the context."""
    limit = f"This model's maximum context length is {max_model_len} tokens. However, "
    if max_tokens is None:
        if prompt_tokens >= max_model_len:
            msg = (f"{limit}your request has {prompt_tokens} input tokens. "
                   "Please reduce the length of the input messages.")  # fmt: skip
            raise APIError(400, msg, code="context_length_exceeded")
        return max_model_len - prompt_tokens
    if prompt_tokens + max_tokens > max_model_len:
        msg = (f"{limit}you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in "
               f"the messages, {max_tokens} in the completion). Please reduce the length of "
               "the messages or completion.")  # fmt: skip
        raise APIError(400, msg, code="context_length_exceeded")
    return max_tokens


# --- response ids ----------------------------------------------------------------
# The answers themselves are shaped per choice (choices.py) and put together in events.py.


def completion_id(kind: Kind) -> str:
    """A fresh response id with OpenAI's per-endpoint prefix."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
