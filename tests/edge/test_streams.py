"""Resumable SSE: stream ids, event ids, replay from Last-Event-ID, several readers,
cancel vs drop, and a slow reader cut off. The edge runs in front of the synthetic
decode worker (tests/edge/synthetic_stack.py), so every case takes a second or two."""
from __future__ import annotations

import asyncio
import json
import random
import socket

import aiohttp
import pytest

from pdserve.bench.synthetic import read_stamps
from support import RESUMABLE, parse_sse
from pdserve.services.edge.app import METRICS as METRICS_KEY
from synthetic_stack import edge_stack


def text_of(events) -> str:
    out = []
    for _, data in events:
        if data != "[DONE]":
            obj = json.loads(data)
            out.extend(c.get("text", "") for c in obj.get("choices", []))
    return "".join(out)


def _post(body: bytes, headers: dict | None = None) -> bytes:
    """A raw HTTP/1.1 POST of a completion request (for clients on bare sockets)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"%bContent-Length: %d\r\n\r\n%b" % (extra, len(body), body))


@pytest.fixture
async def stack(model_dir):
    async with edge_stack(model_dir, rate=200.0, stream_resume_seconds=1.0) as s:
        yield s


async def test_events_carry_ids_and_a_stream_id_and_replay_from_last_event_id(stack):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.url}/v1/completions", json=stack.body(30),
                             headers=RESUMABLE) as r:
            assert r.status == 200
            assert r.headers["Content-Type"] == "text/event-stream"
            assert r.headers["Cache-Control"] == "no-cache"
            assert r.headers["X-Accel-Buffering"] == "no"
            sid = r.headers["x-pdserve-stream-id"]
            raw = await r.text()
        assert raw.startswith("retry: ")
        events = parse_sse(raw)
        assert [i for i, _ in events] == list(range(1, len(events) + 1))
        assert events[-1][1] == "[DONE]"
        assert len(read_stamps(text_of(events))) == 30
        # Replay: from the start, and from after any event.
        async with http.get(f"{stack.url}/v1/streams/{sid}") as r:
            assert r.status == 200
            assert parse_sse(await r.text()) == events
        async with http.get(f"{stack.url}/v1/streams/{sid}",
                            headers={"Last-Event-ID": "7"}) as r:
            assert parse_sse(await r.text()) == events[7:]
        # Nothing after the last event of a finished stream: 204 (EventSource stops).
        async with http.get(f"{stack.url}/v1/streams/{sid}",
                            headers={"Last-Event-ID": str(len(events))}) as r:
            assert r.status == 204


async def test_cut_at_random_points_and_resumed_gives_the_uninterrupted_text(stack):
    """100 trials: read a live stream up to a random event, drop the connection,
    resume with Last-Event-ID: no gap, no duplicate, same events as a full replay."""
    rng = random.Random(9)
    async with aiohttp.ClientSession() as http:
        async def one(trial: int) -> None:
            async with http.post(f"{stack.url}/v1/completions", json=stack.body(40),
                                 headers=RESUMABLE) as r:
                sid = r.headers["x-pdserve-stream-id"]
                cut, got, buf = rng.randint(1, 40), [], ""
                async for piece in r.content.iter_any():
                    buf += piece.decode()
                    *done, buf = buf.split("\n\n")
                    got += parse_sse("\n\n".join(done) + "\n\n")
                    if len(got) >= cut:
                        break
                r.close()                            # the connection drops mid-stream
            got = got[:cut]
            async with http.get(f"{stack.url}/v1/streams/{sid}",
                                headers={"Last-Event-ID": str(got[-1][0])}) as r:
                rest = parse_sse(await r.text())
            async with http.get(f"{stack.url}/v1/streams/{sid}") as r:
                whole = parse_sse(await r.text())
            assert got + rest == whole, f"trial {trial}: cut after {cut}"
            assert [i for i, _ in whole] == list(range(1, len(whole) + 1))
            assert len(read_stamps(text_of(got + rest))) == 40
        for batch in range(10):
            await asyncio.gather(*(one(batch * 10 + k) for k in range(10)))


async def test_ten_readers_get_identical_events_and_a_stalled_one_is_cut(model_dir):
    async with edge_stack(model_dir, rate=800.0, stream_stall_seconds=0.5,
                          max_model_len=8192) as stack:
        async with aiohttp.ClientSession() as http:
            r = await http.post(f"{stack.url}/v1/completions", json=stack.body(2400))
            sid = r.headers["x-pdserve-stream-id"]

            async def reader() -> list:
                async with http.get(f"{stack.url}/v1/streams/{sid}") as resp:
                    return parse_sse(await resp.text())

            # A reader that never reads: its socket buffers fill, its writes block.
            # (A small receive buffer, so that happens within the test's few seconds.)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", int(stack.url.rsplit(":", 1)[1])))
            sock.sendall(f"GET /v1/streams/{sid} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            loop = asyncio.get_running_loop()
            started = loop.time()
            readers = await asyncio.gather(*(reader() for _ in range(9)), r.text())
            took = loop.time() - started
            sock.close()
            r.close()
        first = readers[0]
        assert len(first) > 2000 and first[-1][1] == "[DONE]"
        for other in readers[1:-1]:
            assert other == first
        # The client that asked reads OpenAI's framing: the same events, data lines only.
        assert parse_sse(readers[-1]) == [(None, data) for _, data in first]
        # 2400 chunks at 800/s: 3 s; the stalled reader did not hold anyone up.
        assert took < 6, took
        assert stack.metrics.streams_cut.labels("sse")._value.get() == 1


@pytest.mark.parametrize("framing", ["plain", "resumable"])
async def test_a_reader_that_pauses_gets_every_event_once_in_order(model_dir, framing):
    """A caught-up SSE reader is written from the log's appends (sse.pushed); one
    that stops reading for a while backs its socket up, goes back to awaited writes,
    catches up and is pushed to again: every event once, in order, and not cut. In
    either framing (the pushed writer renders each)."""
    async with edge_stack(model_dir, rate=800.0, stream_stall_seconds=3.0,
                          max_model_len=8192) as stack:
        port = int(stack.url.rsplit(":", 1)[1])
        body = json.dumps(stack.body(2400)).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, _post(body, RESUMABLE if framing == "resumable" else {}))
        raw, paused = b"", 0
        while not raw.endswith(b"\r\n0\r\n\r\n"):
            if paused < 3 and len(raw) > 20_000 * (paused + 1):
                paused += 1
                await asyncio.sleep(0.4)        # stop reading: the edge's writes back up
            piece = await asyncio.wait_for(loop.sock_recv(sock, 4096), 10)
            assert piece, "the edge closed the connection"
            raw += piece
        sock.close()
        head, _, chunked = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower()
        sid = next(line.split(b": ", 1)[1].decode() for line in head.split(b"\r\n")
                   if line.lower().startswith(b"x-pdserve-stream-id"))
        text = b""
        while chunked:                          # HTTP/1.1 chunks, parsed by hand
            size, _, rest = chunked.partition(b"\r\n")
            text, chunked = text + rest[:int(size, 16)], rest[int(size, 16) + 2:]
        events = parse_sse(text.decode())
        assert paused == 3
        numbered = list(range(1, len(events) + 1))
        assert [i for i, _ in events] == (numbered if framing == "resumable"
                                          else [None] * len(events))
        assert events[-1][1] == "[DONE]" and len(read_stamps(text_of(events))) == 2400
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{stack.url}/v1/streams/{sid}") as r:
                # The log's events, each once and in order: the n-th data line is event n.
                assert parse_sse(await r.text()) == [(i, d) for i, (_, d) in
                                                     zip(numbered, events)]
        assert stack.metrics.streams_cut.labels("sse")._value.get() == 0


async def test_a_client_that_hangs_up_at_done_got_a_whole_response(stack):
    """The stream's last events go out with the body's end, in one write: a client
    that resets the connection the moment it reads [DONE] got a complete response,
    and the edge counts a 200, not a 499."""
    import struct
    port = int(stack.url.rsplit(":", 1)[1])
    body = json.dumps(stack.body(20)).encode()

    def hang_up_at_done() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(_post(body))
            got = b""
            while b"data: [DONE]" not in got:
                got += sock.recv(65536)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return got

    requests = stack.metrics.requests
    for _ in range(5):
        got = await asyncio.to_thread(hang_up_at_done)
        assert got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), got[-60:]
    await stack.until(lambda: requests.labels("/v1/completions", "local", "200")._value.get() == 5)
    assert requests.labels("/v1/completions", "local", "499")._value.get() == 0


async def test_the_headers_and_the_first_event_arrive_in_one_write(stack):
    """The response's head waits for the first event and goes out in the same write:
    the client's first read holds both (two writes would wake it for the head alone)."""
    port = int(stack.url.rsplit(":", 1)[1])
    body = json.dumps(stack.body(20)).encode()

    def first_read() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(_post(body))
            return sock.recv(65536)

    for _ in range(5):
        got = await asyncio.to_thread(first_read)
        assert got.startswith(b"HTTP/1.1 200") and b"\r\n\r\n" in got, got[:80]
        head, first = got.split(b"\r\n\r\n", 1)
        assert b"text/event-stream" in head.lower()
        # The first HTTP/1.1 chunk holds the first event (OpenAI's framing: data only).
        assert first.split(b"\r\n", 1)[1].startswith(b"data: {"), got


async def test_delete_cancels_at_once_and_a_drop_waits_for_resume(stack):
    async with aiohttp.ClientSession() as http:
        r = await http.post(f"{stack.url}/v1/completions", json=stack.body(2000))
        sid = r.headers["x-pdserve-stream-id"]
        await r.content.readuntil(b"\n\n")
        assert len(stack.engine.running) == 1
        async with http.delete(f"{stack.url}/v1/streams/{sid}") as d:
            assert d.status == 200 and (await d.json())["cancelled"] is True
        tail = parse_sse((await r.text()))
        assert tail[-1][1] == "[DONE]"
        assert json.loads(tail[-2][1])["error"]["code"] == "stream_cancelled"
        await asyncio.sleep(0.1)
        assert stack.engine.running == {}

        # A drop without cancel: still generating during the resume window (1 s here)...
        r = await http.post(f"{stack.url}/v1/completions", json=stack.body(2000))
        sid = r.headers["x-pdserve-stream-id"]
        await r.content.readuntil(b"\n\n")
        r.close()
        await asyncio.sleep(0.5)
        assert len(stack.engine.running) == 1
        # ...a reader coming back keeps it going...
        async with http.get(f"{stack.url}/v1/streams/{sid}",
                            headers={"Last-Event-ID": "3"}) as again:
            assert again.status == 200
            await again.content.readuntil(b"\n\n")
        # ...and once nobody reads for the window, it is aborted on the engine.
        await asyncio.sleep(1.6)
        assert stack.engine.running == {}
        async with http.get(f"{stack.url}/v1/streams/{sid}") as whole:
            events = parse_sse(await whole.text())
        assert json.loads(events[-2][1])["error"]["code"] == "stream_cancelled"


@pytest.mark.parametrize("sid,last,status", [
    ("str_" + "0" * 32, None, 404),             # forged
    ("../../etc/passwd", None, 404),
    ("x" * 300, None, 404),
    (None, "abc", 400),                         # not a number
    (None, "-1", 400),
    (None, "99999", 400),                        # beyond the end
    (None, "1" * 40, 400),
])
async def test_bad_stream_ids_and_positions_are_clear_4xx(stack, sid, last, status):
    async with aiohttp.ClientSession() as http:
        if sid is None:
            async with http.post(f"{stack.url}/v1/completions", json=stack.body(3)) as r:
                sid = r.headers["x-pdserve-stream-id"]
                await r.read()
        headers = {"Last-Event-ID": last} if last is not None else {}
        async with http.get(f"{stack.url}/v1/streams/{sid}", headers=headers) as r:
            assert r.status == status
            assert "message" in (await r.json())["error"]
        async with http.delete(f"{stack.url}/v1/streams/{'str_' + 'f' * 32}") as r:
            assert r.status == 404
        async with http.post(f"{stack.url}/v1/completions", json=stack.body(3)) as r:
            assert r.status == 200                 # and the next request works


async def test_keepalive_comments_bounded_log_and_expiry(model_dir):
    async with edge_stack(model_dir, rate=4.0, sse_keepalive_seconds=0.1, stream_max_events=5,
                          stream_ttl_seconds=1.0) as stack:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{stack.url}/v1/completions", json=stack.body(4),
                                 headers=RESUMABLE) as r:
                sid = r.headers["x-pdserve-stream-id"]
                raw = await r.text()
            # 4 tokens 250 ms apart, keepalive every 100 ms: comments in between.
            assert raw.count(": keepalive\n\n") >= 2
            assert len(parse_sse(raw)) == 6                 # 4 tokens, the finish, [DONE]
            async with http.get(f"{stack.url}/v1/streams/{sid}") as r:
                assert r.status == 410                       # event 1 is no longer kept
                assert (await r.json())["error"]["code"] == "events_gone"
            async with http.get(f"{stack.url}/v1/streams/{sid}",
                                headers={"Last-Event-ID": "1"}) as r:
                assert [i for i, _ in parse_sse(await r.text())] == [2, 3, 4, 5, 6]
            await asyncio.sleep(1.2)
            async with http.get(f"{stack.url}/v1/streams/{sid}",
                                headers={"Last-Event-ID": "1"}) as r:
                assert r.status == 404                       # expired


async def test_shutdown_closes_websockets_with_1001(stack):
    import websockets
    async with websockets.connect(stack.url.replace("http", "ws") + "/v1/ws") as ws:
        await ws.send(json.dumps({"model": stack.model, "prompt": "hi", "max_tokens": 1000}))
        await ws.recv()
        await stack.app.shutdown()
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                await ws.recv()
        assert ws.close_code == 1001


async def test_a_generation_cancelled_before_it_ran_still_ends_its_stream():
    from pdserve.config import EdgeConfig
    from pdserve.services.edge.stream_log import MemoryStreams
    from pdserve.services.edge.streams import Streams
    ended = []
    cfg = EdgeConfig(model="-", stream_resume_seconds=1.0)
    streams = Streams(cfg, MemoryStreams(cfg), on_end=ended.append)

    async def payloads():
        yield ['{"never": 1}']
    live = streams.start(object(), lambda append: payloads())
    assert streams.cancel(live.stream_id, "at once")
    await asyncio.sleep(0.01)
    assert ended == [live] and live.ended == "cancelled"
    assert live.log.finished and live.log.events[-1] == "[DONE]"
    assert "stream_cancelled" in live.log.events[-2]


async def test_a_follower_keeps_one_place_whether_it_awaits_or_takes():
    """Awaited batches and take() advance the same place; the reader counts from its
    first read to its close; a reader that fell behind the bounded log is told."""
    from pdserve.services.edge.stream_log import EventsGone, StreamLog
    log, seen = StreamLog("str_x", max_events=4, ttl=1.0), []
    follower = log.follow(0)
    follower.on_open, follower.on_close = (lambda: seen.append("open"),
                                           lambda: seen.append("close"))
    log.listen(lambda: seen.append(log.last_seq))
    assert seen == [] and follower.take() == [] and seen == ["open"]
    log.append(["a", "b"])
    assert [(e.seq, e.data) for e in await follower.__anext__()] == [(1, "a"), (2, "b")]
    log.append(["c"])
    assert [(e.seq, e.data) for e in follower.take()] == [(3, "c")]
    waiting = asyncio.ensure_future(follower.__anext__())
    await asyncio.sleep(0)
    log.append(["d"])
    assert [(e.seq, e.data) for e in await waiting] == [(4, "d")]
    log.append(["e", "f", "g", "h", "i"])        # only the last 4 are kept: 6..9
    with pytest.raises(EventsGone):
        follower.take()
    log.finish()
    await follower.aclose()
    await follower.aclose()
    assert seen == ["open", 2, 3, 4, 9, 9, "close"]
    assert [e.seq for e in await log.follow(5).__anext__()] == [6, 7, 8, 9]


async def test_a_finished_generation_leaves_no_cycle_for_the_collector(stack):
    """A generation's objects go with their last reference once it is over: cycles
    through its renderer and its admission ticket left them to full collections,
    which stalled the edge's loop ~190 ms at the end of 1,000 streams."""
    import gc

    from pdserve.services.edge.ticket import Ticket
    from pdserve.services.edge.admitted import AdmittedGeneration
    from pdserve.services.edge.app import STREAMS
    from pdserve.services.edge.events import Renderer
    from pdserve.services.edge.generation_stream import GenerationStream
    from pdserve.services.edge.leg import LegCall
    from pdserve.services.edge.moves import Mover
    from pdserve.services.edge.output import Output
    from pdserve.services.edge.stats import GenerationStats
    kinds = (GenerationStream, Ticket, Renderer, AdmittedGeneration, LegCall, Mover, Output,
             GenerationStats)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(f"{stack.url}/v1/completions", json=stack.body(10)) as r:
                    assert r.status == 200
                    assert "[DONE]" in await r.text()
            await stack.until(lambda: not stack.app[STREAMS].live)
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage
                if isinstance(o, kinds)]
        assert left == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


async def test_n_choices_run_as_one_stream_and_stop_together(stack):
    """`n`: a generation per choice, interleaved in one stream, each choice's index on its
    chunks; a cancel aborts every choice's generation on the engine; a non-streamed
    answer holds every choice and usage counts them all."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.url}/v1/completions",
                             json=stack.body(6) | {"n": 3, "stream": False}) as r:
            whole = await r.json()
        assert sorted(c["index"] for c in whole["choices"]) == [0, 1, 2]
        assert all(len(read_stamps(c["text"])) == 6 for c in whole["choices"])
        # A synthetic output is several token ids: each choice's count is in the sum.
        assert whole["usage"]["completion_tokens"] >= 18
        r = await http.post(f"{stack.url}/v1/completions", json=stack.body(2000) | {"n": 2})
        sid, seen = r.headers["x-pdserve-stream-id"], set()
        while len(seen) < 2:
            line = await r.content.readline()
            if line.startswith(b"data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
        assert len(stack.engine.running) == 2
        async with http.delete(f"{stack.url}/v1/streams/{sid}") as d:
            assert d.status == 200
        await r.text()
        await stack.until(lambda: stack.engine.running == {}, timeout=2)
    metrics = stack.app[METRICS_KEY]
    await stack.until(lambda: metrics.running.labels(stack.model)._value.get() == 0, timeout=2)
