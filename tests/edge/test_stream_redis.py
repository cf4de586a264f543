"""Two edge replicas sharing a real Redis (`--stream-store redis://`): a stream started
on one is resumed, followed and cancelled through the other."""
from __future__ import annotations

import asyncio
import json
import random
import shutil

import aiohttp
import pytest

from pdserve.bench.synthetic import read_stamps
from support import Proc, free_port
from synthetic_stack import edge_stack
from support import RESUMABLE, parse_sse
from test_streams import text_of

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make test installs it "
                                       "when run as root: apt-get install redis-server)")


@pytest.fixture
def redis_url():
    port = free_port()
    proc = Proc(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no"], name="redis-server")
    proc.wait_listening(port)
    try:
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.stop(timeout=10)


async def read_until(resp, n: int) -> list:
    got, buf = [], ""
    async for piece in resp.content.iter_any():
        buf += piece.decode()
        *done, buf = buf.split("\n\n")
        got += parse_sse("\n\n".join(done) + "\n\n")
        if len(got) >= n:
            break
    return got[:n]


async def test_resume_on_the_other_replica_at_random_points(model_dir, redis_url):
    rng = random.Random(3)
    async with edge_stack(model_dir, rate=200.0, replicas=2, stream_store=redis_url,
                          stream_resume_seconds=1.0) as stack:
        (a, _), (b, _) = stack.replicas
        async with aiohttp.ClientSession() as http:
            async def one() -> None:
                async with http.post(f"{a}/v1/completions", json=stack.body(40),
                                     headers=RESUMABLE) as r:
                    sid = r.headers["x-pdserve-stream-id"]
                    got = await read_until(r, rng.randint(1, 40))
                    r.close()
                async with http.get(f"{b}/v1/streams/{sid}",
                                    headers={"Last-Event-ID": str(got[-1][0])}) as r:
                    assert r.status == 200
                    rest = parse_sse(await r.text())
                async with http.get(f"{a}/v1/streams/{sid}") as r:
                    whole = parse_sse(await r.text())
                assert got + rest == whole
                assert len(read_stamps(text_of(whole))) == 40
            for _ in range(4):
                await asyncio.gather(*(one() for _ in range(5)))
            async with http.get(f"{b}/v1/streams/str_{'a' * 32}") as r:
                assert r.status == 404


async def test_a_reader_on_the_other_replica_keeps_it_alive_and_delete_there_cancels(
        model_dir, redis_url):
    async with edge_stack(model_dir, rate=100.0, replicas=2, stream_store=redis_url,
                          stream_resume_seconds=0.5) as stack:
        (a, _), (b, _) = stack.replicas
        async with aiohttp.ClientSession() as http:
            r = await http.post(f"{a}/v1/completions", json=stack.body(1000))
            sid = r.headers["x-pdserve-stream-id"]
            await read_until(r, 2)
            r.close()                                   # the reader on A is gone...
            follower = await http.get(f"{b}/v1/streams/{sid}")
            await read_until(follower, 3)
            await asyncio.sleep(1.5)                    # ...but B's reader keeps it going
            assert len(stack.engine.running) == 1
            async with http.delete(f"{b}/v1/streams/{sid}") as d:
                assert (await d.json())["cancelled"] is True
            for _ in range(50):
                if not stack.engine.running:
                    break
                await asyncio.sleep(0.02)
            assert stack.engine.running == {}
            tail = parse_sse(await follower.text())
            assert tail[-1][1] == "[DONE]"
            assert json.loads(tail[-2][1])["error"]["code"] == "stream_cancelled"


def _events(pairs) -> list[dict]:
    return [json.loads(data) for _, data in pairs if data != "[DONE]"]


async def test_a_background_response_resumes_reads_and_cancels_on_the_other_replica(
        model_dir, redis_url, tmp_path):
    """100 background responses started on A, their streams dropped at random events,
    resumed on B with starting_after: the events equal the whole log's, gapless; the
    Response, cancel and ownership answer on B as on A."""
    keys = tmp_path / "keys"
    keys.write_text("sk-a alice normal\nsk-b bob normal\n")
    alice, bob = {"Authorization": "Bearer sk-a"}, {"Authorization": "Bearer sk-b"}
    rng = random.Random(50)
    async with edge_stack(model_dir, rate=200.0, replicas=2, stream_store=redis_url,
                          stream_resume_seconds=1.0, api_keys_file=str(keys)) as stack:
        (a, _), (b, _) = stack.replicas
        request = {"model": stack.model, "input": "hi", "max_output_tokens": 40,
                   "stream": True, "background": True}
        async with aiohttp.ClientSession() as http:
            async def one() -> None:
                async with http.post(f"{a}/v1/responses", json=request, headers=alice) as r:
                    got = _events(await read_until(r, rng.randint(3, 40)))
                    r.close()
                rid, last = got[0]["response"]["id"], got[-1]["sequence_number"]
                async with http.get(f"{b}/v1/responses/{rid}?stream=true&starting_after={last}",
                                    headers=alice) as r:
                    assert r.status == 200
                    rest = _events(parse_sse(await r.text()))
                async with http.get(f"{a}/v1/responses/{rid}?stream=true", headers=alice) as r:
                    whole = _events(parse_sse(await r.text()))
                assert got + rest == whole
                assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
                text = "".join(e["delta"] for e in whole
                               if e["type"] == "response.output_text.delta")
                assert len(read_stamps(text)) == 40
                for _ in range(50):             # the record follows the log into Redis
                    async with http.get(f"{b}/v1/responses/{rid}", headers=alice) as r:
                        if (await r.json())["status"] == "incomplete":
                            break
                    await asyncio.sleep(0.02)
                assert (await r.json())["output"][0]["content"][0]["text"] == text
                async with http.get(f"{b}/v1/responses/{rid}", headers=bob) as r:
                    assert r.status == 404
            for _ in range(10):
                await asyncio.gather(*(one() for _ in range(10)))
            long = {**request, "max_output_tokens": 2000, "stream": False}
            async with http.post(f"{a}/v1/responses", json=long, headers=alice) as r:
                rid = (await r.json())["id"]
            async with http.post(f"{b}/v1/responses/{rid}/cancel", headers=alice) as r:
                assert (await r.json())["status"] == "cancelled"
            async with http.get(f"{b}/v1/responses/{rid}?stream=true", headers=alice) as r:
                assert _events(parse_sse(await r.text()))[-1]["type"] == "response.cancelled"
            await stack.until(lambda: not stack.engine.running, timeout=2)
