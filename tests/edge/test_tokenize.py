"""/tokenize and /detokenize: vLLM's request and response JSON, the tokenizer's own ids,
and the chat form's count equal to what /v1/chat/completions sends the engine."""
from __future__ import annotations

import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from transformers import AutoTokenizer

from pdserve.services.edge.app import _errors
from pdserve.services.edge.openai_protocol import parse_request
from pdserve.services.edge.prompts import PromptEncoder
from pdserve.services.edge.tokenize import handlers
from pdserve.config import EdgeConfig

MAX_MODEL_LEN = 2048
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why is the sky blue? Ünïcödé"},
        {"role": "assistant", "content": "Scattering"}]


@pytest.fixture(scope="module")
def encoder(model_dir) -> PromptEncoder:
    return PromptEncoder(str(model_dir))


@pytest.fixture(scope="module")
def auto(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture
async def client(encoder, model_dir):
    """The two handlers on a bare app, behind the edge's own error middleware."""
    cfg = EdgeConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN)
    tokenize, detokenize = handlers(encoder, cfg)
    app = web.Application(middlewares=[_errors])
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    async with TestClient(TestServer(app, host="127.0.0.1")) as http:
        yield http


async def _post(client, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with client.post(path, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


async def test_a_prompt_is_tokenized_with_the_tokenizers_special_tokens_by_default(
        client, auto, model_dir):
    for prompt in ["hello world", "  spaces\tand\nlines ", "Ünïcödé", ""]:
        status, body = await _post(client, "/tokenize", {"model": str(model_dir),
                                                          "prompt": prompt})
        ids = auto.encode(prompt)
        assert status == 200, body
        assert body == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                        "token_strs": None}
    # vLLM's bench client sends exactly this: model, prompt, add_special_tokens false.
    status, body = await _post(client, "/tokenize", {"prompt": "hello world",
                                                      "add_special_tokens": False,
                                                      "return_token_strs": True})
    ids = auto.encode("hello world", add_special_tokens=False)
    assert status == 200 and body["tokens"] == ids and body["count"] == len(ids)
    assert body["token_strs"] == auto.convert_ids_to_tokens(ids)


async def test_a_chat_is_tokenized_as_its_chat_template_renders_it(client, auto):
    cases = [({}, dict(add_generation_prompt=True)),
             ({"add_generation_prompt": False}, dict(add_generation_prompt=False)),
             ({"add_generation_prompt": False, "continue_final_message": True},
              dict(add_generation_prompt=False, continue_final_message=True))]
    for options, template in cases:
        status, body = await _post(client, "/tokenize", {"messages": CHAT, **options,
                                                          "return_token_strs": True})
        text = auto.apply_chat_template(CHAT, tokenize=False, **template)
        ids = auto.encode(text, add_special_tokens=False)
        assert status == 200, (options, body)
        assert body["tokens"] == ids and body["count"] == len(ids), options
        assert body["token_strs"] == auto.convert_ids_to_tokens(ids)
    # add_special_tokens adds the tokenizer's own (BOS) before the template's.
    status, body = await _post(client, "/tokenize", {"messages": CHAT,
                                                      "add_special_tokens": True})
    text = auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert status == 200 and body["tokens"] == auto.encode(text)


async def test_a_chats_count_is_the_prompt_tokens_of_the_same_chat_completion(
        client, encoder, model_dir):
    for messages in (CHAT[:2], [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]):
        status, body = await _post(client, "/tokenize", {"messages": messages})
        req = parse_request("chat", json.dumps({"model": str(model_dir),
                                                "messages": messages}).encode(),
                            {str(model_dir)})
        assert status == 200 and body["tokens"] == encoder.encode(req)


async def test_detokenize_is_the_tokenizers_decode_with_special_tokens_spelled_out(
        client, auto, model_dir):
    _, tokenized = await _post(client, "/tokenize", {"messages": CHAT})
    for ids in (tokenized["tokens"], auto.encode("hello world"), []):
        status, body = await _post(client, "/detokenize", {"model": str(model_dir),
                                                            "tokens": ids})
        assert status == 200 and body == {"prompt": auto.decode(ids)}
    assert (await _post(client, "/detokenize", {"tokens": tokenized["tokens"]}))[1][
        "prompt"].startswith(auto.bos_token)


async def test_null_fields_count_as_absent(client, auto):
    status, body = await _post(client, "/tokenize", {
        "model": None, "prompt": "hi", "add_special_tokens": None, "return_token_strs": None,
        "messages": None, "tools": None})
    assert status == 200 and body["tokens"] == auto.encode("hi") and body["token_strs"] is None


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"model": "other", "prompt": "hi"}, 404, "model"),
    ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
    ("/tokenize", {"prompt": "hi", "temperature": 0.5}, 400, "temperature"),
    ("/tokenize", {"prompt": "hi", "add_generation_prompt": True}, 400,
     "add_generation_prompt"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"chat_template": "x"}}, 400,
     "chat_template_kwargs.chat_template"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "max_tokens": 4}, 400, "max_tokens"),
    ("/tokenize", {"prompt": "hi", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": "yes"}, 400, "return_token_strs"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, 400, "prompt"),
    ("/detokenize", b"{not json", 400, None),
], ids=lambda v: None)
async def test_a_request_it_cannot_honour_is_refused_naming_the_parameter(
        client, path, body, status, param):
    got, answer = await _post(client, path, body)
    assert got == status, answer
    assert answer["error"]["param"] == param, answer
    if status == 404:
        assert answer["error"]["code"] == "model_not_found"


async def test_a_chat_with_tools_counts_as_the_chat_completion_with_those_tools(
        client, encoder, model_dir):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    status, body = await _post(client, "/tokenize", {"messages": CHAT[:2], "tools": tools})
    req = parse_request("chat", json.dumps({"model": str(model_dir), "messages": CHAT[:2],
                                            "tools": tools, "tool_choice": "none"}).encode(),
                        {str(model_dir)})
    assert status == 200, body
    assert body["tokens"] == encoder.encode(req)
    got, answer = await _post(client, "/tokenize", {"messages": CHAT[:2], "tools": tools,
                                                     "tool_choice": "auto"})
    assert got == 400 and answer["error"]["param"] == "tool_choice"
