"""`/v1/responses`: OpenAI's Responses API over the chat path and the stream log.

A response is a chat generation (app.begin: admission, routing, prefill, and
underneath it migration and preemption as for any stream) whose events the
response's renderer (response_events.py) writes into a stream log named by the
response's id. So the client that asked reads that log (stream=true), a
background response runs on with no reader at all, and `GET
/v1/responses/{id}?stream=true&starting_after=N` is a reader of the same log
from after event N, on any edge replica that shares the stream store. The
Response object and the conversation live in the response store
(response_store.py); `previous_response_id` continues that conversation, under
the chain's first id as the session key, which keeps the chain on the decode
worker holding its KV. A response, like a stream, is its API key's alone:
another key is told it does not exist.
"""
from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from . import app as edge
from . import sse
from . import openai_protocol as oai
from .choices import Choice
from .response_events import ResponseRenderer, response_object
from .response_store import TERMINAL, ResponseStore, open_responses
from .responses_request import (ResponseRequest, chat_error, new_response_id,
                                parse_response_request)
from .stream_log import BadPosition, EventsGone, StreamGone

RESPONSES = web.AppKey("responses", ResponseStore)
ENDPOINT = "/v1/responses"
SETTLE_SECONDS = 5.0            # a cancel waits this long for the response's last status
_QUERY = frozenset({"stream", "starting_after"})


def _not_found(response_id: str) -> oai.APIError:
    return oai.APIError(404, f"No response found with id '{response_id}'.",
                        type="invalid_request_error", param="response_id", code="not_found")


async def _record(request: web.Request, response_id: str) -> dict:
    """The caller's record of `response_id`, else 404 (another key's too)."""
    record = await request.app[RESPONSES].get(response_id, request[edge.CALLER].key_id)
    if record is None:
        raise _not_found(response_id)
    return record


async def _history(request: web.Request, req: ResponseRequest) -> tuple[list[dict], str]:
    """The conversation `previous_response_id` continues, and the chain's session key."""
    if req.previous_response_id is None:
        return [], req.session or ""
    try:
        prev = await _record(request, req.previous_response_id)
    except oai.APIError:
        raise oai.APIError(404, f"Previous response with id '{req.previous_response_id}' "
                           "not found.", param="previous_response_id",
                           code="previous_response_not_found") from None
    if prev["response"]["status"] not in TERMINAL:
        raise oai.APIError(400, f"Previous response '{req.previous_response_id}' is still "
                           "in progress.", param="previous_response_id")
    return prev["conversation"], req.session or prev["session"]


async def create(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses`."""
    cfg = request.app[edge.CONFIG]
    req = parse_response_request(await request.read())
    owner = request[edge.CALLER].key_id
    history, session = await _history(request, req)
    rid = new_response_id()
    session = session or rid                    # a chain is keyed by its first response

    def parse(raw: bytes) -> oai.CompletionRequest:
        try:
            return oai.parse_request("chat", raw, {cfg.name})
        except oai.APIError as e:
            raise chat_error(e) from None

    chat, runs, rate_headers = await edge.begin(
        request, "chat", req.chat_body(history, session), ENDPOINT, parse)
    run = runs[0]
    renderer = _renderer(request, req, chat, run, rid, history, session, owner)
    live = request.app[edge.STREAMS].start(
        run, renderer.payloads, owner=owner, stream_id=rid, detached=req.background,
        ending=renderer.ending)
    stream = run.stream
    headers = {"x-pdserve-placement": stream.stats.placed.placement,
               "x-pdserve-worker": stream.decode_worker, "x-request-id": rid, **rate_headers}
    if req.stream:
        return await edge.stream_response(request, ENDPOINT, live, headers, plain=True,
                                          typed=True)
    if req.background:
        # Its id reaches the client only once any replica can look it up.
        await request.app[RESPONSES].stored(rid)
        return web.json_response(renderer.response, headers=headers)
    return await _whole(request, live, renderer, headers)


def _renderer(request: web.Request, req: ResponseRequest, chat: oai.CompletionRequest,
              run, rid: str, history: list[dict], session: str, owner: str
              ) -> ResponseRenderer:
    """The response's renderer; it writes the response's record as its status changes
    (nothing with `store: false`)."""
    store = request.app[RESPONSES]
    choice = Choice(0, "chat", tool_stream=request.app[edge.ENCODER].tool_stream(chat.tools),
                    tool_request=chat.tools)
    renderer: ResponseRenderer

    def save(response: dict) -> None:
        if req.store:
            turns = history + list(req.messages) + renderer.conversation()
            store.put(rid, {"owner": owner, "session": session, "background": req.background,
                            "response": response, "conversation": turns,
                            "events": renderer.seq})
    renderer = ResponseRenderer(run, response_object(rid, chat.model, req), choice, save)
    if req.store:
        store.put(rid, {"owner": owner, "session": session, "background": req.background,
                        "response": renderer.response, "conversation": [], "events": None})
    return renderer


async def _whole(request: web.Request, live, renderer: ResponseRenderer,
                 headers: dict) -> web.Response:
    """A response not streamed: wait for its end; the client leaving cancels it."""
    status, metrics = "200", request.app[edge.METRICS]
    path = live.generation.stream.path
    try:
        await asyncio.shield(live.task)
        if renderer.error is not None:
            status = str(renderer.error.status)
            return edge.error_response(renderer.error, headers)
        return web.json_response(renderer.response, headers=headers | {"x-pdserve-path": path})
    except (asyncio.CancelledError, ConnectionResetError):
        status = "499"
        request.app[edge.STREAMS].cancel(live.stream_id, "the client went away")
        raise
    finally:
        metrics.requests.labels(ENDPOINT, path, status).inc()


def _starting_after(request: web.Request) -> int | None:
    for key in request.query:
        if key not in _QUERY:
            raise oai.APIError(400, f"'{key}' is not a supported query parameter here",
                               param=key)
    raw = request.query.get("starting_after")
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 18:
        raise oai.APIError(400, f"'starting_after' must be a non-negative event number, got "
                           f"{raw[:40]!r}", param="starting_after")
    return int(raw)


def _streamed(request: web.Request) -> bool:
    value = request.query.get("stream", "false").lower()
    if value not in ("true", "false"):
        raise oai.APIError(400, "'stream' must be true or false", param="stream")
    return value == "true"


async def retrieve(request: web.Request) -> web.StreamResponse:
    """`GET /v1/responses/{id}`: the Response, or with stream=true its events after
    `starting_after` (from the first), then live."""
    rid = request.match_info["response_id"]
    after, streamed = _starting_after(request), _streamed(request)
    record = await _record(request, rid)
    if not streamed:
        if after is not None:
            raise oai.APIError(400, "'starting_after' needs stream=true", param="starting_after")
        return web.json_response(record["response"])
    events = record.get("events")
    if after is not None and events is not None and after >= events:
        raise oai.APIError(400, f"the response has events 0 to {events - 1}; cannot resume "
                           f"after {after}", param="starting_after")
    reader = await _reader(request, rid, 0 if after is None else after + 1)
    request.app[edge.METRICS].stream_resumes.labels("sse").inc()
    return await sse.relay(request, reader, {"x-request-id": rid},
                           stall_seconds=request.app[edge.CONFIG].stream_stall_seconds,
                           plain=True, typed=True)


async def _reader(request: web.Request, rid: str, after: int):
    """A reader of the response's log after event `after`. The record says the response
    exists; its log may still be on its way into the shared store (mirrored after the
    events went out on the replica that runs it): wait a moment for it."""
    deadline = asyncio.get_running_loop().time() + SETTLE_SECONDS
    while True:
        try:
            return await request.app[edge.STREAMS].read(rid, after, None,
                                                        request[edge.CALLER].key_id)
        except StreamGone:
            if asyncio.get_running_loop().time() > deadline:
                raise oai.APIError(404, f"the events of response '{rid}' are no longer kept",
                                   type="invalid_request_error", param="response_id",
                                   code="events_gone") from None
        except (EventsGone, BadPosition) as e:
            raise oai.APIError(400, str(e).replace("event", "sequence number"),
                               param="starting_after") from None
        await asyncio.sleep(0.05)


async def _settled(request: web.Request, rid: str) -> dict:
    """The record once its status is final (or as it is after SETTLE_SECONDS)."""
    deadline = asyncio.get_running_loop().time() + SETTLE_SECONDS
    while True:
        record = await _record(request, rid)
        if record["response"]["status"] in TERMINAL or \
                asyncio.get_running_loop().time() > deadline:
            return record
        await asyncio.sleep(0.05)


async def _stop(request: web.Request, rid: str, why: str) -> dict:
    """Cancel the response wherever it runs; its record once settled."""
    with contextlib.suppress(StreamGone):            # its log expired: it is over
        await request.app[edge.STREAMS].cancel_anywhere(rid, why, request[edge.CALLER].key_id)
    return await _settled(request, rid)


async def cancel(request: web.Request) -> web.Response:
    """`POST /v1/responses/{id}/cancel`: stop a background response; its Response."""
    rid = request.match_info["response_id"]
    record = await _record(request, rid)
    if not record["background"]:
        raise oai.APIError(400, "Only responses created with background=true can be "
                           "cancelled.", param="response_id")
    if record["response"]["status"] not in TERMINAL:
        record = await _stop(request, rid, "POST /v1/responses/{id}/cancel")
    return web.json_response(record["response"])


async def delete(request: web.Request) -> web.Response:
    """`DELETE /v1/responses/{id}`: forget it (a running one is cancelled first)."""
    rid = request.match_info["response_id"]
    record = await _record(request, rid)
    if record["response"]["status"] not in TERMINAL:
        await _stop(request, rid, "DELETE /v1/responses/{id}")
    await request.app[RESPONSES].delete(rid, request[edge.CALLER].key_id)
    return web.json_response({"id": rid, "object": "response", "deleted": True})


def add_routes(app: web.Application) -> None:
    """Serve /v1/responses on `app`, with a response store beside its stream store."""
    app[RESPONSES] = open_responses(app[edge.CONFIG])

    async def close(app: web.Application) -> None:
        await app[RESPONSES].close()
    app.on_cleanup.append(close)
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel)
    app.router.add_delete("/v1/responses/{response_id}", delete)
