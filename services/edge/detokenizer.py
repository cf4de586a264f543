"""Token ids to streamed text at the edge, as a single vLLM engine would render them.

Workers speak vLLM's engine protocol, which streams token ids only (its
servicer runs the engine with `detokenize=False`), so the edge turns ids into
text: incrementally, with the tokenizer's own `DecodeStream` primed with the
prompt (what vLLM's fast detokenizer does), special tokens skipped, and stop
strings cut the way vLLM cuts them: the text ends where the stop string
begins, and up to `len(stop) - 1` characters are held back while a stop string
could still be forming. A token the engine stops on (EOS, `stop_token_ids`)
adds no text.

For byte-level BPE tokenizers (GPT-2's family: Llama 3, Qwen, this project's
tiny model) the stream runs in C (`_bytetext.ByteStream`) from a table of each
id's bytes, checked against the tokenizer's own decode when first built: the
same text, piece by piece, as `DecodeStream`, which decodes its window of ids
again at every token (~0.8 us per id here). Other tokenizers, and a process
that runs the Python (pdserve.native: not built, or PDSERVE_NATIVE=python), use
`DecodeStream`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from pdserve import native

_C = native.load("bytetext")
ByteStream = None if _C is None else _C.ByteStream

log = logging.getLogger("pdserve.edge")


@dataclass(slots=True)
class StopRule:
    """When generation ends besides `max_tokens`: what the engine is also told."""

    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop: bool = False                       # the text ends after the stop string


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte (index), as byte-level BPE
    vocabularies spell it."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)}
    chars = {b: chr(b) for b in keep}
    for n, b in enumerate(b for b in range(256) if b not in keep):
        chars[b] = chr(256 + n)
    return [chars[b] for b in range(256)]


_CHAR_BYTE = {c: b for b, c in enumerate(byte_level_alphabet())}
_TABLES: dict[int, tuple] = {}                       # id(Rust tokenizer) -> (it, table)


def byte_table(rust) -> tuple | None:
    """Per id, what `rust.decode` makes of it in a stream: the model token's bytes, an
    added token's text, or None (a special token, skipped); None for a tokenizer
    whose decoder is not byte-level, or whose decode of some id disagrees."""
    cached = _TABLES.get(id(rust))
    if cached is not None and cached[0] is rust:
        return cached[1]
    table = None
    if type(rust.decoder).__name__ == "ByteLevel":
        added = rust.get_added_tokens_decoder()
        entries = []
        for i in range(rust.get_vocab_size(with_added_tokens=True)):
            if i in added:
                entries.append(None if added[i].special else added[i].content)
                continue
            token = rust.id_to_token(i)
            if token is None:
                entries.append(None)
            elif all(c in _CHAR_BYTE for c in token):
                entries.append(bytes(_CHAR_BYTE[c] for c in token))
            else:                                    # byte-level decoders keep such a token whole
                entries.append(token.encode())
        table = tuple(entries)
        bad = next((i for i, e in enumerate(table) if rust.decode([i], skip_special_tokens=True)
                    != (e.decode(errors="replace") if isinstance(e, bytes) else e or "")), None)
        if bad is not None:
            log.warning("byte-level table disagrees with the tokenizer at id %d: "
                        "detokenizing with DecodeStream", bad)
            table = None
    _TABLES[id(rust)] = (rust, table)
    return table


class TextStream:
    """One request's output text, fed token ids as they arrive."""

    def __init__(self, tokenizer, prompt_ids: list[int], rule: StopRule):
        rust = tokenizer._tokenizer                  # the Rust `tokenizers.Tokenizer`
        # Primed with the prompt, as vLLM primes it: the first output token then
        # gets the leading space or bytes it has in context.
        table = byte_table(rust) if ByteStream is not None else None
        if table is not None:
            self._decode = ByteStream(table, prompt_ids).add
        else:
            stream = DecodeStream(ids=prompt_ids, skip_special_tokens=True)
            self._decode = lambda ids: "".join([stream.step(rust, i) or "" for i in ids])
        self._rule = rule
        self._holdback = max((len(s) for s in rule.stop), default=1) - 1
        # Only the text not sent yet is kept: appending to the whole text copied it
        # once per token (a 400-token answer, ~2 kB a token).
        self._unsent = ""
        self.stop_string: str | None = None          # set once a stop string ended the text

    def stops_at(self, token_id: int) -> bool:
        """Whether the engine ends generation at this token (a stop id, or EOS)."""
        return token_id in self._rule.stop_token_ids

    def add(self, token_ids) -> str:
        """Text newly safe to send after these tokens ("" when none)."""
        if self.stop_string is not None:
            return ""
        stop_ids = self._rule.stop_token_ids
        if not stop_ids.isdisjoint(token_ids):      # the engine stops there: no text from it on
            token_ids = token_ids[:next(i for i, t in enumerate(token_ids) if t in stop_ids)]
        text = self._unsent + self._decode(token_ids)
        if not self._rule.stop:                     # nothing held back
            self._unsent = ""
            return text
        if self._find_stop(text, len(self._unsent)):
            return self._take(len(self._unsent))
        return self._take(len(text) - self._holdback, text)

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._rule.stop)

    def finish(self) -> str:
        """The rest of the text once the engine has finished."""
        return self._take(len(self._unsent))

    def _find_stop(self, text: str, checked_from: int) -> bool:
        """Cut the text at the earliest-ending stop string in the new text. What was
        sent ends at least `holdback` characters before the new text, so a stop
        string ending in it starts within the unsent text."""
        best = None
        for s in self._rule.stop:
            at = text.find(s, max(0, checked_from - len(s) + 1))
            if at != -1 and (best is None or at + len(s) < best[0] + len(best[1])):
                best = (at, s)
        if best is None:
            return False
        end = best[0] + (len(best[1]) if self._rule.include_stop else 0)
        self._unsent, self.stop_string = text[:end], best[1]
        return True

    def _take(self, upto: int, text: str | None = None) -> str:
        """Send the first `upto` characters of the unsent text (`text`, when given,
        is the new unsent text)."""
        if text is None:
            text = self._unsent
        if upto <= 0:
            self._unsent = text
            return ""
        self._unsent = text[upto:]
        return text[:upto]
