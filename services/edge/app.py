"""The edge's HTTP surface: OpenAI-compatible routes, SSE streaming, health, metrics.

Handlers validate and tokenize, let the orchestrator place the request, then
relay the decode worker's chunks. Every error a client sees is OpenAI-shaped
JSON (mapped in `_errors`); once an SSE stream has started, an error becomes
one `data: {"error": ...}` event followed by `[DONE]`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.config import EdgeConfig
from pdserve.v1 import common_pb2

from . import openai_protocol as oai
from .metrics import EdgeMetrics
from .orchestrator import Generation, GenerationStream, Orchestrator
from .prompts import PromptEncoder

log = logging.getLogger("pdserve.edge")

CONFIG = web.AppKey("config", EdgeConfig)
ORCH = web.AppKey("orchestrator", Orchestrator)
ENCODER = web.AppKey("encoder", PromptEncoder)
METRICS = web.AppKey("metrics", EdgeMetrics)
_ENDPOINT = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def _error_response(e: oai.APIError, headers: dict | None = None) -> web.Response:
    if e.status in (429, 503):
        # Overload and "no worker serves" pass; clients back off instead of hammering.
        headers = {**(headers or {}), "Retry-After": "1"}
    return web.json_response(e.body(), status=e.status, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler):
    """Map every failure to OpenAI-shaped JSON; nothing escapes as an HTML page."""
    try:
        return await handler(request)
    except oai.APIError as e:
        return _error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return _error_response(oai.APIError(e.status, e.reason, type=kind))


def _sampling(s: oai.SamplingOptions, max_tokens: int) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=max_tokens,
        stop=list(s.stop), ignore_eos=s.ignore_eos, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty)
    if s.seed is not None:
        p.seed = s.seed
    return p


def _session_key(request: web.Request, req: oai.CompletionRequest) -> str:
    """What keeps a conversation on one decode worker: the `x-session-id` header, else
    the body's `session_id`, else OpenAI's `user` (a user's turns share their history)."""
    header = request.headers.get("x-session-id", "").strip()
    if len(header) > 256:
        raise oai.APIError(400, "x-session-id must be at most 256 characters",
                           param="x-session-id")
    return header or req.session_id or req.user or ""


async def _completion(request: web.Request, kind: oai.Kind) -> web.StreamResponse:
    cfg, orch, metrics = request.app[CONFIG], request.app[ORCH], request.app[METRICS]
    started = time.perf_counter()
    rid = oai.completion_id(kind)
    try:
        req = oai.parse_request(kind, await request.read(), {cfg.name})
        ids = request.app[ENCODER].encode(req)
        max_tokens = oai.check_context(len(ids), req.sampling.max_tokens, cfg.max_model_len)
        stream = await orch.start(Generation(request_id=rid, model=cfg.name, prompt_token_ids=ids,
                                             sampling=_sampling(req.sampling, max_tokens),
                                             session_id=_session_key(request, req)))
    except oai.APIError as e:
        metrics.requests.labels(_ENDPOINT[kind], "none", str(e.status)).inc()
        raise
    if stream.stats.get("prefill_fallback"):
        metrics.prefill_fallbacks.labels(cfg.name).inc()
    metrics.prompt_tokens.labels(cfg.name).inc(len(ids))
    metrics.placements.labels(cfg.name, stream.stats["placement"]).inc()
    # x-pdserve-path is set when the response starts: the decode's first output can
    # still turn a disaggregated request local (see GenerationStream._first_chunk).
    headers = {"x-pdserve-placement": stream.stats["placement"],
               "x-pdserve-worker": stream.decode_worker, "x-request-id": rid}
    metrics.running.labels(cfg.name).inc()
    status = "200"
    try:
        relay = _relay_sse if req.stream else _relay_json
        return await relay(request, req, stream, headers)
    except oai.APIError as e:
        status = str(e.status)
        return _error_response(e, headers | {"x-pdserve-path": stream.path})
    except (asyncio.CancelledError, ConnectionResetError):
        status = "499"  # the client went away; leaving here cancels the decode call
        raise
    finally:
        stream.close()                  # a lease the decode never pulled ends now
        if stream.stats.get("pull_refused"):
            metrics.prefill_fallbacks.labels(cfg.name).inc()
        metrics.running.labels(cfg.name).dec()
        metrics.requests.labels(_ENDPOINT[kind], stream.path, status).inc()
        metrics.generation_tokens.labels(cfg.name).inc(stream.completion_tokens)
        metrics.kv_external_tokens.labels(cfg.name).inc(stream.stats.get("decode_external_tokens", 0))
        metrics.e2e.labels(cfg.name, stream.path).observe(time.perf_counter() - started)
        if stream.first_token_at is not None:
            metrics.ttft.labels(cfg.name, stream.path).observe(stream.first_token_at - started)
        log.info("request %s done: path=%s prompt=%d completion=%d status=%s %.0f ms", rid,
                 stream.path, len(ids), stream.completion_tokens, status,
                 (time.perf_counter() - started) * 1000)


async def _relay_json(request, req: oai.CompletionRequest, stream: GenerationStream,
                      headers) -> web.Response:
    texts = []
    async with contextlib.aclosing(stream.chunks()) as chunks:
        async for chunk in chunks:
            texts.append(chunk.text)
    created, text = int(time.time()), "".join(texts)
    build = oai.chat_response if req.kind == "chat" else oai.completion_response
    body = build(stream.gen.request_id, req.model, created, text, stream.finish_reason or "stop",
                 len(stream.gen.prompt_token_ids), stream.completion_tokens)
    return web.json_response(body, headers=headers | {"x-pdserve-path": stream.path})


async def _relay_sse(request, req: oai.CompletionRequest, stream: GenerationStream,
                     headers) -> web.StreamResponse:
    resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    rid, model, created = stream.gen.request_id, req.model, int(time.time())

    async def write(data: bytes) -> None:
        # The response starts with the first output, when the path is known; an
        # error before it is an ordinary HTTP error, not an event in a 200 stream.
        if not resp.prepared:
            resp.headers["x-pdserve-path"] = stream.path
            await resp.prepare(request)
        await resp.write(data)

    def event(text: str | None = None, finish: str | None = None) -> bytes:
        if req.kind == "chat":
            data = oai.chat_chunk(rid, model, created, content=text, finish_reason=finish)
        else:
            data = oai.completion_chunk(rid, model, created, text=text or "", finish_reason=finish)
        return oai.sse_event(data)

    # Chat opens with the assistant's role. It goes out with the first text, as
    # vLLM's server sends it (with its first output), not before: an empty
    # event ahead of the first token would only make the stream look faster
    # to a client that times its first event.
    opening = (oai.sse_event(oai.chat_chunk(rid, model, created, role="assistant", content=""))
               if req.kind == "chat" else b"")
    try:
        async with contextlib.aclosing(stream.chunks()) as chunks:
            async for chunk in chunks:
                if chunk.text:
                    await write(opening + event(chunk.text))
                    opening = b""
        if opening:
            await write(opening)                        # no text at all: still a role
        await write(event(None if req.kind == "chat" else "",
                          finish=stream.finish_reason or "stop"))
        if req.include_usage:
            await write(oai.sse_event(oai.usage_chunk(
                req.kind, rid, model, created, len(stream.gen.prompt_token_ids),
                stream.completion_tokens)))
    except oai.APIError as e:
        if not resp.prepared:
            raise
        # Headers are gone already: the error travels inside the stream.
        await resp.write(oai.sse_event(e.body()))
    await resp.write(oai.sse_event("[DONE]"))
    await resp.write_eof()
    return resp


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
    """200 only when the router answers and every worker it knows is serving."""
    cfg = request.app[CONFIG]
    try:
        workers = await request.app[ORCH].workers()
    except grpc.aio.AioRpcError as e:
        return web.json_response({"status": "unavailable", "reason": f"router: {e.code().name}"},
                                 status=503)
    listed = [{"worker_id": w.worker_id, "role": common_pb2.WorkerRole.Name(w.role),
               "address": w.address, "serving": w.serving} for w in workers]
    serving = {r: sum(1 for w in workers if w.serving and w.role == r)
               for r in (common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE)}
    ok = (all(w.serving for w in workers)
          and serving[common_pb2.WORKER_ROLE_PREFILL] >= cfg.min_prefill_workers
          and serving[common_pb2.WORKER_ROLE_DECODE] >= cfg.min_decode_workers)
    return web.json_response({"status": "ok" if ok else "unavailable", "workers": listed},
                             status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(cfg: EdgeConfig, orchestrator: Orchestrator, encoder: PromptEncoder) -> web.Application:
    """The aiohttp application; the caller owns the orchestrator's lifetime."""
    app = web.Application(middlewares=[_errors])
    app[CONFIG], app[ORCH], app[ENCODER], app[METRICS] = cfg, orchestrator, encoder, EdgeMetrics()
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
