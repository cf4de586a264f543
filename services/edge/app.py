"""The edge's HTTP surface: OpenAI-compatible routes, streams, health, metrics.

Handlers validate and tokenize, let the orchestrator place the request, then
either relay the decode worker's chunks as one JSON response, or hand the
generation to its stream (streams.py) and read that stream as SSE, like any
other reader (`GET /v1/streams/{id}`, the WebSocket in websocket.py). Every
error a client sees is OpenAI-shaped JSON (mapped in `_errors`); once an SSE
stream has started, an error becomes one `data: {"error": ...}` event followed
by `[DONE]`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
import weakref

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pdserve import telemetry
from pdserve.config import EdgeConfig
from pdserve.v1 import common_pb2, router_pb2

from . import openai_protocol as oai
from .metrics import EdgeMetrics
from . import sse, websocket
from .admission import Admission, pool_capacity
from .admitted import AdmittedGeneration, admit
from .choices import Choice
from .events import Renderer
from .keys import APIKey, KeyRing
from .openapi import SPEC
from .limits import RateLimits
from .generation import Generation
from .orchestrator import Orchestrator
from .picker_series import PickerSeries
from .pool_view import PoolView
from .prompts import PromptEncoder
from .stream_log import BadPosition, EventsGone, StreamGone
from .streams import LiveStream, Streams, open_store
from .tenant_salt import TenantSalts, tenant_salts
from .tokenize import handlers as tokenize_handlers

log = logging.getLogger("pdserve.edge")

CONFIG = web.AppKey("config", EdgeConfig)
ORCH = web.AppKey("orchestrator", Orchestrator)
ENCODER = web.AppKey("encoder", PromptEncoder)
METRICS = web.AppKey("metrics", EdgeMetrics)
ROUTER_METRICS = web.AppKey("router_metrics", object)     # CollectorRegistry | None
STREAMS = web.AppKey("streams", Streams)
KEYS = web.AppKey("keys", KeyRing)
CALLER = web.RequestKey("caller", APIKey)       # the key a /v1/ request came with
LIMITS = web.AppKey("limits", RateLimits)
SALTS = web.AppKey("salts", TenantSalts)
ADMISSION = web.AppKey("admission", Admission)
POOL = web.AppKey("pool", PoolView)             # the last reading of the router's workers
PICKER = web.AppKey("picker", PickerSeries)     # what an InferencePool's picker scores
STREAM_ID = "x-pdserve-stream-id"
STREAM_TOKEN = "x-pdserve-stream-token"    # reads that stream without the key (keys.py)
TIMEOUT_HEADER = "x-pdserve-timeout-ms"
QUEUE_HEADER = "x-pdserve-queue-ms"         # how long admission held the request back
POOL_READ_SECONDS = (1.0, 0.1)      # admission's readings: a lone idle edge; shared or waiting
_ENDPOINT = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def error_response(e: oai.APIError, headers: dict | None = None) -> web.Response:
    headers = {**(headers or {}), **e.headers}
    if e.status in (429, 503):
        # Overload and "no worker serves" pass; clients back off instead of hammering.
        headers.setdefault("Retry-After", "1")
    return web.json_response(e.body(), status=e.status, headers=headers)


@web.middleware
async def _authenticate(request: web.Request, handler):
    """Every /v1/ route (HTTP, WebSocket, streams) and /tokenize, /detokenize need a
    configured key; /health, /metrics and /openapi.json do not. The key found is
    request[CALLER]. Following a stream (GET /v1/streams/{id}) may instead present that
    stream's read token as `?token=`, for clients that cannot send headers (EventSource)."""
    if request.path.startswith(("/v1/", "/tokenize", "/detokenize")):
        header = request.headers.get("Authorization")
        key = request.app[KEYS].from_header(header)
        token = request.query.get("token") if request.match_info.handler is follow_stream else None
        if key is None and header is None and token is not None:
            key = request.app[KEYS].from_stream_token(token, request.match_info["stream_id"])
            if key is None:
                raise oai.APIError(401, "The stream token is not valid for this stream.",
                                   param="token", code="invalid_stream_token")
        if key is None:
            message = ("Incorrect API key provided." if header else
                       "You didn't provide an API key. Send it as `Authorization: Bearer KEY`.")
            raise oai.APIError(401, message, code="invalid_api_key")
        request[CALLER] = key
    return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler):
    """Map every failure to OpenAI-shaped JSON; nothing escapes as an HTML page."""
    try:
        return await handler(request)
    except oai.APIError as e:
        return error_response(e)
    except web.HTTPRequestEntityTooLarge:
        return error_response(oai.APIError(
            413, f"the request body is over {request.app[CONFIG].max_request_bytes} bytes",
            code="request_too_large"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return error_response(oai.APIError(e.status, e.reason, type=kind))


def _sampling(req: oai.CompletionRequest, max_tokens: int, index: int = 0
              ) -> common_pb2.SamplingParams:
    """Choice `index`'s engine sampling: a seed goes up by one per choice, as vLLM's
    children of an n > 1 request get theirs."""
    s = req.sampling
    p = common_pb2.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=max_tokens,
        stop=list(s.stop), ignore_eos=s.ignore_eos, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty,
        min_p=s.min_p, min_tokens=s.min_tokens, logit_bias=dict(s.logit_bias),
        stop_token_ids=list(s.stop_token_ids),
        include_stop_str_in_output=s.include_stop_str_in_output)
    if s.seed is not None:
        p.seed = (s.seed + index + 2**63) % 2**64 - 2**63     # int64, as the field is
    # Completions show one alternative more than asked (choices.py): ask the engine for it.
    more = int(req.kind == "completion")
    if s.logprobs is not None:
        p.logprobs = s.logprobs + more
    if s.prompt_logprobs is not None:
        p.prompt_logprobs = s.prompt_logprobs + more
    if s.constraint is not None:
        kind, value = s.constraint
        if kind == "choice":
            p.choice.choices.extend(value)
        else:
            setattr(p, kind, value)
    return p


def _session_key(request: web.Request, req: oai.CompletionRequest) -> str:
    """What keeps a conversation on one decode worker: the `x-session-id` header, else
    the body's `session_id`, else OpenAI's `user` (a user's turns share their history)."""
    header = request.headers.get("x-session-id", "").strip()
    if len(header) > 256:
        raise oai.APIError(400, "x-session-id must be at most 256 characters",
                           param="x-session-id")
    return header or req.session_id or req.user or ""


def _budget(request: web.Request, cfg: EdgeConfig) -> float:
    """The request's time budget in seconds: the `x-pdserve-timeout-ms` header, at most
    the edge's request timeout. Every hop's gRPC deadline comes from it."""
    raw = request.headers.get(TIMEOUT_HEADER, "").strip()
    if not raw:
        return cfg.request_timeout_seconds
    if not raw.isdigit() or not 0 < int(raw) < 10**9:
        raise oai.APIError(400, f"{TIMEOUT_HEADER} must be a positive number of "
                           f"milliseconds, got {raw[:40]!r}", param=TIMEOUT_HEADER)
    return min(int(raw) / 1000, cfg.request_timeout_seconds)


async def begin(request: web.Request, kind: oai.Kind, raw: bytes, endpoint: str = "",
                parse=None) -> tuple[oai.CompletionRequest, list[AdmittedGeneration], dict]:
    """Validate, tokenize, route and prefill one request (HTTP or WebSocket): a
    generation per choice (`n`), and the rate limits' headers; raises APIError
    (counted under `endpoint`, default the kind's) when it cannot start. `parse(raw)`:
    the request's own parser (default: the kind's OpenAI request)."""
    cfg, metrics = request.app[CONFIG], request.app[METRICS]
    started = time.perf_counter()
    rid = oai.completion_id(kind)
    runs: list[AdmittedGeneration] = []
    try:
        deadline = time.monotonic() + _budget(request, cfg)
        req = parse(raw) if parse else oai.parse_request(kind, raw, {cfg.name})
        keep = req.truncate_prompt_tokens
        ids = request.app[ENCODER].encode(req, cfg.max_model_len if keep == -1 else keep)
        max_tokens = oai.check_context(len(ids), req.sampling.max_tokens, cfg.max_model_len)
        rate_headers = request.app[LIMITS].take(request[CALLER],
                                                len(ids) + req.n * max_tokens)
        for index in range(req.n):
            gen = Generation(request_id=rid if index == 0 else f"{rid}-{index}", model=cfg.name,
                             prompt_token_ids=ids, sampling=_sampling(req, max_tokens, index),
                             session_id=_session_key(request, req), deadline=deadline,
                             kind=kind, client_salt=req.cache_salt)
            runs.append(await place(request.app, request[CALLER], gen, started))
    except BaseException as e:
        for run in runs:                    # choices placed before one failed
            _generation_ended(request.app, run)
        if isinstance(e, oai.APIError):
            metrics.requests.labels(endpoint or _ENDPOINT[kind], "none", str(e.status)).inc()
        raise
    return req, runs, rate_headers


async def place(app: web.Application, key: APIKey, gen: Generation, started: float
                ) -> AdmittedGeneration:
    """Wait for room in the pool, then route and prefill; counted from here on
    (HTTP, WebSocket and Inference gRPC alike) until `_generation_ended`."""
    # Salted here, where every door's requests pass with their caller's key.
    gen.cache_salt = app[SALTS].salt(key.tenant, gen.client_salt, gen.prompt_token_ids)
    run = await admit(app[ADMISSION], app[ORCH], key, gen, started)
    run.count_start(app[METRICS], app[CONFIG].name)
    return run


def _renderer(app: web.Application, req: oai.CompletionRequest,
              runs: list[AdmittedGeneration]) -> Renderer:
    """How the request's choices render (choices.py)."""
    encoder = app[ENCODER]
    tokens = encoder.token_text if req.sampling.logprobs is not None else None
    echo = None
    if req.echo:
        echo = (req.prompt if isinstance(req.prompt, str)
                else encoder.tokenizer.decode(list(req.prompt)))
    choices = [Choice(i, req.kind, tokens=tokens, logprobs=req.sampling.logprobs, echo=echo,
                      tool_stream=encoder.tool_stream(req.tools), tool_request=req.tools)
               for i in range(len(runs))]
    return Renderer(req.kind, req.include_usage, runs, req.model, choices,
                    on_choice_end=lambda run: _generation_ended(app, run))


def start_stream(request: web.Request, req: oai.CompletionRequest,
                 runs: list[AdmittedGeneration]) -> LiveStream:
    """Hand the generation to its stream: from now on it runs for the stream's
    readers, not for one connection."""
    renderer = _renderer(request.app, req, runs)
    one = len(runs) == 1
    # One choice's steady outputs may go to the log from the call that read them.
    live = request.app[STREAMS].start(
        runs[0], lambda append: renderer.payloads(append if one else None),
        owner=request[CALLER].key_id)
    if not one:
        live.task.add_done_callback(lambda task: renderer.end_choices())
    return live


def _plain_framing(request: web.Request) -> bool:
    """Whether a POST's stream goes out in OpenAI's framing (the default) or the
    resumable one (`x-pdserve-sse: resumable`; sse.py)."""
    framing = request.headers.get(sse.FRAMING_HEADER, "plain").strip().lower()
    if framing not in sse.FRAMINGS:
        raise oai.APIError(400, f"{sse.FRAMING_HEADER} must be one of {list(sse.FRAMINGS)}, "
                           f"got {framing[:40]!r}", param=sse.FRAMING_HEADER)
    return framing == "plain"


async def _completion(request: web.Request, kind: oai.Kind) -> web.StreamResponse:
    plain = _plain_framing(request)
    req, runs, rate_headers = await begin(request, kind, await request.read())
    run = runs[0]
    stream, metrics = run.stream, request.app[METRICS]
    # x-pdserve-path is set when the response starts: the decode's first output can
    # still turn a disaggregated request local (see LegCall._first_output).
    headers = {"x-pdserve-placement": stream.stats.placed.placement,
               "x-pdserve-worker": stream.decode_worker, "x-request-id": stream.gen.request_id,
               QUEUE_HEADER: f"{run.ticket.waited * 1000:.1f}", **rate_headers}
    if req.stream:
        return await stream_response(request, _ENDPOINT[kind],
                                      start_stream(request, req, runs), headers, plain)
    status = "200"
    try:
        body = await _renderer(request.app, req, runs).response()
        return web.json_response(body, headers=headers | {"x-pdserve-path": stream.path})
    except oai.APIError as e:
        status = str(e.status)
        return error_response(e, headers | {"x-pdserve-path": stream.path})
    except (asyncio.CancelledError, ConnectionResetError):
        status = "499"  # the client went away; leaving here cancels the decode call
        raise
    finally:
        metrics.requests.labels(_ENDPOINT[kind], stream.path, status).inc()
        _generation_ended(request.app, run)


def _generation_ended(app: web.Application, run: AdmittedGeneration) -> None:
    """Count a generation once it is over (streamed or not, read or abandoned)."""
    run.end(app[METRICS], app[CONFIG].name)


async def stream_response(request: web.Request, endpoint: str, live: LiveStream,
                           headers: dict, plain: bool, typed: bool = False
                           ) -> web.StreamResponse:
    """The client that asked reads its stream from the start, as SSE (`plain`:
    OpenAI's framing, else the resumable one; `typed`: the Responses API's)."""
    metrics, status = request.app[METRICS], "200"
    stream = live.generation.stream
    span = telemetry.span("stream", parent=stream.span, attributes={
        "pdserve.stream.id": live.stream_id, "pdserve.transport": "sse"})
    try:
        cfg = request.app[CONFIG]
        reader = await request.app[STREAMS].read(
            live.stream_id, 0, None if plain else cfg.sse_keepalive_seconds, live.owner)
        headers = headers | {STREAM_ID: live.stream_id}
        if token := request.app[KEYS].stream_token(request[CALLER], live.stream_id):
            headers[STREAM_TOKEN] = token
        return await sse.relay(request, reader, headers,
                               stall_seconds=cfg.stream_stall_seconds, live=live,
                               on_cut=metrics.streams_cut.labels("sse").inc, plain=plain,
                               typed=typed)
    except oai.APIError as e:
        status = str(e.status)
        return error_response(e, headers | {"x-pdserve-path": stream.path})
    except (asyncio.CancelledError, ConnectionResetError):
        status = "499"  # gone; the generation waits a while for it to resume
        raise
    finally:
        metrics.requests.labels(endpoint, stream.path, status).inc()
        telemetry.end(span, None if status == "200" else f"HTTP {status}",
                      http__response__status_code=int(status))


def _last_event_id(request: web.Request) -> int:
    """Where a reader resumes: the `Last-Event-ID` header (as EventSource sends it),
    else the `last_event_id` query parameter; 0 = from the start."""
    raw = request.headers.get("Last-Event-ID", request.query.get("last_event_id", "0")).strip()
    if not raw.isdigit() or len(raw) > 18:
        raise oai.APIError(400, f"Last-Event-ID must be an event number, got {raw[:40]!r}",
                           param="Last-Event-ID")
    return int(raw)


def stream_errors(e: Exception) -> oai.APIError:
    """A reader that cannot start, as the error its client sees."""
    if isinstance(e, StreamGone):
        return oai.APIError(404, str(e), type="not_found_error", code="stream_not_found")
    if isinstance(e, EventsGone):
        return oai.APIError(410, str(e), param="Last-Event-ID", code="events_gone")
    return oai.APIError(400, str(e), param="Last-Event-ID", code="bad_position")


async def follow_stream(request: web.Request) -> web.StreamResponse:
    """`GET /v1/streams/{id}`: the stream's events after `Last-Event-ID`, then live."""
    cfg, metrics = request.app[CONFIG], request.app[METRICS]
    sid, after = request.match_info["stream_id"], _last_event_id(request)
    try:
        reader = await request.app[STREAMS].read(sid, after, cfg.sse_keepalive_seconds,
                                                 request[CALLER].key_id)
    except (StreamGone, EventsGone, BadPosition) as e:
        raise stream_errors(e) from None
    metrics.stream_resumes.labels("sse").inc()
    return await sse.relay(request, reader, {STREAM_ID: sid},
                           stall_seconds=cfg.stream_stall_seconds,
                           on_cut=metrics.streams_cut.labels("sse").inc)


async def cancel_stream(request: web.Request) -> web.Response:
    """`DELETE /v1/streams/{id}`: stop the generation now (its KV is freed)."""
    sid = request.match_info["stream_id"]
    try:
        cancelled = await request.app[STREAMS].cancel_anywhere(sid, "DELETE /v1/streams",
                                                               request[CALLER].key_id)
    except StreamGone as e:
        raise stream_errors(e) from None
    return web.json_response({"id": sid, "object": "stream", "cancelled": cancelled,
                              "finished": not cancelled})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "completion")


async def models(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    return web.json_response({"object": "list", "data": [{
        "id": cfg.name, "object": "model", "created": int(time.time()), "owned_by": "pdserve",
        "root": cfg.model, "parent": None, "max_model_len": cfg.max_model_len}]})


async def health(request: web.Request) -> web.Response:
    """From the edge's last reading of the pool, never a call to the router
    (pool_view.py): 503 while draining or short of workers."""
    cfg = request.app[CONFIG]
    if request.app[ADMISSION].draining:
        return web.json_response({"status": "draining"}, status=503)
    status, body = request.app[POOL].readiness(cfg.min_prefill_workers, cfg.min_decode_workers)
    return web.json_response(body, status=status)


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(SPEC)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    if request.app[ROUTER_METRICS] is not None:
        body += generate_latest(request.app[ROUTER_METRICS])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _read_pool(app: web.Application):
    """Keep the edge's view of the pool fresh (what /health answers from), and
    admission's: its capacity, and what the other edge replicas hold of it (each
    reading reports this edge's own counts to the router; services/router/edges.py).
    10 readings a second while requests wait for room here, or while other edges
    share the pool (what one admits or frees reaches the others within two
    readings); one a second otherwise. The first is taken before the edge serves."""
    admission, view = app[ADMISSION], app[POOL]
    edge_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    pool = router_pb2.ListWorkersResponse()

    async def read_once() -> None:
        nonlocal pool
        try:
            pool = await app[ORCH].pool(edge_id, admission.in_flight)
        except grpc.aio.AioRpcError as e:
            view.failed(e.code().name)  # the router is away: the view stands meanwhile
            return
        view.observe(pool.workers)
        app[PICKER].update(admission.queued, admission.in_flight, pool.workers)
        if app[CONFIG].admission:
            admission.observe(pool_capacity(pool.workers, common_pb2.WORKER_ROLE_DECODE),
                              pool.admitted_elsewhere)

    async def read() -> None:
        while True:
            shared = admission.queued or pool.edges > 1
            await asyncio.sleep(POOL_READ_SECONDS[bool(shared)])
            await read_once()

    await read_once()
    task = asyncio.create_task(read(), name="pool-view")
    yield
    task.cancel()


def build_app(cfg: EdgeConfig, orchestrator: Orchestrator, encoder: PromptEncoder,
              router_metrics: CollectorRegistry | None = None) -> web.Application:
    """The aiohttp application; the caller owns the orchestrator's lifetime.
    `router_metrics`: an embedded router's series, served on /metrics beside the edge's."""
    telemetry.instrument_http()
    app = web.Application(middlewares=[_errors, _authenticate],
                          client_max_size=cfg.max_request_bytes)
    app[CONFIG], app[ORCH], app[ENCODER] = cfg, orchestrator, encoder
    app[METRICS] = EdgeMetrics(cfg.name)
    app[ROUTER_METRICS] = router_metrics
    app[KEYS], app[LIMITS] = KeyRing.load(cfg.api_keys_file), RateLimits()
    app[SALTS] = tenant_salts(cfg, app[KEYS].open, encoder)
    app[ADMISSION] = Admission(cfg, app[METRICS])
    app[POOL] = PoolView()
    app[PICKER] = PickerSeries(app[METRICS].registry, cfg.name)
    app.cleanup_ctx.append(_read_pool)

    def ended(live: LiveStream) -> None:
        app[METRICS].streams_open.dec()
        app[METRICS].streams_ended.labels(live.ended).inc()
        _generation_ended(app, live.generation)

    app[STREAMS] = Streams(cfg, open_store(cfg), on_start=app[METRICS].streams_open.inc,
                           on_end=ended)
    app[websocket.SOCKETS] = weakref.WeakSet()
    app.on_shutdown.append(websocket.drain)
    app.on_cleanup.append(lambda app: app[STREAMS].close())
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/ws", websocket.handle)
    app.router.add_get("/v1/streams/{stream_id}", follow_stream)
    app.router.add_delete("/v1/streams/{stream_id}", cancel_stream)
    tokenize, detokenize = tokenize_handlers(encoder, cfg)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    if not cfg.metrics_port:            # else on a port of its own (server.py)
        app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    from . import responses_api                 # it reads this module's keys and steps
    responses_api.add_routes(app)
    return app
