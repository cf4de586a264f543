"""A generation's output as OpenAI stream events: the payloads SSE sends as
`data:` and WebSocket sends as `data` of a chunk frame.

Each payload is rendered once, as compact ASCII JSON text, and shared by every
reader of the stream (see stream_log.py). A request with `n` choices has one
GenerationStream per choice; their chunks go out interleaved as they come,
each with its choice's index, as OpenAI streams them.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import AsyncIterator, Callable

from . import openai_protocol as oai
from .choices import Choice
from .generation import Chunk, GenerationStream


def payload(obj: dict) -> str:
    # ASCII: any text (even a lone surrogate of a broken detokenization) is a
    # valid escape, so the payload is safe on every transport.
    return json.dumps(obj, separators=(",", ":"))


def error_payload(e: oai.APIError) -> str:
    return payload(e.body())


_HOLE = "\x00"                                     # stands for the text in a template
# json.dumps(text) for a str, without its two Python calls on the way (once per token).
_json_string = json.encoder.encode_basestring_ascii


def _text_template(chunk: dict) -> tuple[str, str]:
    """A chunk rendered once around a placeholder text: (before, after) the text's
    JSON string, so each event costs one json.dumps of its text only."""
    before, after = payload(chunk).split(json.dumps(_HOLE), 1)
    return before, after


class Renderer:
    """A request's chunks as payload batches: per chunk with output, the choice's
    delta; then each choice's finish chunk (and usage when asked). `payload()` is the
    step for one chunk of a one-choice request, which a caller may take synchronously
    (GenerationStream.on_chunk); `payloads()` iterates the streams' chunks through
    the same steps. `choices[i]` renders stream i's output (choices.py)."""

    def __init__(self, kind: oai.Kind, include_usage: bool, streams: list[GenerationStream],
                 model: str, choices: list[Choice],
                 on_choice_end: Callable[[GenerationStream], None] = lambda s: None):
        self.kind, self.include_usage, self.model = kind, include_usage, model
        self.streams, self.choices, self.on_choice_end = streams, choices, on_choice_end
        self._ended = False
        self.stream = streams[0]
        self.rid, self.created = self.stream.gen.request_id, int(time.time())
        self.obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        # A choice's plain text is a template filled per chunk (the common case).
        self._templates = [_text_template(self._chunk([c.text_delta(_HOLE)]))
                           for c in choices]

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.rid, "object": self.obj, "created": self.created,
               "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def payload(self, chunk: Chunk) -> list[str]:
        """The payloads of one chunk of choice 0 (none for a chunk with no output)."""
        return self._payloads(0, chunk)

    def _payloads(self, index: int, chunk: Chunk) -> list[str]:
        choice = self.choices[index]
        if choice.plain:
            if not chunk.text:
                return []
            before, after = self._templates[index]
            text = before + _json_string(chunk.text) + after
            if choice.opened:
                return [text]
            return [payload(self._chunk([d])) for d in choice.opening()] + [text]
        return [payload(self._chunk([d]))
                for d in choice.deltas(chunk, self.streams[index].prompt_logprobs)]

    def _last(self, index: int) -> list[str]:
        stream, choice = self.streams[index], self.choices[index]
        out = [payload(self._chunk([d])) for d in choice.opening()]
        return out + [payload(self._chunk([d]))
                      for d in choice.closing(stream.finish_reason or "stop")]

    def usage(self) -> dict:
        """The request's token counts, as OpenAI reports them."""
        prompt = len(self.stream.gen.prompt_token_ids)
        completion = sum(s.completion_tokens for s in self.streams)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.stream.cached_tokens}}

    async def payloads(self) -> AsyncIterator[list[str]]:
        """Payload batches as the decode workers' chunks arrive. APIError propagates."""
        if len(self.streams) == 1:
            async with contextlib.aclosing(self.stream.chunks()) as chunks:
                async for chunk in chunks:
                    if out := self._payloads(0, chunk):
                        yield out
            last = self._last(0)
        else:
            last = []
            async with contextlib.aclosing(self._interleaved()) as outputs:
                async for index, chunk in outputs:
                    if chunk is None:
                        last += self._last(index)
                    elif out := self._payloads(index, chunk):
                        yield out
        if self.include_usage:
            last.append(payload(self._chunk([], self.usage())))
        yield last

    async def _interleaved(self) -> AsyncIterator[tuple[int, Chunk | None]]:
        """(choice index, chunk) as each stream yields them; (index, None) at its end."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: GenerationStream) -> None:
            try:
                async with contextlib.aclosing(stream.chunks()) as chunks:
                    async for chunk in chunks:
                        queue.put_nowait((index, chunk, None))
                queue.put_nowait((index, None, None))
            except Exception as e:  # noqa: BLE001 (handed to the reader, raised there)
                queue.put_nowait((index, None, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            for _ in range(len(tasks)):
                while True:
                    index, chunk, error = await queue.get()
                    if error is not None:
                        raise error
                    yield index, chunk
                    if chunk is None:
                        break
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.end_choices()

    def end_choices(self) -> None:
        """Count the choices after the first as ended, once (the first is its stream's:
        the caller ends it). Also called when the stream's task ends, in case it was
        cancelled before it ran."""
        if not self._ended:
            self._ended = True
            for stream in self.streams[1:]:
                self.on_choice_end(stream)

    async def response(self) -> dict:
        """The whole answer as one chat.completion / text_completion object."""
        async def run(index: int, stream: GenerationStream) -> None:
            async with contextlib.aclosing(stream.chunks()) as chunks:
                async for chunk in chunks:
                    self.choices[index].add(chunk, stream.prompt_logprobs)
        try:
            async with asyncio.TaskGroup() as group:
                for i, s in enumerate(self.streams):
                    group.create_task(run(i, s))
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        finally:
            self.end_choices()
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": [c.whole(s.finish_reason or "stop")
                            for c, s in zip(self.choices, self.streams)],
                "usage": self.usage()}


async def render_inference(stream: GenerationStream) -> AsyncIterator[list[str]]:
    """Payload batches for the internal Inference API: token ids, text, and the
    counts on the last one (under an "inference" key: not an OpenAI chunk)."""
    async with contextlib.aclosing(stream.chunks()) as chunks:
        async for chunk in chunks:
            out = {"token_ids": chunk.token_ids, "text": chunk.text, "path": stream.path}
            if chunk.finish_reason:
                out |= {"finish_reason": chunk.finish_reason,
                        "prompt_tokens": len(stream.gen.prompt_token_ids),
                        "completion_tokens": stream.completion_tokens}
            yield [payload({"inference": out})]
