"""Server-sent events out of a stream log: framing, keepalive, a slow reader cut.

Two framings. OpenAI's (`plain`, the default on POST): `data: <payload>` lines
only, as every OpenAI client parses them. Resumable (`x-pdserve-sse:
resumable` on POST, always on `GET /v1/streams/{id}`): each event goes out as
`id: <seq>` + `data: <payload>`, so a client (a browser's EventSource by
itself) can resume with `Last-Event-ID`; the first write carries a `retry:`
hint, and an idle stream gets a comment line every keepalive interval, well
inside common proxy idle timeouts (60 s). Both write the same events in the
same order, one `data:` line each, numbered from 1: a plain client that
counted n data lines resumes with `Last-Event-ID: n`. A reader
is bounded: its socket's send buffer and its transport buffer are capped, so
a client that stops reading blocks only its own writes; after `stall_seconds`
blocked it is cut off (it can resume from the log), and the generation and
the other readers never wait for it.

A reader of a log that lives in this process, once it has caught up, is
written from the log's own append (`pushed`): the event goes to the socket in
the call that produced it, with no task woken per event (below saturation,
1,000 streams x 10 tokens/s, that and the batched legs' sink cut the edge's
CPU per token by 11-21%: docs/design/2026-12-03-sse-writes-from-the-log.md).
The first time the socket has bytes queued (or the reader fell behind the
bounded log), the relay goes back to awaiting its writes, with the stall timer,
from the same place, and is pushed to again once it has caught up.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import TYPE_CHECKING, AsyncIterator

from aiohttp import web

from .stream_log import DONE, EventsGone, Event, Follower, numbered

if TYPE_CHECKING:
    from .streams import LiveStream

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
           "X-Accel-Buffering": "no"}
# The request header that picks a POST's framing: "plain" (OpenAI's, the default)
# or "resumable" (`id:`, `retry:`, keepalive comments).
FRAMING_HEADER = "x-pdserve-sse"
FRAMINGS = ("plain", "resumable")
# The reconnect hint rides on the first event: a block holding only `retry:`
# reads as an event with empty data to some clients (OpenAI's SDK).
RETRY = b"retry: 1000\n"
BUFFER_BYTES = 64 * 1024            # per reader: kernel send buffer, and again in user space


def frame(batch: list[Event]) -> bytes:
    if not batch:
        return b": keepalive\n\n"
    return "".join([f"id: {e.seq}\ndata: {e.data}\n\n" for e in batch]).encode()


def plain_frame(batch: list[Event]) -> bytes:
    """OpenAI's framing exactly: `data:` lines only (the n-th data line is event n)."""
    return "".join([f"data: {e.data}\n\n" for e in batch]).encode()


def _typed(data: str) -> str:
    """A typed event (the Responses API's): `event: <its type>` before its data."""
    if data.startswith('{"type":"'):
        return f"event: {data[9:data.index(chr(34), 9)]}\ndata: {data}\n\n"
    return f"data: {data}\n\n"


def typed_frame(batch: list[Event]) -> bytes:
    """The Responses API's framing, as OpenAI sends it: `event:` and `data:` lines, and
    no `[DONE]` (the body's end ends the stream)."""
    return "".join([_typed(e.data) for e in batch if e.data != DONE]).encode()


def typed_chunked_events(seq: int, data: list[str]) -> bytes:
    """As `chunked_events`, in the Responses API's framing (`typed_frame`)."""
    return _chunk("".join([_typed(d) for d in data]).encode())


def chunked_events(seq: int, data: list[str]) -> bytes:
    """Events `seq`, `seq + 1`... as `frame` renders them, in one HTTP/1.1 chunk (the
    pushed writer's step, once per token). Payloads are ASCII JSON (events.py)."""
    if len(data) == 1:
        return _chunk(b"id: %d\ndata: %s\n\n" % (seq, data[0].encode()))
    return _chunk("".join([f"id: {seq + i}\ndata: {d}\n\n"
                           for i, d in enumerate(data)]).encode())


def plain_chunked_events(seq: int, data: list[str]) -> bytes:
    """As `chunked_events`, in OpenAI's framing (`plain_frame`)."""
    return _chunk("".join([f"data: {d}\n\n" for d in data]).encode())


def bound_buffers(request: web.Request) -> None:
    """Cap what one slow reader can hold in memory, in the kernel and here."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER_BYTES)
    transport.set_write_buffer_limits(high=BUFFER_BYTES)


async def within_stall(request: web.Request, write, stall_seconds: float) -> bool:
    """Await `write` (one write's coroutine). A reader whose socket is backed up
    gets `stall_seconds` for it, then its connection is aborted (False). With
    nothing queued the write cannot block, so no timer is armed: one per event
    cost as much of the edge's CPU as the per-event keepalive timeouts did."""
    transport = request.transport
    if transport is None or not transport.get_write_buffer_size():
        await write
        return True
    try:
        async with asyncio.timeout(stall_seconds):
            await write
        return True
    except TimeoutError:
        transport.abort()
        return False


class EventStreamResponse(web.StreamResponse):
    """A streamed response whose headers go out with its first bytes, in one write
    (aiohttp's `web.Response` does so; a `StreamResponse` sends them on their own at
    `prepare()`). `relay` prepares it only when it has an event to write, so this
    takes one socket write, and one wake-up of the client, off every stream's first
    event. (A private attribute of aiohttp's; without it the headers simply go out
    on their own again.)"""

    _send_headers_immediately = False


async def relay(request: web.Request, reader: AsyncIterator[list[Event]], headers: dict, *,
                stall_seconds: float, live: LiveStream | None = None,
                on_cut=lambda: None, plain: bool = False, typed: bool = False
                ) -> web.StreamResponse:
    """Write the reader's events as SSE until the stream ends. With `live` (the
    request that started the generation), headers wait for its first event, and a
    failure before any output raises as an HTTP error instead. `plain`: OpenAI's
    framing, no `id:`, `retry:` or comments (for clients that read `data:` lines
    only; the reader then has no keepalive either); `typed`: the Responses API's
    (`typed_frame`)."""
    resp = EventStreamResponse(headers={**headers, **HEADERS})
    render = typed_frame if typed else plain_frame if plain else frame
    hint = not (plain or typed)
    pushable = False                        # a live log's reader, on a chunked body
    async with contextlib.aclosing(reader) as batches:
        async for batch in batches:
            if not resp.prepared:
                if live is not None:
                    if not batch:
                        continue            # no keepalive before the first token
                    if live.error is not None:
                        raise live.error
                    resp.headers["x-pdserve-path"] = live.generation.stream.path
                await resp.prepare(request)
                bound_buffers(request)
                pushable = isinstance(reader, Follower) and _chunked(resp)
            data = render(batch)
            if hint and batch:
                data, hint = RETRY + data, False
            if data and not await within_stall(request, resp.write(data), stall_seconds):
                on_cut()
                return resp
            if pushable and not hint:
                last = await pushed(request, reader, render)
                if last is not None:
                    # The stream's last events and the body's end in one write, in
                    # this step: a client that hangs up at [DONE] finds a finished
                    # response (200), not a write to a closed socket.
                    await resp.write_eof(render(last) if last else b"")
                    return resp
    if not resp.prepared:
        # Nothing after the client's Last-Event-ID, and the stream is over: 204
        # tells an EventSource to stop reconnecting.
        return web.Response(status=204, headers=headers)
    await resp.write_eof()
    return resp


async def pushed(request: web.Request, follower: Follower, render) -> list[Event] | None:
    """Write the follower's new events to the socket from the log's own calls, as
    HTTP chunks (the response's headers are out, so the body is the transport's),
    until its last events come ([DONE], or the log finished): those it returns,
    for the caller to write with the body's end. None when the socket has bytes
    queued or the reader fell behind the bounded log: the caller goes on awaiting
    its writes, from the follower's place."""
    transport = request.transport
    woken = asyncio.get_running_loop().create_future()
    chunked = _CHUNKED.get(render, chunked_events)          # render's step

    def on_change() -> None:
        if woken.done():
            return
        try:
            if transport is None or transport.is_closing():
                raise ConnectionResetError("the client went away")
            if transport.get_write_buffer_size():
                woken.set_result(None)
            elif data := (taken := follower.take_data())[1]:
                seq = taken[0]
                if data[-1] == DONE:
                    woken.set_result(numbered(seq, data))
                else:
                    transport.write(chunked(seq, data))
            elif follower.log.finished:
                woken.set_result([])
            elif follower.keepalive_due() and (data := render([])):
                transport.write(_chunk(data))
        except EventsGone:
            woken.set_result(None)          # the awaited path raises it
        except Exception as e:  # noqa: BLE001 (it runs in the log's writer: never raise there)
            woken.set_exception(e)

    follower.log.listen(on_change)
    try:
        on_change()                         # whatever came since the last write
        return await woken
    finally:
        follower.log.unlisten(on_change)


def _chunked(resp: web.StreamResponse) -> bool:
    """Whether the body goes out as plain HTTP/1.1 chunks (what `pushed` writes)."""
    return (resp.headers.get("Transfer-Encoding") == "chunked" and not resp.compression
            and "Content-Encoding" not in resp.headers)


def _chunk(data: bytes) -> bytes:
    """`data` as one HTTP/1.1 chunk (never empty: an empty chunk ends the body)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


_CHUNKED = {plain_frame: plain_chunked_events, typed_frame: typed_chunked_events}
