"""The greedy requests both the reference engine and pdserve must answer identically."""
from __future__ import annotations

from dataclasses import dataclass

MAX_TOKENS = 24


@dataclass(frozen=True)
class Case:
    """One greedy request whose output both servers must agree on."""

    name: str
    kind: str            # "chat" | "completion"
    payload: dict        # messages=... or prompt=...

    def body(self, model: str, stream: bool) -> dict:
        return {"model": model, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": stream,
                "ignore_eos": True, **self.payload}


def _text(seed: int, sentences: int) -> str:
    from pdserve.tiny_model import synthetic_corpus
    return " ".join(synthetic_corpus(seed, sentences))


# Lengths chosen to span 2-6 KV blocks of 128 tokens (CPU block size), plus
# one prompt that ends exactly on a block boundary's neighbourhood.
CASES = [
    Case("completion-300", "completion", {"prompt": _text(11, 27)}),
    Case("completion-700", "completion", {"prompt": _text(12, 62)}),
    Case("chat-400", "chat", {"messages": [
        {"role": "system", "content": _text(13, 10)},
        {"role": "user", "content": _text(14, 25)}]}),
    Case("chat-multiturn-600", "chat", {"messages": [
        {"role": "user", "content": _text(15, 20)},
        {"role": "assistant", "content": _text(16, 10)},
        {"role": "user", "content": _text(17, 22)}]}),
]


