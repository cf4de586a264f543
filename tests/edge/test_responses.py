"""/v1/responses over the synthetic stack: the typed events and their sequence
numbers, the Response object, background runs, resume with starting_after, cancel,
delete, previous_response_id, ownership by key, and the 400s and 404s."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from pdserve.bench.synthetic import read_stamps
from support import parse_sse
from pdserve.services.edge.app import ORCH
from synthetic_stack import edge_stack

KEYS = "sk-alice alice normal\nsk-bob bob normal\n"
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}


@pytest.fixture
async def stack(model_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    async with edge_stack(model_dir, rate=200.0, stream_resume_seconds=1.0,
                          api_keys_file=str(keys)) as s:
        yield s


def body(stack, max_tokens: int = 12, **extra) -> dict:
    return {"model": stack.model, "input": "hello", "max_output_tokens": max_tokens, **extra}


def events_of(raw: str) -> list[dict]:
    return [json.loads(data) for _, data in parse_sse(raw) if data != "[DONE]"]


async def post(http, stack, headers=ALICE, **fields):
    async with http.post(f"{stack.url}/v1/responses", json=body(stack, **fields),
                         headers=headers) as r:
        return r.status, (await r.text() if fields.get("stream") else await r.json())


async def test_a_streamed_response_sends_the_typed_events_in_order_numbered_from_0(stack):
    async with aiohttp.ClientSession() as http:
        status, raw = await post(http, stack, stream=True, max_tokens=12)
    assert status == 200
    assert raw.startswith("event: response.created\ndata: {") and "[DONE]" not in raw
    events = events_of(raw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    text = "".join(deltas)
    assert len(read_stamps(text)) == 12
    done = events[-2]["item"]
    assert done["content"][0]["text"] == text and done["status"] == "incomplete"
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["output"] == [done]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    usage = final["usage"]
    assert usage["output_tokens"] >= 12
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert final["id"].startswith("resp_") and events[0]["response"]["status"] == "in_progress"


async def test_a_whole_response_is_stored_and_read_back_by_its_key_only(stack):
    async with aiohttp.ClientSession() as http:
        status, resp = await post(http, stack, max_tokens=8, metadata={"k": "v"},
                                  instructions="be brief")
        assert status == 200 and resp["object"] == "response"
        assert resp["metadata"] == {"k": "v"} and resp["instructions"] == "be brief"
        text = resp["output"][0]["content"][0]["text"]
        assert len(read_stamps(text)) == 8
        rid = resp["id"]
        async with http.get(f"{stack.url}/v1/responses/{rid}", headers=ALICE) as r:
            assert r.status == 200 and await r.json() == resp
        for method, path in (("GET", ""), ("POST", "/cancel"), ("DELETE", ""),
                             ("GET", "?stream=true")):
            async with http.request(method, f"{stack.url}/v1/responses/{rid}{path}",
                                    headers=BOB) as r:
                assert r.status == 404, (method, path)
                assert (await r.json())["error"]["code"] == "not_found"
        async with http.post(f"{stack.url}/v1/responses", headers=BOB,
                             json=body(stack, previous_response_id=rid)) as r:
            assert r.status == 404
            assert (await r.json())["error"]["param"] == "previous_response_id"
        async with http.get(f"{stack.url}/v1/responses/resp_{'0' * 32}", headers=ALICE) as r:
            assert r.status == 404
        async with http.delete(f"{stack.url}/v1/responses/{rid}", headers=ALICE) as r:
            assert await r.json() == {"id": rid, "object": "response", "deleted": True}
        async with http.get(f"{stack.url}/v1/responses/{rid}", headers=ALICE) as r:
            assert r.status == 404
        status, resp = await post(http, stack, max_tokens=4, store=False)
        async with http.get(f"{stack.url}/v1/responses/{resp['id']}", headers=ALICE) as r:
            assert r.status == 404


async def test_background_runs_without_a_reader_and_resumes_after_any_event(stack):
    async with aiohttp.ClientSession() as http:
        status, resp = await post(http, stack, max_tokens=30, background=True)
        assert status == 200 and resp["status"] == "in_progress" and resp["background"]
        rid = resp["id"]
        url = f"{stack.url}/v1/responses/{rid}"
        async with http.get(f"{url}?stream=true", headers=ALICE) as r:
            whole = events_of(await r.text())
        assert whole[-1]["type"] == "response.incomplete"
        for n in (0, 5, len(whole) - 2):
            async with http.get(f"{url}?stream=true&starting_after={n}", headers=ALICE) as r:
                assert r.status == 200
                assert events_of(await r.text()) == whole[n + 1:]
        async with http.get(url, headers=ALICE) as r:
            assert (await r.json())["status"] == "incomplete"
        for bad in ("-1", str(len(whole)), "x"):
            async with http.get(f"{url}?stream=true&starting_after={bad}", headers=ALICE) as r:
                assert r.status == 400, bad
                assert (await r.json())["error"]["param"] == "starting_after"


async def test_a_cancelled_background_response_ends_with_response_cancelled(stack):
    async with aiohttp.ClientSession() as http:
        status, resp = await post(http, stack, max_tokens=2000, background=True)
        rid = resp["id"]
        async with http.get(f"{stack.url}/v1/responses/{rid}?stream=true",
                            headers=ALICE) as r:
            reading = asyncio.ensure_future(r.text())
            await asyncio.sleep(0.3)
            async with http.post(f"{stack.url}/v1/responses/{rid}/cancel",
                                 headers=ALICE) as c:
                assert c.status == 200
                assert (await c.json())["status"] == "cancelled"
            events = events_of(await reading)
        assert events[-1]["type"] == "response.cancelled"
        assert events[-1]["response"]["status"] == "cancelled"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert 0 < len(read_stamps("".join(e["delta"] for e in events
                                           if e["type"] == "response.output_text.delta"))) < 2000
        _, resp = await post(http, stack, max_tokens=4)
        async with http.post(f"{stack.url}/v1/responses/{resp['id']}/cancel",
                             headers=ALICE) as c:
            assert c.status == 400              # only background responses cancel


async def test_previous_response_id_continues_the_conversation_on_its_session(stack):
    async with aiohttp.ClientSession() as http:
        _, first = await post(http, stack, max_tokens=6)
        _, second = await post(http, stack, max_tokens=6, previous_response_id=first["id"],
                               input=[{"role": "user", "content": [
                                   {"type": "input_text", "text": "and then?"}]}])
        assert second["previous_response_id"] == first["id"]
        # The second prompt holds the first turn, its answer and the new turn.
        assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + 6


async def test_unknown_and_bad_fields_are_refused_by_name(stack):
    cases = {"reasoning": {"effort": "high"}, "truncation": "auto", "max_tool_calls": 3,
             "max_output_tokens": 0, "temperature": 3, "background": "yes",
             "tools": [{"type": "web_search"}]}
    async with aiohttp.ClientSession() as http:
        for field, value in cases.items():
            status, resp = await post(http, stack, **{field: value})
            assert status == 400, field
            assert resp["error"]["param"].startswith(field.split(".")[0]), (field, resp)
        status, resp = await post(http, stack, background=True, store=False)
        assert status == 400 and resp["error"]["param"] == "background"
        status, resp = await post(http, stack, text={"format": {"type": "xml"}})
        assert status == 400 and resp["error"]["param"] == "text.format.type"
        status, resp = await post(http, stack, input=[{"type": "image", "url": "x"}])
        assert status == 400 and resp["error"]["param"] == "input[0].type"


async def test_a_dead_decode_worker_moves_the_response_without_a_gap(model_dir):
    async with edge_stack(model_dir, rate=50.0, engines=2) as stack:
        request = {"model": stack.model, "input": "hi", "max_output_tokens": 40,
                   "stream": True}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{stack.url}/v1/responses", json=request) as r:
                raw, killed = "", False
                async for piece in r.content.iter_any():
                    raw += piece.decode()
                    if not killed and raw.count("output_text.delta") >= 5:
                        [dead] = [s for e, s in stack.engines if e.running]
                        await dead.stop(0)
                        killed = True
            events = events_of(raw)
            rid = events[0]["response"]["id"]
            async with http.get(f"{stack.url}/v1/responses/{rid}?stream=true") as r:
                assert events_of(await r.text()) == events
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] == "response.incomplete"
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        stamps = read_stamps(text)
        assert len(stamps) > 5 and stamps == sorted(set(stamps))    # none lost to the move
        assert stack.metrics.migrations.labels(stack.model)._value.get() == 1


async def test_a_chain_is_routed_under_its_first_response_id(stack):
    """previous_response_id makes the chain's first id the session key of every turn
    (the router keeps a session's turns on the worker holding their KV); a
    prompt_cache_key names the key instead."""
    router, sessions = stack.app[ORCH].router, []
    route = router.Route

    async def recording(request, timeout=None):
        sessions.append(request.session_id)
        return await route(request, timeout=timeout)
    router.Route = recording
    async with aiohttp.ClientSession() as http:
        ids = []
        for turn in range(4):
            _, resp = await post(http, stack, max_tokens=3, input=f"turn {turn}",
                                 previous_response_id=ids[-1] if ids else None)
            ids.append(resp["id"])
        _, other = await post(http, stack, max_tokens=3)
        _, keyed = await post(http, stack, max_tokens=3, prompt_cache_key="my-agent")
    assert sessions == [ids[0]] * 4 + [other["id"], "my-agent"]


async def test_a_preempted_response_pauses_and_goes_on_without_a_gap(model_dir, tmp_path,
                                                                     monkeypatch):
    """Two background responses of one tenant hold both slots; another tenant's request
    takes one back at once; the preempted response ends with all its events, in order."""
    import pdserve.services.edge.shares as shares
    monkeypatch.setattr(shares, "USE_SECONDS", 0.05)     # heavy is heavy at once
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    async with edge_stack(model_dir, rate=200.0, capacity=2, api_keys_file=str(keys),
                          admission_wait_seconds=10.0) as stack:
        await stack.until(lambda: stack.admission.capacity == 2)
        async with aiohttp.ClientSession() as http:
            ids = [(await post(http, stack, max_tokens=100, background=True))[1]["id"]
                   for _ in range(2)]
            await asyncio.sleep(0.1)
            status, resp = await post(http, stack, headers=BOB, max_tokens=5)
            assert status == 200 and resp["status"] == "incomplete"
            for rid in ids:
                async with http.get(f"{stack.url}/v1/responses/{rid}?stream=true",
                                    headers=ALICE) as r:
                    events = events_of(await r.text())
                assert [e["sequence_number"] for e in events] == list(range(len(events)))
                assert events[-1]["type"] == "response.incomplete"
        assert stack.metrics.preemptions._value.get() == 1
        assert any("-p" in rid for rid in stack.engine.requests)   # a leg went on after it
