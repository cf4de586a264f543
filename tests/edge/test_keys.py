"""API keys and per-key limits, route by route: HTTP, WebSocket, streams, Inference gRPC.
No route under /v1/ answers without a valid key; a stream is its key's alone."""
from __future__ import annotations

import json
import statistics
import time

import aiohttp
import grpc
import pytest
import websockets

from pdserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from pdserve.services.edge.keys import KeyError_, KeyRing
from support import parse_sse
from synthetic_stack import edge_stack

ALICE = "sk-alice-" + "a" * 40
BOB = "sk-bob-" + "b" * 40
LIMITED = "sk-limited-" + "c" * 40


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(f"# key tenant priority [limits]\n{ALICE} alice high\n{BOB} bob normal\n"
                    f"{LIMITED} carol low rps=2 tpm=600\n")
    return path


@pytest.fixture
async def stack(model_dir, keys_file):
    async with edge_stack(model_dir, rate=200.0, api_keys_file=str(keys_file)) as s:
        yield s


def auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def test_every_http_route_needs_a_key(stack):
    sid = "str_" + "0" * 32
    routes = [("POST", "/v1/completions", stack.body(2)),
              ("POST", "/v1/chat/completions", {"model": stack.model, "max_tokens": 2,
                                                "messages": [{"role": "user", "content": "x"}]}),
              ("GET", "/v1/models", None), ("GET", f"/v1/streams/{sid}", None),
              ("DELETE", f"/v1/streams/{sid}", None), ("GET", "/v1/ws", None),
              ("GET", "/v1/nope", None)]
    async with aiohttp.ClientSession() as http:
        for method, path, body in routes:
            for key, why in ((None, "didn't provide"), ("sk-wrong", "Incorrect"),
                             (ALICE[:-1], "Incorrect")):
                async with http.request(method, stack.url + path, json=body,
                                        headers=auth(key)) as r:
                    assert r.status == 401, (method, path, key)
                    assert why in (await r.json())["error"]["message"]
            async with http.get(stack.url + "/v1/models",
                                headers={"Authorization": f"Basic {ALICE}"}) as r:
                assert r.status == 401
        async with http.post(f"{stack.url}/v1/completions", json=stack.body(2),
                             headers=auth(ALICE)) as r:
            assert r.status == 200
        for open_path in ("/health", "/metrics"):
            async with http.get(stack.url + open_path) as r:
                assert r.status != 401


async def test_websocket_needs_a_key(stack):
    url = stack.url.replace("http", "ws") + "/v1/ws"
    with pytest.raises(websockets.InvalidStatus) as e:
        async with websockets.connect(url):
            pass
    assert e.value.response.status_code == 401
    async with websockets.connect(url, additional_headers=auth(BOB)) as ws:
        await ws.send(json.dumps(stack.body(3)))
        frames = [json.loads(f) async for f in ws]
    assert frames[-1]["type"] == "done"


async def test_a_stream_is_readable_and_cancellable_by_its_key_only(stack):
    async with aiohttp.ClientSession() as http:
        r = await http.post(f"{stack.url}/v1/completions", json=stack.body(1000),
                            headers=auth(ALICE))
        sid = r.headers["x-pdserve-stream-id"]
        for method in ("GET", "DELETE"):
            async with http.request(method, f"{stack.url}/v1/streams/{sid}",
                                    headers=auth(BOB)) as other:
                assert other.status == 404            # as if it did not exist
        async with websockets.connect(stack.url.replace("http", "ws") + "/v1/ws",
                                      additional_headers=auth(BOB)) as ws:
            await ws.send(json.dumps({"stream_id": sid, "last_seq": 0}))
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await ws.recv()
            assert ws.close_code == 1008
        async with grpc.aio.insecure_channel(stack.inference) as ch:
            api = inference_pb2_grpc.InferenceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [c async for c in api.Generate(inference_pb2.GenerateRequest(
                    follow=inference_pb2.Follow(stream_id=sid)),
                    metadata=[("authorization", f"Bearer {BOB}")])]
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert not (await api.Abort(inference_pb2.AbortRequest(stream_id=sid),
                                        metadata=[("authorization", f"Bearer {BOB}")])).found
        assert len(stack.engine.running) == 1         # Bob cancelled nothing
        async with http.delete(f"{stack.url}/v1/streams/{sid}", headers=auth(ALICE)) as d:
            assert (await d.json())["cancelled"] is True
        r.close()


async def test_a_stream_token_reads_that_stream_only(stack):
    """`?token=` (for EventSource) follows the one stream it was issued for, with no
    key; it cancels nothing, opens no other stream, and a changed one is refused."""
    async with aiohttp.ClientSession() as http:
        r = await http.post(f"{stack.url}/v1/completions", json=stack.body(30), headers=auth(ALICE))
        sid, token = r.headers["x-pdserve-stream-id"], r.headers["x-pdserve-stream-token"]
        mine = parse_sse(await r.text())            # OpenAI's framing: data lines only
        async with http.get(f"{stack.url}/v1/streams/{sid}", params={"token": token}) as f:
            # every event, from the start (numbered: the follower's framing)
            assert f.status == 200
            assert parse_sse(await f.text()) == [(n, d) for n, (_, d) in enumerate(mine, 1)]
        other = await http.post(f"{stack.url}/v1/completions", json=stack.body(1000),
                                headers=auth(BOB))
        bob_sid, bob_token = other.headers["x-pdserve-stream-id"], other.headers[
            "x-pdserve-stream-token"]
        key_id, mac = token.split(".")
        changed = mac[:-1] + ("B" if mac.endswith("A") else "A")    # never the same MAC
        refused = [(bob_sid, token), (sid, bob_token), (sid, key_id + "." + changed),
                   (sid, bob_token.split(".")[0] + "." + mac), (sid, ""), (sid, mac)]
        for stream, bad in refused:
            async with http.get(f"{stack.url}/v1/streams/{stream}", params={"token": bad}) as f:
                assert f.status == 401, (stream, bad)
                assert (await f.json())["error"]["code"] == "invalid_stream_token"
        async with http.delete(f"{stack.url}/v1/streams/{bob_sid}",
                               params={"token": bob_token}) as d:
            assert d.status == 401                   # a read token cancels nothing
        async with http.post(f"{stack.url}/v1/completions", json=stack.body(2),
                             params={"token": token}) as c:
            assert c.status == 401                   # ...nor generates
        assert len(stack.engine.running) == 1        # Bob's stream runs on
    async with websockets.connect(stack.url.replace("http", "ws") + "/v1/ws",
                                  additional_headers=auth(BOB)) as ws:
        await ws.send(json.dumps(stack.body(3)))
        started = json.loads(await ws.recv())
        assert started["stream_token"].split(".")[0] != key_id        # Bob's, not Alice's
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.url}/v1/streams/{started['stream_id']}",
                            params={"token": started["stream_token"]}) as f:
            assert f.status == 200 and "[DONE]" in await f.text()
        await http.delete(f"{stack.url}/v1/streams/{bob_sid}", headers=auth(BOB))
    other.close()


async def test_inference_grpc_needs_a_key(stack):
    req = inference_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(
        max_tokens=2))
    async with grpc.aio.insecure_channel(stack.inference) as ch:
        api = inference_pb2_grpc.InferenceStub(ch)
        for metadata in ([], [("authorization", "Bearer sk-wrong")],
                         [("authorization", ALICE)]):
            for call in (lambda: api.Generate(req, metadata=metadata).read(),
                         lambda: api.Abort(inference_pb2.AbortRequest(request_id="x"),
                                           metadata=metadata)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        chunks = [c async for c in api.Generate(req, metadata=[("authorization",
                                                               f"Bearer {ALICE}")])]
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_rate_limits_answer_429_with_openai_headers(stack):
    async with aiohttp.ClientSession() as http:
        statuses = []
        for _ in range(3):
            async with http.post(f"{stack.url}/v1/completions", json=stack.body(2),
                                 headers=auth(LIMITED)) as r:
                statuses.append(r.status)
                await r.read()
                headers = r.headers
        assert statuses == [200, 200, 429]
        assert int(headers["Retry-After"]) >= 1
        assert headers["x-ratelimit-limit-requests"] == "2"
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-reset-requests"].endswith("ms")
        # More tokens than the key may ever spend in a minute: 429, and no Retry-After
        # would help.
        async with http.post(f"{stack.url}/v1/completions", json=stack.body(700),
                             headers=auth(LIMITED)) as r:
            assert r.status == 429
            assert "600 per minute" in (await r.json())["error"]["message"]
        # Other keys are not limited.
        async with http.post(f"{stack.url}/v1/completions", json=stack.body(2),
                             headers=auth(BOB)) as r:
            assert r.status == 200 and "x-ratelimit-limit-requests" not in r.headers


def test_key_lookup_time_does_not_depend_on_a_shared_prefix(keys_file):
    ring = KeyRing.load(keys_file)
    near = f"Bearer {ALICE[:-1]}x"                  # all but the last character right
    far = "Bearer x" + "y" * (len(ALICE) - 1)       # nothing right
    times = {near: [], far: []}
    for _ in range(200):
        for header in (near, far):
            t = time.perf_counter_ns()
            for _ in range(50):
                ring.from_header(header)
            times[header].append(time.perf_counter_ns() - t)
    a, b = statistics.median(times[near]), statistics.median(times[far])
    print(f"\nkey lookup: shared prefix {a / 50:.0f} ns, none {b / 50:.0f} ns")
    assert ring.from_header(near) is None and ring.from_header(f"Bearer {ALICE}") is not None
    assert 0.8 < a / b < 1.25


@pytest.mark.parametrize("text", ["onlykey\n", "k t urgent\n", "k t high rps=0\n",
                                  "k t high burst=3\n", "k t high\nk u low\n"])
def test_bad_keys_files_are_refused_without_showing_the_key(tmp_path, text):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(KeyError_) as e:
        KeyRing.load(path)
    assert "onlykey" not in str(e.value) and ":1" in str(e.value) or ":2" in str(e.value)
