"""A generation's output as OpenAI stream events: the payloads SSE sends as
`data:` and WebSocket sends as `data` of a chunk frame.

Each payload is rendered once, as compact ASCII JSON text, and shared by every
reader of the stream (see stream_log.py). A request with `n` choices has one
generation per choice (admitted.py); their chunks go out interleaved as they
come, each with its choice's index, as OpenAI streams them.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import AsyncIterator, Callable

from . import openai_protocol as oai
from .admitted import AdmittedGeneration
from .choices import Choice
from .output import Chunk


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
    delta; then each choice's finish chunk (and usage when asked). `payloads()`
    iterates the generations' chunks; `response()` gathers them into one answer.
    `choices[i]` renders generation i's output (choices.py)."""

    def __init__(self, kind: oai.Kind, include_usage: bool, runs: list[AdmittedGeneration],
                 model: str, choices: list[Choice],
                 on_choice_end: Callable[[AdmittedGeneration], None] = lambda run: None):
        self.kind, self.include_usage, self.model = kind, include_usage, model
        self.runs, self.choices, self.on_choice_end = runs, choices, on_choice_end
        self.streams = [run.stream for run in runs]
        self._ended = False
        self.stream = self.streams[0]
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
                for d in choice.deltas(chunk, self.streams[index].output.prompt_logprobs)]

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

    async def payloads(self, append: Callable[[list[str]], None] | None = None
                       ) -> AsyncIterator[list[str]]:
        """Payload batches as the decode workers' chunks arrive. APIError propagates.
        `append`: where a one-choice request's steady outputs may go, rendered, from
        the call that read them (the stream's log; LegCall.chunks)."""
        if len(self.streams) == 1:
            async with contextlib.aclosing(self.runs[0].chunks(self._steady(append))) as chunks:
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

    def _steady(self, append: Callable[[list[str]], None] | None
                ) -> Callable[[Chunk], None] | None:
        """The step for one chunk of choice 0 that a caller may take synchronously."""
        if append is None:
            return None

        def step(chunk: Chunk) -> None:
            if out := self._payloads(0, chunk):
                append(out)
        return step

    async def _interleaved(self) -> AsyncIterator[tuple[int, Chunk | None]]:
        """(choice index, chunk) as each stream yields them; (index, None) at its end."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, run: AdmittedGeneration) -> None:
            try:
                async with contextlib.aclosing(run.chunks()) as chunks:
                    async for chunk in chunks:
                        queue.put_nowait((index, chunk, None))
                queue.put_nowait((index, None, None))
            except Exception as e:  # noqa: BLE001 (handed to the reader, raised there)
                queue.put_nowait((index, None, e))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.runs)]
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
            for run in self.runs[1:]:
                self.on_choice_end(run)

    async def response(self) -> dict:
        """The whole answer as one chat.completion / text_completion object."""
        async def gather(index: int, run: AdmittedGeneration) -> None:
            async with contextlib.aclosing(run.chunks()) as chunks:
                async for chunk in chunks:
                    self.choices[index].add(chunk, run.stream.output.prompt_logprobs)
        try:
            async with asyncio.TaskGroup() as group:
                for i, r in enumerate(self.runs):
                    group.create_task(gather(i, r))
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        finally:
            self.end_choices()
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": [c.whole(s.finish_reason or "stop")
                            for c, s in zip(self.choices, self.streams)],
                "usage": self.usage()}


async def render_inference(run: AdmittedGeneration) -> AsyncIterator[list[str]]:
    """Payload batches for the internal Inference API: token ids, text, and the
    counts on the last one (under an "inference" key: not an OpenAI chunk)."""
    stream = run.stream
    async with contextlib.aclosing(run.chunks()) as chunks:
        async for chunk in chunks:
            out = {"token_ids": chunk.token_ids, "text": chunk.text, "path": stream.path}
            if chunk.finish_reason:
                out |= {"finish_reason": chunk.finish_reason,
                        "prompt_tokens": len(stream.gen.prompt_token_ids),
                        "completion_tokens": stream.completion_tokens}
            yield [payload({"inference": out})]
