"""Token ids to streamed text at the edge, as a single vLLM engine would render them.

Workers speak vLLM's engine protocol, which streams token ids only (its
servicer runs the engine with `detokenize=False`), so the edge turns ids into
text: incrementally, with the tokenizer's own `DecodeStream` primed with the
prompt (what vLLM's fast detokenizer does), special tokens skipped, and stop
strings cut the way vLLM cuts them: the text ends where the stop string
begins, and up to `len(stop) - 1` characters are held back while a stop string
could still be forming. A token the engine stops on (EOS, `stop_token_ids`)
adds no text.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenizers.decoders import DecodeStream


@dataclass(slots=True)
class StopRule:
    """When generation ends besides `max_tokens`: what the engine is also told."""

    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()


class TextStream:
    """One request's output text, fed token ids as they arrive."""

    def __init__(self, tokenizer, prompt_ids: list[int], rule: StopRule):
        self._tokenizer = tokenizer._tokenizer       # the Rust `tokenizers.Tokenizer`
        # Primed with the prompt, as vLLM primes it: the first output token then
        # gets the leading space or bytes it has in context.
        self._stream = DecodeStream(ids=prompt_ids, skip_special_tokens=True)
        self._rule = rule
        self._holdback = max((len(s) for s in rule.stop), default=1) - 1
        self._text = ""
        self._sent = 0
        self.stop_string: str | None = None          # set once a stop string ended the text

    def stops_at(self, token_id: int) -> bool:
        """Whether the engine ends generation at this token (a stop id, or EOS)."""
        return token_id in self._rule.stop_token_ids

    def add(self, token_ids) -> str:
        """Text newly safe to send after these tokens ("" when none)."""
        if self.stop_string is not None:
            return ""
        checked_from = len(self._text)
        for tid in token_ids:
            if tid in self._rule.stop_token_ids:
                break                                # the engine stops here; it adds no text
            self._text += self._stream.step(self._tokenizer, tid) or ""
        if self._rule.stop and self._find_stop(checked_from):
            return self._take(len(self._text))
        return self._take(len(self._text) - self._holdback)

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._rule.stop)

    def finish(self) -> str:
        """The rest of the text once the engine has finished."""
        return self._take(len(self._text))

    def _find_stop(self, checked_from: int) -> bool:
        """Cut the text at the earliest-ending stop string in the new text."""
        best = None
        for s in self._rule.stop:
            at = self._text.find(s, max(0, checked_from - len(s) + 1))
            if at != -1 and (best is None or at + len(s) < best[0] + len(best[1])):
                best = (at, s)
        if best is None:
            return False
        self._text, self.stop_string = self._text[:best[0]], best[1]
        return True

    def _take(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        out, self._sent = self._text[self._sent:upto], upto
        return out
