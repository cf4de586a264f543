"""A response's output as the Responses API's typed stream events, and its Response
object.

The generation is a chat choice underneath (choices.py shapes its deltas: text,
and tool calls when the request has tools); this turns those deltas into output
items, as OpenAI streams them: `response.created`, `response.in_progress`, per
item `response.output_item.added`, for a message `response.content_part.added`,
`response.output_text.delta`... `.done`, for a function call
`response.function_call_arguments.delta`... `.done`, then `output_item.done`, and
last `response.completed` (or `response.incomplete` at max_output_tokens,
`response.failed`, `response.cancelled`). Every event carries its
`sequence_number`, counted from 0 here: this renderer is the only writer of the
response's stream log, so event n of the log (from 1) is sequence_number n - 1,
and a resume after `starting_after=N` reads the log after event N + 1.
"""
from __future__ import annotations

import contextlib
import time
import uuid
from typing import AsyncIterator, Callable

from . import openai_protocol as oai
from .admitted import AdmittedGeneration
from .choices import Choice
from .events import payload
from .responses_request import ResponseRequest


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(response_id: str, model: str, req: ResponseRequest) -> dict:
    """A Response as it starts: in progress, no output yet."""
    return {"id": response_id, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "background": req.background, "error": None,
            "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": model, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": req.text_format, "tool_choice": req.tool_choice, "tools": list(req.tools),
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": None, "metadata": req.metadata}


class ResponseRenderer:
    """One response's events (`payloads()`, for its stream log) and its Response
    object (`response`, whole once the events end). `on_end(response)` runs once,
    when its status is final."""

    def __init__(self, run: AdmittedGeneration, response: dict, choice: Choice,
                 on_end: Callable[[dict], None] = lambda response: None):
        self.run, self.response, self.choice, self.on_end = run, response, choice, on_end
        self.output: list[dict] = response["output"]
        self.seq = 0                            # the next event's sequence_number
        self.error: oai.APIError | None = None  # why it failed, if it did
        self._pieces: list[str] = []            # the open item's text or arguments

    def _event(self, kind: str, **fields) -> str:
        text = payload({"type": kind, **fields, "sequence_number": self.seq})
        self.seq += 1
        return text

    async def payloads(self, append=None) -> AsyncIterator[list[str]]:
        """Event batches as the decode worker's chunks arrive (APIError propagates)."""
        yield [self._event("response.created", response=self.response),
               self._event("response.in_progress", response=self.response)]
        async with contextlib.aclosing(self.run.chunks()) as chunks:
            async for chunk in chunks:
                if out := self._deltas(self.choice.deltas(chunk)):
                    yield out
        yield self._finish(self.run.stream.finish_reason or "stop")

    # --- items --------------------------------------------------------------------

    @property
    def _open(self) -> dict | None:
        item = self.output[-1] if self.output else None
        return item if item is not None and item["status"] == "in_progress" else None

    def _deltas(self, choices: list[dict]) -> list[str]:
        out: list[str] = []
        for choice in choices:
            delta = choice["delta"]
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls", ()):
                if "id" in call:
                    out += self._open_call(call)
                if arguments := call["function"].get("arguments"):
                    out += self._arguments(arguments)
        return out

    def _where(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _text(self, text: str) -> list[str]:
        out = []
        if self._open is None or self._open["type"] != "message":
            out = self._close() + self._open_message()
        self._pieces.append(text)
        out.append(self._event("response.output_text.delta", **self._where(), content_index=0,
                               delta=text, logprobs=[]))
        return out

    def _open_message(self) -> list[str]:
        item = {"id": _item_id("msg"), "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}
        self.output.append(item)
        self._pieces = []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=len(self.output) - 1,
                            item=item),
                self._event("response.content_part.added", **self._where(), content_index=0,
                            part=part)]

    def _open_call(self, call: dict) -> list[str]:
        out = self._close()
        item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": call["id"], "name": call["function"]["name"], "arguments": ""}
        self.output.append(item)
        self._pieces = []
        return out + [self._event("response.output_item.added",
                                  output_index=len(self.output) - 1, item=item)]

    def _arguments(self, arguments: str) -> list[str]:
        if self._open is None or self._open["type"] != "function_call":
            return []                           # a parser's stray piece: no call is open
        self._pieces.append(arguments)
        return [self._event("response.function_call_arguments.delta", **self._where(),
                            delta=arguments)]

    def _close(self, status: str = "completed") -> list[str]:
        """End the open item (if any) with its whole text or arguments."""
        item = self._open
        if item is None:
            return []
        whole, where = "".join(self._pieces), self._where()
        item["status"] = status
        if item["type"] == "function_call":
            item["arguments"] = whole
            out = [self._event("response.function_call_arguments.done", **where,
                               name=item["name"], arguments=whole)]
        else:
            part = {"type": "output_text", "text": whole, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out = [self._event("response.output_text.done", **where, content_index=0,
                               text=whole, logprobs=[]),
                   self._event("response.content_part.done", **where, content_index=0,
                               part=part)]
        return out + [self._event("response.output_item.done",
                                  output_index=where["output_index"], item=item)]

    # --- the end ----------------------------------------------------------------

    def usage(self) -> dict:
        stream = self.run.stream
        prompt, completion = len(stream.gen.prompt_token_ids), stream.completion_tokens
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": stream.cached_tokens},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion}

    def _finish(self, finish: str) -> list[str]:
        out = self._deltas(self.choice.closing(finish))      # what a tool parser held back
        if not self.output:
            out += self._open_message()         # an empty answer is still a message
        incomplete = finish == "length"
        out += self._close("incomplete" if incomplete else "completed")
        self.response["status"] = "incomplete" if incomplete else "completed"
        if incomplete:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        return out + self._final("response.incomplete" if incomplete else "response.completed")

    def _final(self, kind: str) -> list[str]:
        self.response["usage"] = self.usage()
        event = self._event(kind, response=self.response)
        self.on_end(self.response)
        return [event]

    def ending(self, e: oai.APIError) -> list[str]:
        """The last events of a response that failed or was cancelled (streams.py calls
        it in place of its own error event)."""
        if self.response["status"] != "in_progress":
            return []                           # it ended already: nothing to add
        cancelled = e.type == "cancelled"
        out = self._close("incomplete")
        self.response["status"] = "cancelled" if cancelled else "failed"
        if not cancelled:
            self.error = e
            self.response["error"] = {"code": e.code or e.type, "message": e.message}
        return out + self._final("response.cancelled" if cancelled else "response.failed")

    def conversation(self) -> list[dict]:
        """The answer as the assistant's chat turn, for the next response of the chain."""
        text = "".join(part["text"] for item in self.output if item["type"] == "message"
                       for part in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.output if item["type"] == "function_call"]
        if calls:
            return [{"role": "assistant", "content": text or None, "tool_calls": calls}]
        return [{"role": "assistant", "content": text}]
