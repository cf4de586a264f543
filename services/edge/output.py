"""What a generation has sent so far, across its legs.

Its token ids, its text (one detokenizer for the whole generation: a moved leg
goes on where the last one stopped, with no gap and no duplicate), its finish
reason and the prompt's logprobs. Each leg's call (leg.py) hands it the tokens
it reads; it times them into the generation's stats (stats.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from .detokenizer import TextStream
from .stats import GenerationStats


@dataclass(slots=True)
class Chunk:
    """A piece of one request's output, as the edge relays it."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None            # "stop" | "length" | "abort" on the last
    logprobs: Any = None                        # the engine's OutputLogProbs, when asked for


class Output:
    """A generation's output so far; `take()` each piece of it as it comes."""

    __slots__ = ("ids", "text", "finish_reason", "prompt_logprobs", "stats", "_last_at")

    def __init__(self, text: TextStream, stats: GenerationStats):
        self.ids: list[int] = []
        self.text = text
        self.finish_reason: str | None = None   # "stop" | "length" | "abort", once known
        self.prompt_logprobs: Any = None        # the engine's InputLogProbs, when asked for
        self.stats = stats
        self._last_at = 0.0                     # perf_counter() of the last output with tokens

    def take(self, ids: list[int], logprobs=None) -> Chunk:
        """Output tokens taken into the stream: timings, ids, text (and their logprobs)."""
        now, stats = time.perf_counter(), self.stats
        if stats.first_token_at is None:
            stats.first_token_at = now
        else:
            stats.token_gaps.append(now - self._last_at)
        self._last_at = now
        self.ids += ids
        text = self.text.add(ids)
        if self.text.stop_string is not None:
            self.finish_reason = "stop"         # the edge saw the stop string: it ends here
            return Chunk(ids, text, "stop", logprobs)
        return Chunk(ids, text, logprobs=logprobs)

    def take_prefill_token(self, token: int, max_tokens: int) -> Chunk:
        """The token the prefill sampled, taken before the decode answers; it ends the
        generation when the engine would stop on it, or when it was the last owed."""
        chunk = self.take([token])
        if chunk.finish_reason is None:
            if self.text.stops_at(token):
                self.finish_reason = "stop"
            elif len(self.ids) >= max_tokens:
                self.finish_reason = "length"
        return chunk

    def end(self) -> Chunk:
        """The stream's last chunk, once `finish_reason` is known: the text held back."""
        return Chunk([], self.text.finish(), self.finish_reason)

    async def ended(self, early: Chunk | None = None) -> AsyncIterator[Chunk]:
        """A leg that ends the generation with no decode call: `early` (the prefill's
        token, if it came), then the last chunk unless `early` was it."""
        if early is not None:
            yield early
        if early is None or early.finish_reason is None:
            yield self.end()
