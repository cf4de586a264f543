"""Model output text -> OpenAI tool calls, whole or as a stream of chat deltas.

A model asked to call tools answers in its family's syntax: Hermes and Qwen wrap
each call in ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; Llama
3.x writes bare ``{"name": ..., "parameters": {...}}`` objects, joined by ``;``,
maybe after ``<|python_tag|>``. A ``ToolParser`` reads one syntax; its
``ToolStream`` reads it a delta at a time and returns OpenAI ``delta`` dicts.

NOTE: one path for both. ``extract()`` is the stream fed the whole text, so a
streamed answer and a non-streamed one always agree (content, names, arguments).
The rules every stream follows:
- text that may still become call syntax is held back until it cannot;
- a call goes out once its JSON is complete: a header (index, id, name,
  arguments "") then the whole arguments in one fragment;
- the first malformed call and all text after it are content, and when no call
  came before, the whole answer is content (vLLM's answer to a bad call);
- once a call is made, other text outside the call syntax is dropped, as vLLM does.

Pure: no I/O and no vLLM, so the edge can run it per token.
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Literal

_ID_CHARS = string.ascii_letters + string.digits
_WS = " \t\r\n"
_TOOL_CALL, _TOOL_CALL_END = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    """A fresh tool-call id shaped like OpenAI's: "call_" and 24 alphanumerics."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the model made; ``arguments`` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def as_dict(self) -> dict:
        """The call as an entry of a chat message's ``tool_calls``."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


def collect(deltas: Iterable[dict]) -> tuple[str, list[ToolCall]]:
    """Fold a stream's deltas into (content, calls): what a client rebuilds from them."""
    content: list[str] = []
    heads: dict[int, tuple[str, str]] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        content.append(delta.get("content", ""))
        for call in delta.get("tool_calls", ()):
            index = call["index"]
            if "id" in call:
                heads[index] = (call["id"], call["function"]["name"])
            arguments.setdefault(index, []).append(call["function"].get("arguments", ""))
    calls = [ToolCall(id, name, "".join(arguments[i])) for i, (id, name) in sorted(heads.items())]
    return "".join(content), calls


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")  # NaN would reach the client as invalid JSON


def _call_of(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one call object, or None when it is not one."""
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    # Hermes writes "arguments", Llama and the required-choice schema "parameters".
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if not isinstance(args, dict):  # OpenAI arguments always encode an object
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _overlap(text: str, marker: str) -> int:
    """Length of the longest proper prefix of marker that text ends with."""
    # NOTE: the markers hold their first character ("<") once, so an overlap can
    # only start at the last one in reach: one rfind instead of a loop per token.
    i = text.rfind(marker[0], max(len(text) - len(marker) + 1, 0))
    return len(text) - i if i >= 0 and marker.startswith(text[i:]) else 0


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


class ToolStream(ABC):
    """One answer's output text in, OpenAI chat-chunk ``delta`` dicts out.

    A delta is ``{"content": str}``, a call's header ``{"tool_calls": [{"index",
    "id", "type", "function": {"name", "arguments": ""}}]}`` or an arguments
    fragment ``{"tool_calls": [{"index", "function": {"arguments"}}]}``.
    """

    @abstractmethod
    def feed(self, text: str) -> list[dict]:
        """Called by the edge with each new piece of decoded text; the list may be empty."""

    @abstractmethod
    def finish(self) -> list[dict]:
        """Called by the edge once, after the last feed, whatever ended the generation."""


class _TextStream(ToolStream):
    """Keeps the undecided text and emits what it decides; subclasses say how to decide."""

    def __init__(self) -> None:
        # NOTE: _text holds only what may still be needed (see _trim), so a long
        # answer costs no more per token than a short one.
        self._text = ""
        self._sent = 0  # _text before this offset has gone out (content or arguments)
        self._pos = -1  # where call parsing resumes; -1 before it starts
        self._calls = 0
        self._spoke = False  # some content has gone out
        self._mode: Literal["parse", "content", "done"] = "parse"
        self._out: list[dict] = []

    def feed(self, text: str) -> list[dict]:
        self._text += text
        return self._step(final=False)

    def finish(self) -> list[dict]:
        return self._step(final=True)

    def _step(self, final: bool) -> list[dict]:
        if self._mode == "content":
            self._content(len(self._text))
        elif self._mode == "parse":
            self._advance(final)
        self._trim()
        out, self._out = self._out, []
        return out

    def _trim(self) -> None:
        # Once a call is out, a failure can only reach back to _pos; before
        # that, to the first unsent character (the whole answer may yet be content).
        if self._mode != "parse":
            cut = len(self._text)
        else:
            cut = self._pos if self._calls and self._pos >= 0 else self._sent
        if cut > 0:
            self._text = self._text[cut:]
            self._sent = max(self._sent - cut, 0)
            self._shift(cut)

    def _shift(self, cut: int) -> None:
        """The first ``cut`` characters of _text are gone: move offsets that point past them."""
        if self._pos >= 0:
            self._pos -= cut

    @abstractmethod
    def _advance(self, final: bool) -> None:
        """Emit what the text so far decides; ``final``: no more text will come."""

    def _content(self, end: int) -> None:
        if end > self._sent:
            self._out.append({"content": self._text[self._sent : end]})
            self._sent = end
            self._spoke = True

    def _call(self, name: str, arguments: str) -> None:
        head = {"name": name, "arguments": ""}
        call = {"index": self._calls, "id": new_call_id(), "type": "function", "function": head}
        self._out.append({"tool_calls": [call]})
        self._calls += 1
        self._arguments(arguments)

    def _arguments(self, text: str) -> None:
        if text:
            fragment = {"index": self._calls - 1, "function": {"arguments": text}}
            self._out.append({"tool_calls": [fragment]})

    def _fail(self, start: int) -> None:
        """The call syntax at ``start`` is malformed: it and the rest are content."""
        if self._calls:  # calls already sent cannot be taken back
            self._sent = start
        self._mode = "content"
        self._content(len(self._text))


class _HermesStream(_TextStream):
    def _advance(self, final: bool) -> None:
        text = self._text
        if self._pos < 0:
            start = text.find(_TOOL_CALL, self._sent)
            if start < 0:
                self._lead(len(text) if final else len(text) - _overlap(text, _TOOL_CALL), final)
                return
            self._lead(start, final=False)
            self._pos = start
        while (start := text.find(_TOOL_CALL, self._pos)) >= 0:
            body = start + len(_TOOL_CALL)
            end = text.find(_TOOL_CALL_END, body)
            if end < 0 and not final:
                return
            # An unclosed block at the end still counts when its JSON is whole, as in vLLM.
            call = _call_of(text[body : len(text) if end < 0 else end])
            if call is None:
                self._fail(start)
                return
            self._call(*call)
            self._pos = len(text) if end < 0 else end + len(_TOOL_CALL_END)

    def _lead(self, end: int, final: bool) -> None:
        # Whitespace alone before a call is no content (vLLM answers null), so
        # it waits until real text or the end shows what it is.
        if self._spoke or final or self._text[:end].strip():
            self._content(end)


class _ObjectEnd:
    """Where a JSON object that starts at ``start`` closes, read as the text grows."""

    __slots__ = ("start", "_i", "_depth", "_in_string", "_escaped")

    def __init__(self, start: int) -> None:
        self.start, self._i, self._depth = start, start, 0
        self._in_string = self._escaped = False

    def shift(self, cut: int) -> None:
        """The text lost its first ``cut`` characters (all before ``start``)."""
        self.start -= cut
        self._i -= cut

    def advance(self, text: str) -> int | None:
        """The offset just past the closing brace, or None while the object is open."""
        i, depth, in_string, escaped = self._i, self._depth, self._in_string, self._escaped
        while i < len(text):
            ch = text[i]
            i += 1
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i
        self._i, self._depth, self._in_string, self._escaped = i, depth, in_string, escaped
        return None


class _ObjectRun(_TextStream):
    """Calls written as JSON objects one after another, between separator chars."""

    _separators = _WS

    def __init__(self) -> None:
        super().__init__()
        self._scan: _ObjectEnd | None = None

    def _shift(self, cut: int) -> None:
        super()._shift(cut)
        if self._scan is not None:
            self._scan.shift(cut)

    def _run(self, final: bool) -> None:
        text = self._text
        while True:
            at = _skip(text, self._pos, self._separators)
            if at == len(text):
                if final and not self._calls:
                    self._fail(at)
                return
            if text[at] != "{":
                self._stray(at)
                return
            if self._scan is None or self._scan.start != at:
                self._scan = _ObjectEnd(at)
            end = self._scan.advance(text)
            if end is None:
                if final:
                    self._fail(at)
                return
            call = _call_of(text[at:end])
            if call is None:
                self._fail(at)
                return
            self._call(*call)
            self._pos = end

    def _stray(self, at: int) -> None:
        """Text that is neither separator nor object: after calls, dropped (vLLM ignores it)."""
        if self._calls:
            self._mode = "done"
        else:
            self._fail(at)


class _Llama3Stream(_ObjectRun):
    _separators = _WS + ";"

    def _advance(self, final: bool) -> None:
        if self._pos < 0 and not self._begin(final):
            return
        self._run(final)

    def _begin(self, final: bool) -> bool:
        text = self._text
        lead = len(text) - len(text.lstrip())
        head = text[lead:]
        if head.startswith(_PYTHON_TAG):
            self._pos = lead + len(_PYTHON_TAG)
        elif head.startswith("{"):
            self._pos = lead
        elif not final and _PYTHON_TAG.startswith(head):
            return False  # blank so far, or a tag still arriving
        else:
            self._mode = "content"
            self._content(len(text))
            return False
        return True


class RequiredCallsStream(_ObjectRun):
    """tool_choice "required": the constrained output is a JSON array of
    ``{"name", "parameters"}`` objects; each becomes a call once it is complete."""

    _separators = _WS + ","

    def _advance(self, final: bool) -> None:
        if self._pos < 0:
            at = _skip(self._text, 0, _WS)
            if at == len(self._text):
                return
            if self._text[at] != "[":
                self._mode = "done"
                return
            self._pos = at + 1
        self._run(final)

    def _fail(self, start: int) -> None:
        self._mode = "done"  # a forced answer has no content to fall back to

    def _stray(self, at: int) -> None:
        self._mode = "done"  # "]", or anything else, ends the array


class NamedCallStream(_TextStream):
    """A named tool_choice: the whole constrained output is that call's arguments,
    streamed as they arrive."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def _advance(self, final: bool) -> None:
        if not self._calls:
            if not self._text.strip():
                return  # a blank answer makes no call, as in vLLM
            self._call(self._name, "")
        self._arguments(self._text[self._sent :])
        self._sent = len(self._text)


class ToolParser(ABC):
    """One model family's tool-call syntax, read for tool_choice "auto".

    Stateless: the edge takes one ``stream()`` per streamed answer and calls
    ``extract()`` on a whole one.
    """

    name: str
    # The detokenizer must keep special tokens when the call markers are special
    # tokens in some of the family's tokenizers (vLLM sets skip_special_tokens=False).
    keeps_special_tokens = False

    @abstractmethod
    def stream(self) -> ToolStream:
        """A fresh stream; called by the edge when a streamed generation starts."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer; called by the edge for a non-streamed one.

        Without a call the content is the whole text; beside calls, blank content is None.
        """
        stream = self.stream()
        content, calls = collect(stream.feed(text) + stream.finish())
        if calls and not content.strip():
            return None, calls
        return content, calls


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks: Hermes,
    Qwen2.5/Qwen3 and other NousResearch-style templates. Content is the text
    before the first block."""

    name = "hermes"
    keeps_special_tokens = True

    def stream(self) -> ToolStream:
        return _HermesStream()


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON calls: optional ``<|python_tag|>``, then objects
    ``{"name": ..., "parameters": {...}}`` (or "arguments") joined by ``;``.
    An answer that starts otherwise is plain content."""

    name = "llama3_json"

    def stream(self) -> ToolStream:
        return _Llama3Stream()


PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser())}


def parser_for(model_type: str | None, chat_template: str | None) -> ToolParser | None:
    """The parser a model's chat template implies, or None when none fits."""
    template = chat_template or ""
    # Qwen3-Coder's template wraps XML, not JSON, in <tool_call>.
    if _TOOL_CALL in template and "<function=" not in template:
        return PARSERS["hermes"]
    if model_type == "llama" and (_PYTHON_TAG in template or "ipython" in template):
        return PARSERS["llama3_json"]
    return None
