"""`/v1/ws`: a generation over a WebSocket.

The client's first message is one JSON text frame: an OpenAI chat request
(`messages`) or completion request (`prompt`), or a resume
(`{"stream_id": ..., "last_seq": N}`). The server answers with frames of JSON
text, all carrying the stream's sequence numbers:

    {"type": "stream", "stream_id", "request_id", "worker", "placement"[, "stream_token"]}
                                          (a new generation; the token: with API keys)
    {"type": "chunk", "seq": N, "data": <the SSE payload, same object>}
    {"type": "error", "seq": N, "error": {...}}
    {"type": "done", "seq": N}                                          then close 1000

`{"type": "cancel"}` at any time stops the generation on the decode worker
(its KV is freed). A client that just goes away leaves it to the resume
window, as an SSE client does. Binary frames close 1003; text that is not
JSON (or not UTF-8) 1007; a message that is JSON but not a request, or a
request the edge refuses, 1008 with the reason; a frame over 1 MiB 1009;
the edge draining, 1001. Ping/pong keeps idle connections alive.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref

from aiohttp import WSCloseCode, WSMsgType, web

from . import openai_protocol as oai
from .sse import within_stall
from .stream_log import DONE, BadPosition, Event, EventsGone, StreamGone

log = logging.getLogger("pdserve.edge")

SOCKETS = web.AppKey("websockets", weakref.WeakSet)
MAX_MESSAGE = 1 << 20
FIRST_MESSAGE_SECONDS = 30.0
PING_SECONDS = 20.0
WS_CLOSE_SECONDS = 2.0     # on shutdown, how long a socket waits for its client's closing frame


class Refused(Exception):
    """Close the socket with this code and reason."""

    def __init__(self, code: int, reason: str, error: dict | None = None):
        super().__init__(reason)
        self.code, self.reason, self.error = code, reason, error


def _frames(batch: list[Event]) -> list[str]:
    out = []
    for e in batch:
        if e.data == DONE:
            out.append(f'{{"type":"done","seq":{e.seq}}}')
        elif e.data.startswith('{"error":'):
            out.append(f'{{"type":"error","seq":{e.seq},"error":{e.data[9:-1]}}}')
        else:
            out.append(f'{{"type":"chunk","seq":{e.seq},"data":{e.data}}}')
    return out


def _message(msg) -> dict:
    """A client frame as a JSON object, or Refused with the right close code."""
    if msg.type == WSMsgType.BINARY:
        raise Refused(WSCloseCode.UNSUPPORTED_DATA, "binary frames are not supported; "
                      "send JSON text")
    if msg.type == WSMsgType.ERROR:
        exc = msg.data
        code = getattr(exc, "code", WSCloseCode.PROTOCOL_ERROR)
        raise Refused(code, str(exc)[:120] or "bad frame")
    if msg.type != WSMsgType.TEXT:
        raise Refused(WSCloseCode.OK, "")                  # closing
    try:
        obj = json.loads(msg.data)
    except ValueError:
        raise Refused(WSCloseCode.INVALID_TEXT, "a message must be JSON text") from None
    if not isinstance(obj, dict):
        raise Refused(WSCloseCode.POLICY_VIOLATION, "a message must be a JSON object")
    return obj


async def handle(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(heartbeat=PING_SECONDS, max_msg_size=MAX_MESSAGE,
                               timeout=WS_CLOSE_SECONDS)
    await ws.prepare(request)
    request.app[SOCKETS].add(ws)
    try:
        await _serve(request, ws)
    except Refused as e:
        if e.error is not None and not ws.closed:
            await ws.send_str(json.dumps({"type": "error", "error": e.error}))
        if not ws.closed:
            await ws.close(code=e.code, message=e.reason.encode()[:120])
    return ws


async def _serve(request: web.Request, ws: web.WebSocketResponse) -> None:
    from .app import CALLER, CONFIG, KEYS, METRICS, STREAMS, begin, start_stream, stream_errors
    cfg, streams = request.app[CONFIG], request.app[STREAMS]
    try:
        first = _message(await ws.receive(timeout=FIRST_MESSAGE_SECONDS))
    except asyncio.TimeoutError:
        raise Refused(WSCloseCode.POLICY_VIOLATION, "no request within "
                      f"{FIRST_MESSAGE_SECONDS:.0f} s") from None
    try:
        if "stream_id" in first:
            sid, after = first["stream_id"], first.get("last_seq", 0)
            if not isinstance(sid, str) or isinstance(after, bool) or not isinstance(after, int):
                raise oai.APIError(400, "stream_id must be a string and last_seq an integer")
            try:
                reader = await streams.read(sid, after, owner=request[CALLER].key_id)
            except (StreamGone, EventsGone, BadPosition) as e:
                raise stream_errors(e) from None
            request.app[METRICS].stream_resumes.labels("ws").inc()
        else:
            kind: oai.Kind = "chat" if "messages" in first else "completion"
            body = {k: v for k, v in first.items() if k != "type"} | {"stream": True}
            req, runs, _ = await begin(request, kind, json.dumps(body).encode())
            live = start_stream(request, req, runs)
            sid = live.stream_id
            reader = await streams.read(sid, 0, owner=live.owner)
            lead = runs[0].stream
            started = {"type": "stream", "stream_id": sid, "request_id": lead.gen.request_id,
                       "worker": lead.decode_worker, "placement": lead.stats.placed.placement}
            if token := request.app[KEYS].stream_token(request[CALLER], sid):
                started["stream_token"] = token          # GET /v1/streams/{id}?token=
            await ws.send_str(json.dumps(started))
    except oai.APIError as e:
        raise Refused(WSCloseCode.POLICY_VIOLATION, e.message, e.body()["error"]) from None
    forward = asyncio.create_task(_forward(request, ws, reader, cfg.stream_stall_seconds))
    try:
        while not forward.done():
            receive = asyncio.ensure_future(ws.receive())
            await asyncio.wait([receive, forward], return_when=asyncio.FIRST_COMPLETED)
            if not receive.done():
                receive.cancel()
                break
            msg = _message(receive.result())
            if msg.get("type") != "cancel":
                raise Refused(WSCloseCode.POLICY_VIOLATION,
                              'after the request only {"type":"cancel"} is understood')
            # Here or on the replica that runs it (a resumed stream may live elsewhere).
            with contextlib.suppress(StreamGone):
                await streams.cancel_anywhere(sid, "WebSocket cancel", request[CALLER].key_id)
    except Refused as e:
        if e.code == WSCloseCode.OK:
            return                      # the client closed: the resume window decides
        raise
    finally:
        if not forward.done():
            forward.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await forward
    await ws.close(code=WSCloseCode.OK, message=b"done")


async def _forward(request: web.Request, ws: web.WebSocketResponse, reader,
                   stall_seconds: float) -> None:
    """The stream's events as frames; a reader blocked for `stall_seconds` is cut."""
    from .app import METRICS
    async with contextlib.aclosing(reader) as batches:
        async for batch in batches:
            try:
                for frame in _frames(batch):
                    if not await within_stall(request, ws.send_str(frame), stall_seconds):
                        request.app[METRICS].streams_cut.labels("ws").inc()
                        return
            except ConnectionResetError:
                return


async def drain(app: web.Application) -> None:
    """On shutdown: close every WebSocket with 1001 (going away), all at once; each
    waits at most WS_CLOSE_SECONDS for its client's closing frame."""
    async def close(ws) -> None:
        with contextlib.suppress(Exception):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"the edge is draining")
    await asyncio.gather(*(close(ws) for ws in list(app[SOCKETS])))
