"""Bad input gets an OpenAI-shaped 4xx, never a 500 or a hung stream."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from support import raw_exchange


def _post(stack, path: str, raw: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"{stack.url}{path}", data=raw,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _j(**body) -> bytes:
    return json.dumps(body).encode()


BAD = [
    ("malformed-json", "/v1/chat/completions", lambda m: b'{"model": ', 400, None),
    ("not-an-object", "/v1/completions", lambda m: b"[1, 2]", 400, None),
    ("missing-model", "/v1/chat/completions",
     lambda m: _j(messages=[{"role": "user", "content": "hi"}]), 400, "model"),
    ("unknown-model", "/v1/chat/completions",
     lambda m: _j(model="gpt-9", messages=[{"role": "user", "content": "hi"}]), 404, "model"),
    ("empty-messages", "/v1/chat/completions", lambda m: _j(model=m, messages=[]), 400,
     "messages"),
    ("messages-wrong-type", "/v1/chat/completions", lambda m: _j(model=m, messages="hi"), 400,
     "messages"),
    ("content-wrong-type", "/v1/chat/completions",
     lambda m: _j(model=m, messages=[{"role": "user", "content": 5}]), 400, None),
    ("bad-role", "/v1/chat/completions",
     lambda m: _j(model=m, messages=[{"role": "wizard", "content": "hi"}]), 400, None),
    ("missing-prompt", "/v1/completions", lambda m: _j(model=m), 400, "prompt"),
    ("negative-max-tokens", "/v1/completions", lambda m: _j(model=m, prompt="hi", max_tokens=-1),
     400, "max_tokens"),
    ("string-max-tokens", "/v1/completions",
     lambda m: _j(model=m, prompt="hi", max_tokens="10"), 400, "max_tokens"),
    ("huge-max-tokens", "/v1/completions",
     lambda m: _j(model=m, prompt="hi", max_tokens=10**9), 400, None),
    ("temperature-wrong-type", "/v1/completions",
     lambda m: _j(model=m, prompt="hi", temperature="hot"), 400, "temperature"),
    ("stream-wrong-type", "/v1/completions",
     lambda m: _j(model=m, prompt="hi", stream="yes"), 400, "stream"),
    ("token-id-out-of-vocab", "/v1/completions",
     lambda m: _j(model=m, prompt=[1, 2, 999999]), 400, "prompt"),
    ("prompt-longer-than-context", "/v1/completions",
     lambda m: _j(model=m, prompt=[5] * 2100, max_tokens=1), 400, None),
    ("chat-longer-than-context", "/v1/chat/completions",
     lambda m: _j(model=m, messages=[{"role": "user", "content": "dog " * 3000}]), 400, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_openai_error(stack, name, path, body, status, param):
    code, resp = _post(stack, path, body(stack.model))
    assert code == status, resp
    err = resp["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param


def test_context_overflow_names_the_numbers(stack):
    code, resp = _post(stack, "/v1/completions", _j(model=stack.model, prompt=[5] * 2000,
                                                     max_tokens=100))
    assert code == 400 and resp["error"]["code"] == "context_length_exceeded"
    assert "2048" in resp["error"]["message"] and "2100" in resp["error"]["message"]


def test_unknown_route_and_method_are_json(stack):
    req = urllib.request.Request(f"{stack.url}/v1/nothing")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 404 and json.loads(e.value.read())["error"]["type"]
    req = urllib.request.Request(f"{stack.url}/v1/completions")  # GET
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 405 and "error" in json.loads(e.value.read())


def test_malformed_http_is_json_too(stack):
    """What aiohttp's parser refuses (before any route) is answered by `pdserve up`'s
    edge in the same JSON: a header line over 8 KiB, a bad chunk size."""
    for raw in (b"GET /health HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):
        answer = raw_exchange(stack.url, raw, timeout=10)
        assert answer is not None and answer.version in ("HTTP/1.0", "HTTP/1.1"), answer
        assert answer.status == 400, answer
        assert answer.headers["content-type"].startswith("application/json"), answer
        assert json.loads(answer.body)["error"]["code"] == "malformed_http"


def test_service_still_works_after_bad_input(stack):
    for _, path, body, _, _ in BAD:
        _post(stack, path, body(stack.model))
    code, resp = _post(stack, "/v1/completions", _j(model=stack.model, prompt="hi",
                                                     max_tokens=3))
    assert code == 200 and resp["usage"]["completion_tokens"] >= 1
    with urllib.request.urlopen(f"{stack.url}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    rejected = re.findall(r'pdserve:requests_total\{endpoint="[^"]+",path="none",status="4\d\d"\} '
                          r'(\S+)', metrics)
    assert sum(float(v) for v in rejected) >= len(BAD)
