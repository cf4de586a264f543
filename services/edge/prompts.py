"""Requests to token ids, the way vLLM's own OpenAI server does it.

The edge tokenizes (routing needs real token counts, not chars/4), so it must
produce exactly the ids a single vLLM engine would: chat = template rendered
to text, then encoded without extra special tokens; completion = text encoded
with the tokenizer's special tokens.
"""
from __future__ import annotations

import json
from pathlib import Path

from .choices import TokenText
from .openai_protocol import APIError, CompletionRequest
from .tool_parsers import PARSERS, ToolParser, ToolStream, parser_for
from .tools import ToolRequest, check_parser, output_stream

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


def _model_type(model: str) -> str | None:
    """The model's family as its config.json names it (None when not on disk)."""
    try:
        return json.loads((Path(model) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


class PromptEncoder:
    """Wraps the model's tokenizer and chat template."""

    def __init__(self, model: str, tool_call_parser: str = "auto"):
        self.tokenizer = load_tokenizer(model)
        self.vocab_size = len(self.tokenizer)
        # A fast tokenizer's Rust model, called directly: the same ids as its
        # `encode` (no truncation or padding is asked for), without the wrapper's
        # batch encoding around them (a quarter of the encode's CPU at 1,024 tokens).
        # `encode_batch_fast` (tokenizers >= 0.21) skips the character offsets, which
        # nothing here reads: 0.67 against 1.0 ms for a 1,100-token prompt.
        self._rust = getattr(self.tokenizer, "_tokenizer", None)
        self._fast = getattr(self._rust, "encode_batch_fast", None)
        self._special_head = self._encode("", add_special_tokens=True)   # BOS, say
        self.token_text = TokenText(self.tokenizer)     # logprobs' token names, cached
        self.tool_parser: ToolParser | None = (
            parser_for(_model_type(model), getattr(self.tokenizer, "chat_template", None))
            if tool_call_parser == "auto" else PARSERS.get(tool_call_parser))

    def tool_stream(self, request: ToolRequest | None) -> ToolStream | None:
        """What shapes an answer's text into tool calls (None: it is all content)."""
        return output_stream(request, self.tool_parser)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._fast is not None:
            return self._fast([text], add_special_tokens=add_special_tokens)[0].ids
        if self._rust is not None:
            return self._rust.encode(text, add_special_tokens=add_special_tokens).ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode(self, req: CompletionRequest, keep: int | None = None) -> list[int]:
        """Token ids of the request's prompt, its last `keep` at most (after its special
        tokens); raises APIError for unusable input."""
        ids = self._ids(req)
        if keep is None:
            return ids
        specials = (req.kind == "completion" and isinstance(req.prompt, str)
                    and req.add_special_tokens is not False) or bool(req.add_special_tokens)
        return self.truncate(ids, keep, specials)

    def _ids(self, req: CompletionRequest) -> list[int]:
        if req.kind == "chat":
            check_parser(req.tools, self.tool_parser)
            options = dict(req.template_options)
            kwargs = json.loads(options.pop("chat_template_kwargs", "{}"))
            tools = req.tools.template_tools() if req.tools is not None else None
            try:
                text = self.tokenizer.apply_chat_template(
                    self._conversation(req.messages), tools=tools, tokenize=False,
                    add_generation_prompt=options.get("add_generation_prompt", True),
                    continue_final_message=options.get("continue_final_message", False),
                    **kwargs)
            except Exception as e:  # jinja raises its own types for bad turn orders etc.
                raise APIError(400, f"messages cannot be rendered by the chat template: {e}",
                               param="messages") from e
            return self._encode(text, add_special_tokens=bool(req.add_special_tokens))
        if isinstance(req.prompt, tuple):
            return self.check_ids(list(req.prompt), param="prompt")
        if req.add_special_tokens is False:
            return self._encode(req.prompt, add_special_tokens=False)
        return self.encode_text(req.prompt)

    def _conversation(self, messages) -> list[dict]:
        """The messages as the template gets them: `developer` turns become one leading
        system turn when the template knows no developer role (as vLLM renders them)."""
        template = getattr(self.tokenizer, "chat_template", None) or ""
        if not any(m["role"] == "developer" for m in messages) or (
                '"developer"' in template or "'developer'" in template):
            return list(messages)
        turns = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        systems = [i for i, m in enumerate(turns) if m["role"] == "system"]
        if systems == [0]:
            return turns
        merged = "\n\n".join(turns[i]["content"] for i in systems if turns[i]["content"])
        return [{"role": "system", "content": merged},
                *[m for m in turns if m["role"] != "system"]]

    def truncate(self, ids: list[int], keep: int, specials: bool) -> list[int]:
        """`truncate_prompt_tokens`: the prompt's last `keep` tokens, after the special
        tokens the tokenizer put in front (`specials`), as vLLM's tokenizer cuts them."""
        if keep >= len(ids):
            return ids
        head = self._special_head if specials else []
        return head[:keep] + (ids[len(head):][-(keep - len(head)):] if keep > len(head) else [])

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
