"""Requests to token ids, the way vLLM's own OpenAI server does it.

The edge tokenizes (routing needs real token counts, not chars/4), so it must
produce exactly the ids a single vLLM engine would: chat = template rendered
to text, then encoded without extra special tokens; completion = text encoded
with the tokenizer's special tokens.
"""
from __future__ import annotations

import json
from pathlib import Path

from .openai_protocol import APIError, CompletionRequest

# Tokenizer classes that are just a `tokenizer.json` (a Rust `tokenizers` model) and
# a chat template: what AutoTokenizer would build for them needs no model code.
GENERIC_TOKENIZERS = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def load_tokenizer(model: str):
    """The model's tokenizer. A generic fast tokenizer (named so in a local model's
    tokenizer_config.json) is loaded as such: AutoTokenizer in transformers 5 imports
    torch on the way (209 MiB of the edge's memory, for a process that runs no model).
    Any other class, or a model not on disk, goes through AutoTokenizer."""
    try:
        cls = json.loads((Path(model) / "tokenizer_config.json").read_text()).get(
            "tokenizer_class")
    except (OSError, ValueError):
        cls = None
    if cls in GENERIC_TOKENIZERS and (Path(model) / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(model)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model)


class PromptEncoder:
    """Wraps the model's tokenizer and chat template."""

    def __init__(self, model: str):
        self.tokenizer = load_tokenizer(model)
        self.vocab_size = len(self.tokenizer)
        # A fast tokenizer's Rust model, called directly: the same ids as its
        # `encode` (no truncation or padding is asked for), without the wrapper's
        # batch encoding around them (a quarter of the encode's CPU at 1,024 tokens).
        # `encode_batch_fast` (tokenizers >= 0.21) skips the character offsets, which
        # nothing here reads: 0.67 against 1.0 ms for a 1,100-token prompt.
        self._rust = getattr(self.tokenizer, "_tokenizer", None)
        self._fast = getattr(self._rust, "encode_batch_fast", None)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._fast is not None:
            return self._fast([text], add_special_tokens=add_special_tokens)[0].ids
        if self._rust is not None:
            return self._rust.encode(text, add_special_tokens=add_special_tokens).ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode(self, req: CompletionRequest) -> list[int]:
        """Token ids of the request's prompt; raises APIError for unusable input."""
        if req.kind == "chat":
            try:
                text = self.tokenizer.apply_chat_template(
                    list(req.messages), add_generation_prompt=True, tokenize=False)
            except Exception as e:  # jinja raises its own types for bad turn orders etc.
                raise APIError(400, f"messages cannot be rendered by the chat template: {e}",
                               param="messages") from e
            return self._encode(text, add_special_tokens=False)
        if isinstance(req.prompt, tuple):
            return self.check_ids(list(req.prompt), param="prompt")
        return self.encode_text(req.prompt)

    def encode_text(self, text: str) -> list[int]:
        """A completion prompt's ids: the tokenizer's own special tokens included."""
        return self._encode(text, add_special_tokens=True)

    def check_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        """Token ids given by the caller, checked against the vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary "
                                f"(size {self.vocab_size})", param=param)
        return ids
