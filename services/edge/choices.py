"""One choice of an answer, as OpenAI renders it: its text (after the echoed prompt),
its logprobs, and its tool calls.

The engine streams token ids and, when asked, each token's logprob and its top
alternatives (vLLM's engine protocol: `OutputLogProbs`, `InputLogProbs`); the
edge names the tokens and shapes them as vLLM's OpenAI server does: chat's
`logprobs.content` entries, and completions' `tokens`/`token_logprobs`/
`top_logprobs`/`text_offset` lists. Completions show up to `logprobs` + 1
alternatives (the sampled token and the top `logprobs`), so the edge asks the
engine for one more than the client did and drops the extra one when the sampled
token is among the top ones (`_completion_top`).
"""
from __future__ import annotations

from typing import Any

LOGPROB_FLOOR = -9999.0                 # OpenAI's stand-in for -inf, as vLLM clamps


class TokenText:
    """Each token id's own text, as a logprob entry names it (cached per id)."""

    def __init__(self, tokenizer):
        # A fast tokenizer's Rust model, called directly; any other through its wrapper.
        self._decode = getattr(tokenizer, "_tokenizer", tokenizer).decode
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode([token_id], skip_special_tokens=False)
        return text


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": max(logprob, LOGPROB_FLOOR),
            "bytes": list(token.encode("utf-8", errors="replace"))}


def _completion_top(top, k: int) -> list[tuple[int, float]]:
    """The alternatives vLLM's completions show for `logprobs: k`: the sampled token (the
    engine lists it first) and the top k, from an engine asked for k + 1."""
    pairs = list(zip(top.token_ids, top.values))
    if not pairs:
        return []
    sampled, rest = pairs[0], pairs[1:]
    if k and len(rest) >= k and sampled[1] > rest[k - 1][1]:
        rest = rest[:k - 1]             # the sampled token is itself among the top k
    return [sampled, *rest[:k]]


class Choice:
    """Choice `index` of a `kind` ("chat" | "completion") answer."""

    def __init__(self, index: int, kind: str, *, tokens: TokenText | None = None,
                 logprobs: int | None = None, echo: str | None = None, tool_stream=None,
                 tool_request=None):
        self.index, self.kind, self.tokens, self.k = index, kind, tokens, logprobs
        self.echo, self.tool_stream, self.tool_request = echo, tool_stream, tool_request
        self._calls: set[int] = set()       # tool calls streamed, by index
        self.plain = logprobs is None and echo is None and tool_stream is None
        self.opened = kind != "chat"
        self._sent_chars = 0                # completions' text_offset base
        self._prompt_logprobs = None        # echo: set once, from the first chunk
        self.text: list[str] = []           # whole-answer accumulators
        self.logprobs: list = []
        self.deltas_seen: list[dict] = []

    # --- streamed ---------------------------------------------------------------

    def text_delta(self, text: str) -> dict:
        """The choice object of one plain text piece."""
        if self.kind == "chat":
            return {"index": self.index, "delta": {"content": text}, "logprobs": None,
                    "finish_reason": None}
        return {"index": self.index, "text": text, "logprobs": None, "finish_reason": None}

    def opening(self) -> list[dict]:
        """Chat opens with the assistant's role, once, with its first output."""
        if self.opened:
            return []
        self.opened = True
        return [{"index": self.index, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None}]

    def deltas(self, chunk, prompt_logprobs=None) -> list[dict]:
        """The choice objects one chunk streams (none when it has no output)."""
        text, logprobs = self._piece(chunk, prompt_logprobs)
        if self.kind == "completion":
            if not text and logprobs is None:
                return []
            return [{"index": self.index, "text": text, "logprobs": logprobs,
                     "finish_reason": None}]
        deltas = self._tool_deltas(self.tool_stream.feed(text)) \
            if self.tool_stream is not None else ([{"content": text}] if text else [])
        if logprobs is not None and not deltas:
            deltas = [{"content": ""}]
        out = [{"index": self.index, "delta": d, "logprobs": None, "finish_reason": None}
               for d in deltas]
        if out and logprobs is not None:
            out[0]["logprobs"] = logprobs
        return self.opening() + out if out else []

    def closing(self, finish: str) -> list[dict]:
        """The choice's last objects: what its tool parser held back, then its finish."""
        finish = self._finish(finish)
        if self.kind == "completion":
            return [{"index": self.index, "text": "", "logprobs": None, "finish_reason": finish}]
        held = self._tool_deltas(self.tool_stream.finish()) if self.tool_stream is not None \
            else []
        out = [{"index": self.index, "delta": d, "logprobs": None, "finish_reason": None}
               for d in held]
        out = (self.opening() + out) if out else out
        return out + [{"index": self.index, "delta": {}, "logprobs": None,
                       "finish_reason": finish}]

    # --- whole ------------------------------------------------------------------

    def add(self, chunk, prompt_logprobs=None) -> None:
        """Take a chunk into the whole answer."""
        text, logprobs = self._piece(chunk, prompt_logprobs)
        self.text.append(text)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if self.tool_stream is not None and text:
            self.deltas_seen += self.tool_stream.feed(text)

    def whole(self, finish: str) -> dict:
        """The choice object of a non-streamed answer."""
        text = "".join(self.text)
        if self.kind == "completion":
            return {"index": self.index, "text": text, "finish_reason": finish,
                    "logprobs": self._joined_completion_logprobs()}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tool_stream is not None:
            from .tool_parsers import collect
            content, calls = collect(self.deltas_seen + self.tool_stream.finish())
            if calls:
                # Beside forced calls vLLM sends "", beside parsed ones no blank content.
                forced = self.tool_request.choice != "auto"
                content = "" if forced else (content if content.strip() else None)
                message = {"role": "assistant", "content": content,
                           "tool_calls": [c.as_dict() for c in calls]}
                self._calls = set(range(len(calls)))
            else:
                message["content"] = content
        logprobs = None
        if self.k is not None:
            logprobs = {"content": [e for piece in self.logprobs for e in piece["content"]]}
        return {"index": self.index, "message": message, "logprobs": logprobs,
                "finish_reason": self._finish(finish)}

    # --- shared -------------------------------------------------------------------

    def _tool_deltas(self, deltas: list[dict]) -> list[dict]:
        for delta in deltas:
            self._calls.update(call["index"] for call in delta.get("tool_calls", ()))
        return deltas

    def _finish(self, finish: str) -> str:
        if self.tool_stream is None:
            return finish
        from .tools import finish_reason
        return finish_reason(self.tool_request, sorted(self._calls), finish)

    def _piece(self, chunk, prompt_logprobs) -> tuple[str, Any]:
        """The chunk's text (after the echoed prompt, the first time) and logprobs."""
        text, lps = chunk.text, chunk.logprobs
        echo, self.echo = self.echo, None
        prompt = prompt_logprobs if echo is not None else None
        if echo is not None:
            text = echo + text
        if self.k is None:
            return text, None
        if self.kind == "chat":
            return text, {"content": self._chat_logprobs(lps)}
        logprobs = self._completion_logprobs(prompt, lps)
        self._sent_chars += len(text)
        return text, logprobs

    def _chat_logprobs(self, lps) -> list[dict]:
        if lps is None:
            return []
        out = []
        for j, (tid, lp) in enumerate(zip(lps.token_ids, lps.token_logprobs)):
            entry = _entry(self.tokens(tid), lp)
            top = lps.top_logprobs[j] if j < len(lps.top_logprobs) else None
            entry["top_logprobs"] = [] if top is None else [
                _entry(self.tokens(t), v) for t, v in zip(top.token_ids, top.values)]
            out.append(entry)
        return out

    def _completion_logprobs(self, prompt, lps) -> dict:
        tokens, values, tops = [], [], []
        if prompt is not None:
            for j, tid in enumerate(prompt.token_ids):
                value = prompt.token_logprobs[j]
                tokens.append(self.tokens(tid))
                if not value.HasField("value"):
                    values.append(None)
                    tops.append(None)
                    continue
                values.append(max(value.value, LOGPROB_FLOOR))
                tops.append(self._top(prompt.top_logprobs, j))
        if lps is not None:
            for j, (tid, lp) in enumerate(zip(lps.token_ids, lps.token_logprobs)):
                tokens.append(self.tokens(tid))
                values.append(max(lp, LOGPROB_FLOOR))
                tops.append(self._top(lps.top_logprobs, j))
        offsets, at = [], self._sent_chars
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
                "top_logprobs": tops}

    def _top(self, tops, j: int) -> dict:
        if j >= len(tops):
            return {}
        return {self.tokens(t): max(v, LOGPROB_FLOOR) for t, v in _completion_top(tops[j],
                                                                                  self.k)}

    def _joined_completion_logprobs(self) -> dict | None:
        if self.k is None:
            return None
        out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for piece in self.logprobs:
            for key in out:
                out[key] += piece[key]
        # Offsets count from the answer's start, as one call over every token would.
        at = 0
        for i, token in enumerate(out["tokens"]):
            out["text_offset"][i] = at
            at += len(token)
        return out
