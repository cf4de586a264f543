"""`/v1/ws` with real WebSocket clients (`websockets`, aiohttp's): frames, cancel,
resume, and hostile input, in front of the synthetic decode worker."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
import websockets

from pdserve.bench.synthetic import read_stamps
from synthetic_stack import edge_stack
from support import parse_sse
from test_streams import text_of


@pytest.fixture
async def stack(model_dir):
    async with edge_stack(model_dir, rate=200.0, stream_resume_seconds=1.0) as s:
        yield s


def ws_url(stack) -> str:
    return stack.url.replace("http://", "ws://") + "/v1/ws"


async def frames_until_close(ws) -> list[dict]:
    out = []
    async for raw in ws:
        out.append(json.loads(raw))
    return out


async def test_completion_frames_match_the_sse_replay(stack):
    async with websockets.connect(ws_url(stack)) as ws:
        await ws.send(json.dumps({"model": stack.model, "prompt": "hello", "max_tokens": 25}))
        frames = await frames_until_close(ws)
        assert ws.close_code == 1000
    head, body = frames[0], frames[1:]
    assert head["type"] == "stream" and head["stream_id"].startswith("str_")
    assert [f["seq"] for f in body] == list(range(1, len(body) + 1))
    assert body[-1]["type"] == "done"
    chunks = [f["data"] for f in body if f["type"] == "chunk"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert len(read_stamps(text)) == 25
    import aiohttp
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.url}/v1/streams/{head['stream_id']}") as r:
            assert text_of(parse_sse(await r.text())) == text


async def test_chat_and_resume_from_a_sequence_number(stack):
    async with websockets.connect(ws_url(stack)) as ws:
        await ws.send(json.dumps({"model": stack.model, "max_tokens": 30,
                                  "messages": [{"role": "user", "content": "hi"}]}))
        head = json.loads(await ws.recv())
        got = [json.loads(await ws.recv()) for _ in range(5)]
    # Dropped after 5 events; resume on a new socket from the last one seen.
    async with websockets.connect(ws_url(stack)) as ws:
        await ws.send(json.dumps({"stream_id": head["stream_id"], "last_seq": got[-1]["seq"]}))
        rest = await frames_until_close(ws)
    seqs = [f["seq"] for f in got + rest]
    assert seqs == list(range(1, len(seqs) + 1))
    assert got[0]["data"]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(f["data"]["choices"][0]["delta"].get("content", "")
                   for f in got + rest if f["type"] == "chunk" and f["data"]["choices"])
    assert len(read_stamps(text)) == 30


async def test_cancel_stops_the_engine_at_once(stack):
    async with websockets.connect(ws_url(stack)) as ws:
        await ws.send(json.dumps({"model": stack.model, "prompt": "hello", "max_tokens": 1500}))
        for _ in range(4):
            await ws.recv()
        assert len(stack.engine.running) == 1
        sent = time.perf_counter()
        await ws.send(json.dumps({"type": "cancel"}))
        while stack.engine.running:
            await asyncio.sleep(0.001)
        took_ms = (time.perf_counter() - sent) * 1000
        frames = await frames_until_close(ws)
        assert ws.close_code == 1000
    print(f"synthetic engine: running 0 after {took_ms:.1f} ms")
    assert took_ms < 100
    assert frames[-1]["type"] == "done" and frames[-2]["type"] == "error"
    assert frames[-2]["error"]["code"] == "stream_cancelled"


async def test_a_dropped_socket_keeps_the_generation_for_the_resume_window(stack):
    async with websockets.connect(ws_url(stack)) as ws:
        await ws.send(json.dumps({"model": stack.model, "prompt": "hello", "max_tokens": 1500}))
        await ws.recv()
    await asyncio.sleep(0.5)
    assert len(stack.engine.running) == 1
    await asyncio.sleep(1.0)
    assert stack.engine.running == {}


@pytest.mark.parametrize("send,code,reason", [
    (b"\x00\x01binary", 1003, "binary"),
    ("not json {", 1007, "JSON"),
    ("[1, 2, 3]", 1008, "object"),
    ('{"prompt": "hi"}', 1008, "model"),
    ('{"model": "M", "prompt": "hi", "max_tokens": -5}', 1008, "max_tokens"),
    ('{"stream_id": "str_forged", "last_seq": 0}', 1008, "no stream"),
    ('{"stream_id": 7}', 1008, "stream_id"),
    ("x" * (2 << 20), 1009, ""),
])
async def test_hostile_frames_close_with_a_proper_code(stack, send, code, reason):
    if isinstance(send, str):
        send = send.replace('"M"', json.dumps(stack.model))
    async with websockets.connect(ws_url(stack), max_size=None) as ws:
        await ws.send(send)
        texts = " ".join(await frames_until_raw_close(ws))
        assert ws.close_code == code, (ws.close_code, ws.close_reason, texts)
        assert reason in texts + " " + ws.close_reason
    async with websockets.connect(ws_url(stack)) as ws:            # the next one works
        await ws.send(json.dumps({"model": stack.model, "prompt": "hello", "max_tokens": 3}))
        assert (await frames_until_close(ws))[-1]["type"] == "done"


async def frames_until_raw_close(ws) -> list[str]:
    out = []
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            out.append(await ws.recv())
    return out


async def test_bad_utf8_and_a_junk_second_message(stack):
    reader, writer = await asyncio.open_connection("127.0.0.1", int(stack.url.rsplit(":", 1)[1]))
    writer.write(b"GET /v1/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    assert b" 101 " in await reader.readuntil(b"\r\n\r\n")
    payload, mask = b"\xff\xfe bad", b"\x01\x02\x03\x04"
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    writer.write(bytes([0x81, 0x80 | len(payload)]) + mask + masked)      # text, bad UTF-8
    head = await reader.readexactly(4)
    assert head[0] == 0x88 and int.from_bytes(head[2:4], "big") == 1007   # close 1007
    writer.close()
    async with websockets.connect(ws_url(stack)) as ws:
        await ws.send(json.dumps({"model": stack.model, "prompt": "hello", "max_tokens": 500}))
        await ws.recv()
        await ws.send(json.dumps({"type": "pause"}))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await ws.recv()
        assert closed.value.rcvd.code == 1008
