"""OpenAI's Responses API, request side: a `POST /v1/responses` body as the chat
request the edge already serves.

A response is a chat completion underneath (one choice): `input` and
`instructions` become messages (after the conversation of `previous_response_id`,
which the caller looks up), `text.format` becomes `response_format`, flat function
tools become chat tools, `max_output_tokens` becomes `max_completion_tokens`. The
chat parser then validates everything it knows, and a mistake it finds is reported
under the Responses field's name. Every other field is refused with a 400 naming
it. Pure: no I/O.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .openai_protocol import APIError, text_parts

# Fields read here; anything else is refused by name.
KNOWN = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text",
    "tools", "tool_choice", "parallel_tool_calls", "stream", "background", "store",
    "previous_response_id", "metadata", "user", "truncation", "include", "service_tier",
    "prompt_cache_key", "safety_identifier", "seed", "top_k", "stop",
})
# name -> the only accepted value (sent at it, it changes nothing).
DEFAULT_ONLY: dict[str, Any] = {"truncation": "disabled", "include": [], "service_tier": "auto"}
_MAX_METADATA = 16                      # OpenAI's limits on metadata
_MAX_KEY, _MAX_VALUE = 64, 512
_RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9]{1,64}$")
# A chat field's name, as the Responses field that set it (errors name what was sent).
_RENAMED = (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
            ("messages", "input"), (".function.", "."))


def _bad(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param)


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def valid_response_id(value: str) -> bool:
    return bool(_RESPONSE_ID.match(value))


@dataclass(frozen=True, slots=True)
class ResponseRequest:
    """A validated /v1/responses request; `messages` are its own turns (instructions
    first), to go after the previous response's conversation."""

    model: str
    instructions: str | None
    messages: tuple[dict, ...]
    stream: bool
    background: bool
    store: bool
    previous_response_id: str | None
    metadata: dict
    text_format: dict
    tools: tuple[dict, ...]
    tool_choice: Any
    parallel_tool_calls: bool
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    session: str | None             # prompt_cache_key: a conversation's placement key
    body: dict                      # the fields the chat parser reads

    def chat_body(self, history: list[dict], session: str | None) -> bytes:
        """The chat request: the earlier turns, this request's; `session`: the key
        that keeps the chain on one decode worker."""
        instructions = ([{"role": "system", "content": self.instructions}]
                        if self.instructions else [])
        body = {**self.body, "messages": instructions + history + list(self.messages)}
        if session:
            body["session_id"] = session
        return json.dumps(body).encode()


def chat_error(e: APIError) -> APIError:
    """An error of the chat parser, renamed to the Responses field it came from."""
    param, message = e.param, e.message
    for chat, ours in _RENAMED:
        param = param.replace(chat, ours) if param else param
        message = message.replace(chat, ours)
    return APIError(e.status, message, type=e.type, param=param, code=e.code)


def _check_known(body: dict) -> None:
    for key, value in body.items():
        if value is None:
            continue                        # SDKs send unset fields as null
        if key not in KNOWN:
            raise _bad(f"'{key}' is not a supported parameter of /v1/responses", key)
        if key in DEFAULT_ONLY and value != DEFAULT_ONLY[key]:
            raise _bad(f"'{key}' is supported only at its default "
                       f"({json.dumps(DEFAULT_ONLY[key])})", key)


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"'{key}' must be a boolean", key)
    return value


def _text(content: Any, where: str) -> str | list:
    """A message's content: a string, or its text parts (input_text / output_text) as
    chat's text parts."""
    texts = text_parts(content, where, ("input_text", "output_text", "text"))
    return texts if isinstance(texts, str) else [{"type": "text", "text": t} for t in texts]


def _item(item: Any, where: str) -> dict:
    """One input item as a chat message."""
    if not isinstance(item, dict):
        raise _bad(f"'{where}' must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise _bad(f"'{where}.role' must be one of user, assistant, system, developer",
                       f"{where}.role")
        return {"role": role, "content": _text(item.get("content"), f"{where}.content")}
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise _bad(f"'{where}.{key}' must be a string", f"{where}.{key}")
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}]}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
            raise _bad(f"'{where}' needs 'call_id' and 'output' strings", where)
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
    raise _bad(f"'{where}.type' {kind!r} is not supported (message, function_call, "
               "function_call_output)", f"{where}.type")


def _input(body: dict) -> tuple[dict, ...]:
    value = body.get("input")
    if isinstance(value, str):
        return ({"role": "user", "content": value},)
    if not isinstance(value, list) or not value:
        raise _bad("'input' is required: a string or a non-empty array of items", "input")
    out: list[dict] = []
    for i, item in enumerate(value):
        message = _item(item, f"input[{i}]")
        if out and message.get("tool_calls") and out[-1].get("tool_calls"):
            out[-1]["tool_calls"] += message["tool_calls"]     # parallel calls: one turn
        else:
            out.append(message)
    return tuple(out)


def _tools(value: Any) -> list[dict] | None:
    """Flat function tools as chat's {"type": "function", "function": {...}}."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad("'tools' must be an array", "tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad(f"'tools[{i}].type' must be 'function'; only function tools are "
                       "supported", f"tools[{i}].type")
        out.append({"type": "function", "function": {
            k: v for k, v in tool.items() if k != "type" and v is not None}})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict):
        if value.get("type") != "function" or not isinstance(value.get("name"), str):
            raise _bad("'tool_choice' must be none, auto, required or "
                       '{"type": "function", "name": ...}', "tool_choice")
        return {"type": "function", "function": {"name": value["name"]}}
    return value


def _format(text: Any) -> tuple[dict, dict | None]:
    """`text` (its `format`) as it echoes in the Response, and as chat's response_format."""
    if text is None:
        return {"format": {"type": "text"}}, None
    if not isinstance(text, dict) or set(text) - {"format"}:
        raise _bad("'text' must be an object with only 'format'", "text")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {"format": fmt}, None
    if kind == "json_object":
        return {"format": fmt}, {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt.get(k) for k in ("name", "schema", "strict", "description")
                if fmt.get(k) is not None}
        return {"format": fmt}, {"type": "json_schema", "json_schema": spec}
    raise _bad("'text.format.type' must be one of text, json_object, json_schema",
               "text.format.type")


def _metadata(value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > _MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= _MAX_KEY and isinstance(v, str)
            and len(v) <= _MAX_VALUE for k, v in value.items()):
        raise _bad(f"'metadata' must be an object of at most {_MAX_METADATA} string keys "
                   f"(<= {_MAX_KEY} chars) and string values (<= {_MAX_VALUE} chars)",
                   "metadata")
    return value


def _optional_str(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise _bad(f"'{key}' must be a non-empty string", key)
    return value


def parse_response_request(raw: bytes) -> ResponseRequest:
    """Validate a /v1/responses body; the chat parser checks the rest (chat_body)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise _bad("Request body is not valid JSON", None) from None
    if not isinstance(body, dict):
        raise _bad("Request body must be a JSON object", None)
    _check_known(body)
    store, background = _flag(body, "store", True), _flag(body, "background", False)
    if background and not store:
        raise _bad("'background' needs 'store': true (a background response is read back "
                   "from the store)", "background")
    previous = _optional_str(body, "previous_response_id")
    if previous is not None and not valid_response_id(previous):
        raise APIError(404, f"Previous response with id '{previous}' not found.",
                       type="invalid_request_error", param="previous_response_id",
                       code="previous_response_not_found")
    echo, response_format = _format(body.get("text"))
    tool_choice = _tool_choice(body.get("tool_choice"))
    chat = {"model": body.get("model"), "max_completion_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": _tools(body.get("tools")), "tool_choice": tool_choice,
            "parallel_tool_calls": body.get("parallel_tool_calls"),
            "response_format": response_format, "stream": False,
            "user": body.get("safety_identifier") or body.get("user"),
            "seed": body.get("seed"), "top_k": body.get("top_k"), "stop": body.get("stop")}
    instructions = _optional_str(body, "instructions")
    return ResponseRequest(
        model=body.get("model"), instructions=instructions, messages=_input(body),
        stream=_flag(body, "stream", False), background=background, store=store,
        previous_response_id=previous, metadata=_metadata(body.get("metadata")),
        text_format=echo, tools=tuple(body.get("tools") or ()),
        tool_choice=body.get("tool_choice") or "auto",
        parallel_tool_calls=_flag(body, "parallel_tool_calls", True),
        max_output_tokens=body.get("max_output_tokens"), temperature=body.get("temperature"),
        top_p=body.get("top_p"), session=_optional_str(body, "prompt_cache_key"),
        body={k: v for k, v in chat.items() if v is not None})
