"""A generation's output as OpenAI stream events: the payloads SSE sends as
`data:` and WebSocket sends as `data` of a chunk frame.

Each payload is rendered once, as compact ASCII JSON text, and shared by every
reader of the stream (see stream_log.py).
"""
from __future__ import annotations

import contextlib
import json
import time
from typing import AsyncIterator

from . import openai_protocol as oai
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
    """One generation's chunks as payload batches: one per chunk with text, then
    the finish chunk (and usage when asked). `payload()` is the step for one chunk,
    which a caller may take synchronously (GenerationStream.on_chunk); `payloads()`
    iterates the stream's chunks through the same step."""

    def __init__(self, kind: oai.Kind, include_usage: bool, stream: GenerationStream,
                 model: str):
        self.kind, self.include_usage, self.stream, self.model = kind, include_usage, stream, model
        self.rid, self.created = stream.gen.request_id, int(time.time())
        rid, created = self.rid, self.created
        self._before, self._after = _text_template(
            oai.chat_chunk(rid, model, created, content=_HOLE) if kind == "chat"
            else oai.completion_chunk(rid, model, created, text=_HOLE))
        # Chat opens with the assistant's role. It goes out with the first text, as
        # vLLM's server sends it (with its first output), not before: an empty
        # event ahead of the first token would only make the stream look faster
        # to a client that times its first event.
        self._opening = ([payload(oai.chat_chunk(rid, model, created, role="assistant",
                                                 content=""))]
                         if kind == "chat" else [])

    def payload(self, chunk: Chunk) -> list[str]:
        """The payloads of one chunk (none for a chunk without text)."""
        if not chunk.text:
            return []
        out = self._opening + [self._before + _json_string(chunk.text) + self._after]
        self._opening = []
        return out

    async def payloads(self) -> AsyncIterator[list[str]]:
        """Payload batches as the decode worker's chunks arrive. APIError propagates."""
        stream, rid, created, model = self.stream, self.rid, self.created, self.model
        async with contextlib.aclosing(stream.chunks()) as chunks:
            async for chunk in chunks:
                if out := self.payload(chunk):
                    yield out
        finish = stream.finish_reason or "stop"
        last = self._opening + [
            payload(oai.chat_chunk(rid, model, created, content=None, finish_reason=finish))
            if self.kind == "chat" else
            payload(oai.completion_chunk(rid, model, created, text="", finish_reason=finish))]
        if self.include_usage:
            last.append(payload(oai.usage_chunk(self.kind, rid, model, created,
                                                len(stream.gen.prompt_token_ids),
                                                stream.completion_tokens)))
        yield last


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
