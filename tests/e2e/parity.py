"""Every OpenAI and vLLM request parameter, each set away from its default, sent
to both the reference vLLM server and pdserve: pdserve must answer as the
reference does (same text, finish, choices, logprobs within float tolerance) or
refuse with a 400 naming the parameter (`REFUSED`). Greedy, so answers are exact."""
from __future__ import annotations

import math

CHAT_MESSAGES = [{"role": "user", "content": "the small green dog and the quick network went "
                                             "across the cold blue river to the old ship"}]
PROMPT = "the small green dog and the quick network went across the cold blue river"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                   "required": ["city"], "additionalProperties": False}}}


def _case(kind: str, **extra) -> tuple[str, dict]:
    base = ({"messages": CHAT_MESSAGES} if kind == "chat" else {"prompt": PROMPT})
    return kind, {"temperature": 0, "max_tokens": 10, **base, **extra}


# name -> (kind, body without model). One parameter (or a parameter's form) each.
CASES: dict[str, tuple[str, dict]] = {
    "baseline-chat": _case("chat"),
    "baseline-completion": _case("completion"),
    "logprobs-chat": _case("chat", logprobs=True, top_logprobs=3),
    "logprobs-chat-0": _case("chat", logprobs=True),
    "logprobs-completion": _case("completion", logprobs=2),
    "echo": _case("completion", echo=True),
    "echo-logprobs": _case("completion", echo=True, logprobs=1, max_tokens=4),
    # vLLM refuses n > 1 when greedy; seeded, choice i draws with seed + i.
    "n": _case("completion", n=2, temperature=1.0, seed=5),
    "n-chat": _case("chat", n=3, max_tokens=6, temperature=1.0, seed=6),
    "best_of": _case("completion", n=2, best_of=2, max_tokens=4, temperature=1.0, seed=7),
    "json_object": _case("chat", response_format={"type": "json_object"}, max_tokens=24),
    "json_schema": _case("chat", max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                               "strict": True}}),
    "structured_outputs-regex": _case("completion", structured_outputs={"regex": "[a-z]{3,6}"}),
    "structured_outputs-choice": _case("chat", structured_outputs={"choice": ["red", "blue"]}),
    "named-tool": _case("chat", tools=[TOOL], max_tokens=30, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}),
    "required-tool": _case("chat", tools=[TOOL], max_tokens=40, tool_choice="required"),
    "auto-tool": _case("chat", tools=[TOOL], max_tokens=12),
    "tool-history": _case("chat", tools=[TOOL], tool_choice="none", messages=[
        *CHAT_MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]),
    "logit_bias": _case("completion", logit_bias={"100": 100}),
    "min_tokens": _case("completion", min_tokens=8, max_tokens=8),
    "stop": _case("completion", stop=["e"]),
    "stop-include": _case("completion", stop=["e"], include_stop_str_in_output=True),
    "stop_token_ids": _case("completion", stop_token_ids=[100, 262, 318]),
    "repetition_penalty": _case("completion", repetition_penalty=1.5),
    "presence_penalty": _case("completion", presence_penalty=1.5, temperature=1.0, seed=3),
    "frequency_penalty": _case("completion", frequency_penalty=1.5, temperature=1.0, seed=4),
    "seed": _case("completion", temperature=1.0, seed=7),
    "top_p": _case("completion", temperature=1.0, top_p=0.5, seed=8),
    "top_k": _case("completion", temperature=1.0, top_k=5, seed=9),
    "min_p": _case("completion", temperature=1.0, min_p=0.2, seed=10),
    "truncate_prompt_tokens": _case("completion", truncate_prompt_tokens=5),
    "truncate_prompt_tokens-all": _case("chat", truncate_prompt_tokens=-1),
    "add_special_tokens": _case("completion", add_special_tokens=False),
    "max_completion_tokens": _case("chat", max_completion_tokens=3),
    "add_generation_prompt": _case("chat", add_generation_prompt=False),
    "user": _case("chat", user="u-1"),
    "developer-role": _case("chat", messages=[{"role": "developer", "content": "be brief"},
                                              *CHAT_MESSAGES]),
    "ignore_eos": _case("completion", ignore_eos=True),
    "cache_salt": _case("completion", cache_salt="tenant-a"),
    # Refused: pdserve does not do these (each a 400 naming it).
    "use_beam_search": _case("completion", use_beam_search=True),
    "skip_special_tokens": _case("chat", skip_special_tokens=False),
    "length_penalty": _case("completion", length_penalty=2.0),
    "suffix": _case("completion", suffix=" end"),
    "functions": _case("chat", functions=[TOOL["function"]]),
    "echo-chat": _case("chat", echo=True),
    "prompt_logprobs": _case("completion", prompt_logprobs=1),
    "allowed_token_ids": _case("completion", allowed_token_ids=[1, 2, 3]),
    "bad_words": _case("completion", bad_words=["the"]),
    "priority": _case("completion", priority=1),
    "return_token_ids": _case("completion", return_token_ids=True),
}
# The parameter each refused case must name.
REFUSED = {"use_beam_search": "use_beam_search", "skip_special_tokens": "skip_special_tokens",
           "length_penalty": "length_penalty", "suffix": "suffix", "functions": "functions",
           "echo-chat": "echo", "prompt_logprobs": "prompt_logprobs",
           "allowed_token_ids": "allowed_token_ids", "bad_words": "bad_words",
           "priority": "priority", "return_token_ids": "return_token_ids"}


def close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-3)


def differences(kind: str, ours: dict, theirs: dict) -> list[str]:
    """How pdserve's answer differs from the reference's (empty: the same)."""
    out = []
    if len(ours["choices"]) != len(theirs["choices"]):
        return [f"{len(ours['choices'])} choices against {len(theirs['choices'])}"]
    for a, b in zip(sorted(ours["choices"], key=lambda c: c["index"]),
                    sorted(theirs["choices"], key=lambda c: c["index"])):
        if a["finish_reason"] != b["finish_reason"]:
            out.append(f"finish {a['finish_reason']} != {b['finish_reason']}")
        if kind == "chat":
            ma, mb = a["message"], b["message"]
            if (ma.get("content") or "") != (mb.get("content") or ""):
                out.append(f"content {ma.get('content')!r} != {mb.get('content')!r}")
            calls_a = [(c["function"]["name"], c["function"]["arguments"])
                       for c in ma.get("tool_calls") or []]
            calls_b = [(c["function"]["name"], c["function"]["arguments"])
                       for c in mb.get("tool_calls") or []]
            if calls_a != calls_b:
                out.append(f"tool calls {calls_a} != {calls_b}")
            out += _chat_logprobs(a.get("logprobs"), b.get("logprobs"))
        else:
            if a["text"] != b["text"]:
                out.append(f"text {a['text']!r} != {b['text']!r}")
            out += _completion_logprobs(a.get("logprobs"), b.get("logprobs"))
    return out


def _chat_logprobs(a, b) -> list[str]:
    if (a is None) != (b is None):
        return [f"logprobs {a} != {b}"]
    if a is None:
        return []
    ca, cb = a["content"], b["content"]
    if [e["token"] for e in ca] != [e["token"] for e in cb]:
        return ["logprob tokens differ"]
    for ea, eb in zip(ca, cb):
        if not close(ea["logprob"], eb["logprob"]):
            return [f"logprob {ea['logprob']} != {eb['logprob']}"]
        ta, tb = ea.get("top_logprobs") or [], eb.get("top_logprobs") or []
        if [t["token"] for t in ta] != [t["token"] for t in tb] or not all(
                close(x["logprob"], y["logprob"]) for x, y in zip(ta, tb)):
            return [f"top logprobs {ta} != {tb}"]
    return []


def _completion_logprobs(a, b) -> list[str]:
    if (a is None) != (b is None):
        return [f"logprobs {a} != {b}"]
    if a is None:
        return []
    if a["tokens"] != b["tokens"]:
        return [f"logprob tokens {a['tokens']} != {b['tokens']}"]
    if not all(close(x, y) for x, y in zip(a["token_logprobs"], b["token_logprobs"])):
        return [f"token logprobs {a['token_logprobs']} != {b['token_logprobs']}"]
    for ta, tb in zip(a["top_logprobs"], b["top_logprobs"]):
        if (ta is None) != (tb is None) or (ta and (set(ta) != set(tb) or not all(
                close(ta[t], tb[t]) for t in ta))):
            return [f"top logprobs {ta} != {tb}"]
    return []


def assemble(kind: str, events: list[dict]) -> dict:
    """A streamed answer's events put back together as the non-streamed answer."""
    choices: dict[int, dict] = {}
    for event in events:
        for c in event["choices"]:
            choice = choices.setdefault(c["index"], {
                "index": c["index"], "finish_reason": None, "logprobs": None,
                **({"message": {"content": "", "tool_calls": []}} if kind == "chat"
                   else {"text": ""})})
            choice["finish_reason"] = c["finish_reason"] or choice["finish_reason"]
            if kind == "chat":
                _take_delta(choice, c["delta"], c.get("logprobs"))
            else:
                choice["text"] += c["text"]
                _take_completion_logprobs(choice, c.get("logprobs"))
    return {"choices": list(choices.values())}


def _take_delta(choice: dict, delta: dict, logprobs) -> None:
    message = choice["message"]
    message["content"] += delta.get("content") or ""
    for call in delta.get("tool_calls") or []:
        while len(message["tool_calls"]) <= call["index"]:
            message["tool_calls"].append({"function": {"name": "", "arguments": ""}})
        function = message["tool_calls"][call["index"]]["function"]
        function["name"] += (call.get("function") or {}).get("name") or ""
        function["arguments"] += (call.get("function") or {}).get("arguments") or ""
    if logprobs is not None:
        choice["logprobs"] = choice["logprobs"] or {"content": []}
        choice["logprobs"]["content"] += logprobs["content"]


def _take_completion_logprobs(choice: dict, logprobs) -> None:
    if logprobs is None:
        return
    if choice["logprobs"] is None:
        choice["logprobs"] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for key in choice["logprobs"]:
        choice["logprobs"][key] += logprobs[key]
