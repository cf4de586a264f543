"""`POST /tokenize` and `POST /detokenize`, as vLLM's OpenAI server serves them.

Clients written against vLLM call them: `vllm bench serve` aligns its prompts
to the server's tokenizer through them, tools count a chat's tokens before
sending it. The request and response JSON are vLLM's
(`vllm/entrypoints/serve/tokenize/protocol.py`):

- tokenize, completion form: {model?, prompt, add_special_tokens=true, return_token_strs?}
- tokenize, chat form: {model?, messages, add_generation_prompt=true,
  continue_final_message=false, add_special_tokens=false, chat_template_kwargs?, tools?,
  return_token_strs?}
- both answer {count, max_model_len, tokens, token_strs} (token_strs null unless asked)
- detokenize: {model?, tokens} -> {prompt}

The ids are the ones the completion routes send to the engine: a chat is parsed
and rendered by the very code /v1/chat/completions uses, so `count` is that
request's `usage.prompt_tokens`. Where vLLM quietly ignores something, pdserve
refuses it: an unknown parameter, `prompt` and `messages` together, a token id
outside the vocabulary (vLLM's decode drops it).
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from aiohttp import web

from pdserve.config import EdgeConfig

from . import openai_protocol as oai
from .prompts import PromptEncoder

Handler = Callable[[web.Request], Awaitable[web.Response]]

COMPLETION_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
CHAT_FIELDS = frozenset({"model", "messages", "add_generation_prompt", "continue_final_message",
                         "add_special_tokens", "chat_template_kwargs", "tools",
                         "return_token_strs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
# vLLM's chat form has these too; none can be honoured here, so each is refused with why.
REFUSED = {
    "chat_template": "a request's own chat template is not accepted (vLLM refuses it too "
                     "unless started with --trust-request-chat-template)",
    "media_io_kwargs": "only text content is supported",
    "mm_processor_kwargs": "only text content is supported",
}
# chat_template_kwargs keys that would bypass a top-level parameter or the server's template.
RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize", "add_generation_prompt",
                                      "continue_final_message", "tools", "conversation"})


def _check_fields(body: dict, known: frozenset[str]) -> None:
    """Every parameter is honoured or refused: null counts as absent (SDKs send unset
    fields as null), anything else unknown is a 400 naming it."""
    for key, value in body.items():
        if value is None or key in known:
            continue
        reason = REFUSED.get(key, "it is not a parameter of this endpoint")
        raise oai.APIError(400, f"'{key}' is not supported: {reason}", param=key)


def _check_model(body: dict, model_name: str) -> None:
    """`model` may be left out (vLLM's rule); when given it must be the served one."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise oai.APIError(400, "'model' must be a string", param="model")
    if model != model_name:
        raise oai.APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise oai.APIError(400, f"'{key}' must be a boolean", param=key)
    return value


def _chat_ids(encoder: PromptEncoder, body: dict, model_name: str) -> list[int]:
    """The ids /v1/chat/completions would send for the same messages and template
    arguments: the request goes through that route's parser and encoder."""
    if _flag(body, "continue_final_message", False) and _flag(body, "add_generation_prompt",
                                                               True):
        raise oai.APIError(400, "Cannot set both `continue_final_message` and "
                                "`add_generation_prompt` to True.",
                           param="continue_final_message")
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and (reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))):
        raise oai.APIError(400, f"'chat_template_kwargs' must not set {reserved[0]!r}: use the "
                                "request's own parameter where there is one",
                           param=f"chat_template_kwargs.{reserved[0]}")
    chat = {k: v for k, v in body.items() if k != "return_token_strs"}
    chat["model"] = model_name
    if chat.get("tools") is not None:
        # Rendered as a chat completion renders them; "none" because a prompt is all
        # /tokenize makes (the default "auto" would ask for a tool-call parser).
        chat["tool_choice"] = "none"
    req = oai.parse_request("chat", json.dumps(chat).encode(), {model_name})
    return encoder.encode(req)


def _prompt_ids(encoder: PromptEncoder, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise oai.APIError(400, "'prompt' must be a string", param="prompt")
    return encoder._encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))


def _tokenize_body(encoder: PromptEncoder, body: dict, model_name: str,
                   max_model_len: int) -> dict[str, Any]:
    """The response to one /tokenize request; raises APIError for a client's mistake."""
    is_chat = body.get("messages") is not None
    if is_chat and body.get("prompt") is not None:
        raise oai.APIError(400, "give either 'prompt' (completion form) or 'messages' "
                                "(chat form), not both", param="prompt")
    if not is_chat and body.get("prompt") is None:
        raise oai.APIError(400, "'prompt' or 'messages' is a required property", param="prompt")
    _check_fields(body, CHAT_FIELDS if is_chat else COMPLETION_FIELDS)
    _check_model(body, model_name)
    want_strs = _flag(body, "return_token_strs", False)
    ids = list(_chat_ids(encoder, body, model_name) if is_chat else _prompt_ids(encoder, body))
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": encoder.tokenizer.convert_ids_to_tokens(ids) if want_strs else None}


def _detokenize_body(encoder: PromptEncoder, body: dict, model_name: str
                     ) -> dict[str, Any]:
    """The response to one /detokenize request: the tokenizer's own decode, special
    tokens spelled out (vLLM's default)."""
    _check_fields(body, DETOKENIZE_FIELDS)
    _check_model(body, model_name)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise oai.APIError(400, "'tokens' must be an array of token ids", param="tokens")
    return {"prompt": encoder.tokenizer.decode(encoder.check_ids(tokens, param="tokens"))}


def handlers(encoder: PromptEncoder, cfg: EdgeConfig) -> tuple[Handler, Handler]:
    """(tokenize, detokenize): aiohttp handlers over the edge's PromptEncoder, for the
    model `cfg` serves. Their APIErrors are left to the app's error middleware."""

    async def tokenize(request: web.Request) -> web.Response:
        body = oai._load_object(await request.read())
        return web.json_response(_tokenize_body(encoder, body, cfg.name, cfg.max_model_len))

    async def detokenize(request: web.Request) -> web.Response:
        body = oai._load_object(await request.read())
        return web.json_response(_detokenize_body(encoder, body, cfg.name))

    return tokenize, detokenize
