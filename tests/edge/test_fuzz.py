"""The API surface fuzzed: schemathesis generates valid and invalid requests from
`/openapi.json`, hypothesis throws raw bytes and odd headers at every route, and
bytes that are not quite HTTP over a bare socket (aiohttp's parser answers those).
Only 2xx/4xx may come back, every 4xx is OpenAI-shaped JSON, and the edge answers a
valid request afterwards. PDSERVE_FUZZ_EXAMPLES sets the cases per operation (CI runs a
few hundred in all; `PDSERVE_FUZZ_EXAMPLES=1000 pytest tests/edge/test_fuzz.py` for
thousands)."""
from __future__ import annotations

import asyncio
import collections
import json
import os
import threading

import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import strategies as st

from pdserve.services.edge.openapi import SPEC
from support import raw_exchange
from synthetic_stack import edge_stack

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "25"))
STATUSES: collections.Counter = collections.Counter()     # every answer the fuzzers got
KEY = "sk-fuzz-" + "f" * 32


@pytest.fixture(scope="module")
def edge(tmp_path_factory, model_dir):
    """The edge in front of a fast synthetic engine, on a loop of its own thread (the
    fuzzers call it with blocking clients)."""
    keys = tmp_path_factory.mktemp("fuzz") / "keys"
    keys.write_text(f"{KEY} fuzz normal\n")
    ready, stop, out = threading.Event(), None, {}

    def run() -> None:
        nonlocal stop
        loop = asyncio.new_event_loop()
        stop = loop.create_future()

        async def main() -> None:
            async with edge_stack(model_dir, rate=20000.0, api_keys_file=str(keys),
                                  max_model_len=2048) as stack:
                out["stack"] = stack
                ready.set()
                await stop
        loop.run_until_complete(main())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30)
    yield out["stack"]
    stop.get_loop().call_soon_threadsafe(stop.set_result, None)
    thread.join(30)


def check(resp: requests.Response) -> None:
    STATUSES[resp.status_code] += 1
    assert resp.status_code < 500, (resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        body = resp.json()
        assert set(body) == {"error"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["type"], body


def still_works(stack) -> None:
    r = requests.post(f"{stack.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": stack.model, "prompt": "hello", "max_tokens": 3}, timeout=10)
    assert r.status_code == 200, r.text


def test_openapi_lists_exactly_the_routes_served(edge):
    served = {(r.method.lower(), r.resource.canonical) for r in edge.app.router.routes()
              if r.method != "HEAD"}
    described = {(m, p) for p, ops in SPEC["paths"].items() for m in ops}
    assert served == described
    assert requests.get(f"{edge.url}/openapi.json", timeout=5).json() == json.loads(
        json.dumps(SPEC))


schema = schemathesis.openapi.from_dict(SPEC)


@schema.include(method=["POST", "GET", "DELETE"]).exclude(path="/v1/ws").parametrize()
@hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck), derandomize=True)
def test_schemathesis(case, edge):
    for headers in ({"Authorization": f"Bearer {KEY}"}, {}):
        if case.body is not None and isinstance(case.body, dict) and "model" in case.body \
                and case.body.get("model") == "":
            case.body["model"] = edge.model
        check(case.call(base_url=edge.url, headers=headers, timeout=30))


ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
          ("GET", "/v1/streams/str_x"), ("DELETE", "/v1/streams/str_x"), ("GET", "/v1/ws"),
          ("GET", "/health"), ("GET", "/openapi.json"), ("PUT", "/v1/completions")]
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60).map(str.strip)


@hypothesis.given(route=st.sampled_from(ROUTES), body=st.binary(max_size=2048),
                  content_type=st.sampled_from(["application/json", "text/plain", "",
                                                "application/json; charset=latin-1"]),
                  last_id=header_text, session=header_text,
                  auth=st.sampled_from([f"Bearer {KEY}", "Bearer x", "", f"bearer  {KEY}"]))
@hypothesis.settings(max_examples=EXAMPLES * 5, deadline=None, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck), derandomize=True)
def test_raw_bytes_and_odd_headers(edge, route, body, content_type, last_id, session, auth):
    method, path = route
    headers = {"Content-Type": content_type, "Last-Event-ID": last_id, "x-session-id": session,
               "Authorization": auth}
    resp = requests.request(method, edge.url + path, data=body, timeout=30,
                            headers={k: v for k, v in headers.items() if v})
    check(resp)


@hypothesis.given(obj=st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=6), max_leaves=20),
    endpoint=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
@hypothesis.settings(max_examples=EXAMPLES * 5, deadline=None, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck), derandomize=True)
def test_json_of_any_shape(edge, obj, endpoint):
    if isinstance(obj, dict):
        obj.setdefault("model", edge.model)
        obj["max_tokens"] = 3 if not isinstance(obj.get("max_tokens"), int) else obj["max_tokens"]
    resp = requests.post(edge.url + endpoint, data=json.dumps(obj, allow_nan=True), timeout=30,
                         headers={"Authorization": f"Bearer {KEY}",
                                  "Content-Type": "application/json"})
    check(resp)


token = st.binary(min_size=0, max_size=12)
method = st.sampled_from([b"GET", b"POST", b"DELETE", b"P\x00ST", b"G ET", b"",
                          b"\xff\xfe"]) | token
target = st.sampled_from([p.encode() for _, p in ROUTES]
                         + [b"*", b"", b"/v1/\x00", b"http://x/"]) | token
version = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.x", b"http/1.1", b"",
                           b"HTTP/1.1 x"])
header = st.tuples(st.sampled_from([b"Host", b"Content-Length", b"Transfer-Encoding",
                                    b"Authorization", b"Content-Type", b"X Bad", b"X\x00", b"",
                                    b"Connection"]) | token,
                   st.sampled_from([b"127.0.0.1", b"chunked", b"-1", b"1e3", b"0x10", b"close",
                                    f"Bearer {KEY}".encode(), b"a" * 9000, b"\r\n x"]) | token)
framing = st.sampled_from(["length", "chunked", "bad-chunk", "none"])


@hypothesis.given(method=method, target=target, version=version,
                  headers=st.lists(header, max_size=5), framing=framing,
                  body=st.binary(max_size=64))
@hypothesis.settings(max_examples=EXAMPLES * 8, deadline=None, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck), derandomize=True)
def test_malformed_http_gets_json(edge, method, target, version, headers, framing, body):
    """Bytes that are not quite HTTP (aiohttp's parser answers these, not the app):
    every answer is still below 500 and every error OpenAI-shaped JSON."""
    lines = [method + b" " + target + b" " + version, b"Host: 127.0.0.1", b"Connection: close"]
    lines += [name + b": " + value for name, value in headers]
    if framing == "length":
        lines.append(b"Content-Length: %d" % len(body))
    elif framing != "none":
        lines.append(b"Transfer-Encoding: chunked")
        size = b"%x" % len(body) if framing == "chunked" else b"zz"
        body = size + b"\r\n" + body + b"\r\n0\r\n\r\n"
    resp = raw_exchange(edge.url, b"\r\n".join(lines) + b"\r\n\r\n" + body)
    if resp is None:
        STATUSES["closed"] += 1
        return
    STATUSES[resp.status] += 1
    assert resp.status < 500, (resp.status, resp.body[:300])
    if resp.status >= 400:
        error = json.loads(resp.body)
        assert set(error) == {"error"} and error["error"]["message"], error
        assert resp.headers.get("content-type", "").startswith("application/json")


def test_malformed_http_cases_by_name(edge):
    """The parse errors one by one: each a 400 in JSON naming what was wrong."""
    cases = {b"G\x00T /health HTTP/1.1": "method", b"GET /health HTTP/9": "version",
             b"GET /health HTTP/1.1\r\nX Bad: 1": "header", b"GET /health HTTP/1.1\r\nX: " +
             b"a" * 9000: "header"}
    for head, _ in cases.items():
        resp = raw_exchange(edge.url, head + b"\r\nConnection: close\r\n\r\n")
        assert resp is not None and resp.status == 400, (head[:40], resp and resp.body)
        error = json.loads(resp.body)["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "malformed_http"
        assert error["message"] and "\n" not in error["message"]
    still_works(edge)


def test_after_the_fuzz_a_valid_request_works(edge):
    print(f"\nfuzz: {sum(STATUSES.values())} requests, by status {dict(sorted(STATUSES.items()))}")
    still_works(edge)
    r = requests.post(f"{edge.url}/v1/completions", data=b"x" * (2 << 20), timeout=10,
                      headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]
