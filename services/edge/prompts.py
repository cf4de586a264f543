"""Requests to token ids, the way vLLM's own OpenAI server does it.

The edge tokenizes (routing needs real token counts, not chars/4), so it must
produce exactly the ids a single vLLM engine would: chat = template rendered
to text, then encoded without extra special tokens; completion = text encoded
with the tokenizer's special tokens.
"""
from __future__ import annotations

from .openai_protocol import APIError, CompletionRequest


class PromptEncoder:
    """Wraps the model's tokenizer and chat template."""

    def __init__(self, model: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.vocab_size = len(self.tokenizer)

    def encode(self, req: CompletionRequest) -> list[int]:
        """Token ids of the request's prompt; raises APIError for unusable input."""
        if req.kind == "chat":
            try:
                text = self.tokenizer.apply_chat_template(
                    list(req.messages), add_generation_prompt=True, tokenize=False)
            except Exception as e:  # jinja raises its own types for bad turn orders etc.
                raise APIError(400, f"messages cannot be rendered by the chat template: {e}",
                               param="messages") from e
            return self.tokenizer.encode(text, add_special_tokens=False)
        if isinstance(req.prompt, tuple):
            return self.check_ids(list(req.prompt), param="prompt")
        return self.encode_text(req.prompt)

    def encode_text(self, text: str) -> list[int]:
        """A completion prompt's ids: the tokenizer's own special tokens included."""
        return self.tokenizer.encode(text)

    def check_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        """Token ids given by the caller, checked against the vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary "
                                f"(size {self.vocab_size})", param=param)
        return ids
