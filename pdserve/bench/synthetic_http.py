"""The synthetic engine's HTTP face (`python -m pdserve.bench.synthetic --http-port`): in
the same process and event loop as its gRPC face, `POST /v1/completions` with `stream: true`
answered as an OpenAI server would: `max_tokens` completion chunks at the engine's rate per
stream, each chunk's text the same stamp (" <send time in µs on CLOCK_MONOTONIC>") the gRPC
face spells in token ids, then a last chunk with `finish_reason` and `data: [DONE]`. Direct
clients and nginx use this face and the edge the gRPC one, so every path in `pdserve bench
edge` starts at the same source."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from aiohttp import web

from pdserve.bench.synthetic import SyntheticEngine, stamp_text

ENGINE = web.AppKey("engine", SyntheticEngine)


async def completions(request: web.Request) -> web.StreamResponse:
    """A streamed text completion paced like `Generate`: chunk k leaves at start + k·period."""
    engine = request.app[ENGINE]
    body = await request.json()
    if not body.get("stream"):
        raise web.HTTPBadRequest(text="only stream: true is served")
    n = int(body.get("max_tokens") or 16)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    # The chunk's JSON around its text is the same every time: built once.
    envelope = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": body.get("model", engine.name),
                "choices": [{"index": 0, "text": "\0", "logprobs": None,
                             "finish_reason": None}]}
    head, tail = json.dumps(envelope, separators=(",", ":")).split("\\u0000")
    head, tail = b"data: " + head.encode(), tail.encode() + b"\n\n"
    last = dict(envelope, choices=[dict(envelope["choices"][0], text="",
                                        finish_reason="length")])
    engine.http_streams += 1
    start = time.monotonic()
    try:
        for k in range(n):
            delay = start + (k + 1) * engine.period - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await resp.write(head + stamp_text().encode() + tail)
        await resp.write(b"data: " + json.dumps(last, separators=(",", ":")).encode()
                         + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
    finally:
        engine.http_streams -= 1
    return resp


async def health(request: web.Request) -> web.Response:
    e = request.app[ENGINE]
    return web.json_response({"status": "ok", "grpc_streams": len(e.running),
                              "http_streams": e.http_streams, "chunks_sent": e.generated})


async def start_http_face(engine: SyntheticEngine, host: str, port: int) -> web.AppRunner:
    """Serve `engine`'s HTTP face on host:port; the runner to clean up when done."""
    app = web.Application()
    app[ENGINE] = engine
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=4096).start()
    return runner
