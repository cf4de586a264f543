"""OpenAI tool calling at the edge, request side: the request's tools and
tool_choice, the tool turns of a conversation, the JSON schema that forces a
call, and which stream shapes the answer (tool_parsers.py reads the output).

vLLM's OpenAI server is the reference throughout, so a client sees the same
prompts, schemas, errors and finish reasons as from a direct vLLM call. Pure:
no I/O and no vLLM; every client mistake is an ``APIError`` 400 that names the
exact parameter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from .openai_protocol import APIError
from .tool_parsers import (
    NamedCallStream,
    RequiredCallsStream,
    ToolCall,
    ToolParser,
    ToolStream,
    collect,
)

Choice = Literal["none", "auto", "required", "named"]

_MAX_TOOLS = 128  # OpenAI's limit per request
_EMPTY_OBJECT = {"type": "object", "properties": {}}
_NAMED_USAGE = 'use {"type": "function", "function": {"name": "my_function"}}'


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's validated tools and tool_choice.

    ``tools`` are the request's tool objects as given (checked, never changed);
    ``named`` is the function a named tool_choice forces, else None.
    """

    tools: tuple[dict, ...]
    choice: Choice
    named: str | None
    parallel: bool

    def template_tools(self, exclude_when_none: bool = False) -> list[dict] | None:
        """The ``tools=`` for the chat template, shaped as vLLM passes them (absent
        fields as null), so prompts match. vLLM keeps them for tool_choice "none"
        unless run with --exclude-tools-when-tool-choice-none."""
        if self.choice == "none" and exclude_when_none:
            return None
        return [_template_tool(tool["function"]) for tool in self.tools]

    def constraint(self) -> str | None:
        """The JSON schema (text) the output must follow: the named function's
        parameters, or for "required" an array of calls; None when not forced."""
        if self.choice == "named":
            return json.dumps(_parameters(self._function(self.named)))
        if self.choice != "required":
            return None
        items = [_call_schema(tool["function"]) for tool in self.tools]
        schema: dict[str, Any] = {
            "type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items},
        }  # fmt: skip
        if not self.parallel:
            schema["maxItems"] = 1
        if defs := _merged_defs(self.tools):
            schema["$defs"] = defs  # refs inside parameters point at the root
        return json.dumps(schema)

    def _function(self, name: str | None) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def _template_tool(function: dict) -> dict:
    out = {
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    if function.get("strict") is not None:
        out["strict"] = function["strict"]
    return {"type": "function", "function": out}


def _parameters(function: dict) -> dict:
    # No (or empty) parameters still means the arguments are a JSON object.
    return function.get("parameters") or _EMPTY_OBJECT


def _call_schema(function: dict) -> dict:
    parameters = {k: v for k, v in _parameters(function).items() if k != "$defs"}
    properties = {"name": {"type": "string", "enum": [function["name"]]}, "parameters": parameters}
    return {"properties": properties, "required": ["name", "parameters"]}


def _merged_defs(tools: tuple[dict, ...]) -> dict:
    """Every tool's ``$defs`` in one map, as the "required" schema's root holds them."""
    merged: dict = {}
    for i, tool in enumerate(tools):
        defs = (tool["function"].get("parameters") or {}).get("$defs", {})
        param = f"tools[{i}].function.parameters.$defs"
        if not isinstance(defs, dict):
            raise _bad(f"'{param}' must be an object", param)
        for key, schema in defs.items():
            if merged.setdefault(key, schema) != schema:
                raise _bad(f"'{param}' redefines '{key}' differently from an earlier tool", param)
    return merged


# --- request fields -------------------------------------------------------------
# JSON null counts as absent, as in openai_protocol.


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tool settings, or None when it has no tools."""
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise _bad(f"'{key}' is deprecated and not supported; use 'tools' and "
                       "'tool_choice' instead", key)  # fmt: skip
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    tools = _parse_tool_list(body.get("tools"))
    choice, named = _parse_choice(body.get("tool_choice"), tools)
    if not tools:
        return None
    if choice == "required":
        _merged_defs(tools)  # a conflict is the client's mistake: say so now, not mid-decode
    return ToolRequest(tools, choice, named, parallel is not False)


def _parse_tool_list(tools: Any) -> tuple[dict, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise _bad("'tools' must be an array", "tools")
    if not tools:
        raise _bad("'tools' must not be empty; omit it to send no tools", "tools")
    if len(tools) > _MAX_TOOLS:
        raise _bad(f"'tools' must hold at most {_MAX_TOOLS} tools, got {len(tools)}", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = _check_tool(tool, f"tools[{i}]")
        if name in seen:  # a named tool_choice or a call would be ambiguous
            raise _bad(f"tool name '{name}' is used twice", f"tools[{i}].function.name")
        seen.add(name)
    return tuple(tools)


def _function_of(item: Any, where: str) -> dict:
    """The `function` object of a tool or a call: {"type": "function", "function": {...}}."""
    if not isinstance(item, dict):
        raise _bad(f"'{where}' must be an object", where)
    if item.get("type") not in (None, "function"):
        raise _bad(f"'{where}.type' must be 'function'", f"{where}.type")
    function = item.get("function")
    if not isinstance(function, dict):
        raise _bad(f"'{where}.function' is required and must be an object", f"{where}.function")
    return function


def _check_tool(tool: Any, where: str) -> str:
    function = _function_of(tool, where)
    where = f"{where}.function"
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"'{where}.name' must be a non-empty string", f"{where}.name")
    for key, kind, label in (("description", str, "a string"),
                             ("parameters", dict, "a JSON Schema object"),
                             ("strict", bool, "a boolean")):  # fmt: skip
        value = function.get(key)
        if value is not None and not isinstance(value, kind):
            raise _bad(f"'{where}.{key}' must be {label}", f"{where}.{key}")
    return name


def _parse_choice(choice: Any, tools: tuple[dict, ...]) -> tuple[Choice, str | None]:
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice == "none":
        return "none", None
    if not tools:
        raise _bad("'tool_choice' needs 'tools' to be set", "tool_choice")
    if choice in ("auto", "required"):
        return choice, None
    if not isinstance(choice, dict):
        raise _bad("'tool_choice' must be 'none', 'auto', 'required' or a named function: "
                   + _NAMED_USAGE, "tool_choice")  # fmt: skip
    if choice.get("type") not in (None, "function"):
        raise _bad(f"'tool_choice.type' must be 'function'; {_NAMED_USAGE}", "tool_choice.type")
    function = choice.get("function")
    if not isinstance(function, dict):
        raise _bad(f"'tool_choice.function' must be an object; {_NAMED_USAGE}",
                   "tool_choice.function")  # fmt: skip
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"'tool_choice.function.name' must be a non-empty string; {_NAMED_USAGE}",
                   "tool_choice.function.name")  # fmt: skip
    if all(tool["function"]["name"] != name for tool in tools):
        raise _bad(f"'tool_choice' names function '{name}', which is not in 'tools'",
                   "tool_choice")  # fmt: skip
    return "named", name


def check_parser(request: ToolRequest | None, parser: ToolParser | None) -> None:
    """Refuse tool_choice "auto" (the default with tools) when the model has no parser."""
    if request is not None and request.choice == "auto" and parser is None:
        raise _bad("tool_choice 'auto' needs a tool-call parser, and this model has none; "
                   "start the server with --tool-call-parser", "tool_choice")  # fmt: skip


# --- messages -------------------------------------------------------------------


def template_message(msg: dict, where: str) -> dict:
    """A chat message's role, content and tool keys as the chat template takes them.

    Assistant ``tool_calls`` get their ``arguments`` JSON text parsed into an
    object, as vLLM does for templates; ``tool_call_id`` (tool messages) and
    ``name`` pass through. A null assistant content becomes "" (vLLM renders it
    so); any other content is returned untouched for the caller to normalise.
    """
    role = msg.get("role")
    if msg.get("function_call") is not None:
        raise _bad(f"'{where}.function_call' is deprecated and not supported; use "
                   "'tool_calls' instead", f"{where}.function_call")  # fmt: skip
    content = msg.get("content")
    out = {"role": role, "content": "" if content is None and role == "assistant" else content}
    name = msg.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise _bad(f"'{where}.name' must be a string", f"{where}.name")
        out["name"] = name
    if role == "assistant" and (calls := _template_calls(msg.get("tool_calls"), where)):
        out["tool_calls"] = calls
    call_id = msg.get("tool_call_id")
    if role == "tool" and call_id is not None:
        if not isinstance(call_id, str):
            raise _bad(f"'{where}.tool_call_id' must be a string", f"{where}.tool_call_id")
        out["tool_call_id"] = call_id
    return out


def _template_calls(calls: Any, where: str) -> list[dict]:
    where = f"{where}.tool_calls"
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise _bad(f"'{where}' must be an array", where)
    return [_template_call(call, f"{where}[{j}]") for j, call in enumerate(calls)]


def _template_call(call: Any, where: str) -> dict:
    function = _function_of(call, where)
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise _bad(f"'{where}.id' must be a string", f"{where}.id")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"'{where}.function.name' must be a non-empty string", f"{where}.function.name")
    arguments = _template_arguments(function.get("arguments"), f"{where}.function.arguments")
    out = {"id": call_id} if call_id is not None else {}
    return out | {"type": "function", "function": {"name": name, "arguments": arguments}}


def _template_arguments(arguments: Any, param: str) -> dict:
    if isinstance(arguments, dict):
        return arguments
    if arguments is not None and not isinstance(arguments, str):
        raise _bad(f"'{param}' must be a string of JSON", param)
    # vLLM turns bad or non-object JSON into {}: the turn stays in the history,
    # and refusing it would fail every later request of the conversation too.
    try:
        parsed = json.loads(arguments) if arguments else {}
    except (ValueError, RecursionError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


# --- output ---------------------------------------------------------------------


def output_stream(request: ToolRequest | None, parser: ToolParser | None) -> ToolStream | None:
    """The stream that shapes a streamed answer, or None when its text is all content
    (no tools, tool_choice "none", or "auto" without a parser: check_parser refuses that)."""
    if request is None or request.choice == "none":
        return None
    if request.choice != "auto":
        stream: ToolStream | None = _forced_stream(request)
    else:
        stream = parser.stream() if parser is not None else None
    if stream is None or request.parallel:
        return stream
    return _FirstCallOnly(stream)


def _forced_stream(request: ToolRequest) -> ToolStream:
    if request.choice == "named":
        return NamedCallStream(request.named or "")
    if request.choice == "required":
        return RequiredCallsStream()
    raise ValueError(f"tool_choice '{request.choice}' forces no call")


def forced_calls(request: ToolRequest, text: str) -> list[ToolCall]:
    """The calls in a whole forced answer (tool_choice "required" or named)."""
    stream = _forced_stream(request)
    calls = collect(stream.feed(text) + stream.finish())[1]
    return calls if request.parallel else calls[:1]


def split_output(
    request: ToolRequest | None, parser: ToolParser | None, text: str
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer, as a non-streamed response carries them."""
    if request is None or request.choice == "none":
        return text, []
    if request.choice != "auto":
        return "", forced_calls(request, text)  # vLLM sends "" beside forced calls
    if parser is None:
        return text, []
    content, calls = parser.extract(text)
    return content, calls if request.parallel else calls[:1]


def finish_reason(request: ToolRequest | None, calls: list, engine_finish: str) -> str:
    """The choice's finish_reason: "tool_calls" when the model stopped after making
    calls, except for a named tool_choice, where OpenAI and vLLM say "stop"."""
    if request is None or request.choice == "named" or not calls or engine_finish != "stop":
        return engine_finish
    return "tool_calls"


class _FirstCallOnly(ToolStream):
    """parallel_tool_calls false: only the first call reaches the client, as in vLLM."""

    def __init__(self, inner: ToolStream) -> None:
        self._inner = inner

    def feed(self, text: str) -> list[dict]:
        return _first_call_only(self._inner.feed(text))

    def finish(self) -> list[dict]:
        return _first_call_only(self._inner.finish())


def _first_call_only(deltas: list[dict]) -> list[dict]:
    out = []
    for delta in deltas:
        if "tool_calls" in delta:
            kept = [call for call in delta["tool_calls"] if call["index"] == 0]
            if not kept:
                continue
            delta = {**delta, "tool_calls": kept}
        out.append(delta)
    return out
