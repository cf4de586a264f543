"""The internal Inference gRPC API: what the HTTP edge offers, for services.

Same validation, placement and streaming as HTTP (it shares the orchestrator
and the prompt encoder); errors are gRPC status codes instead of OpenAI JSON.
Generations run as streams (streams.py): `Generate` with `follow` reads one
by its stream id from any event on; `Abort` ends a generation by request id
or stream id, from any connection.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid

import grpc

from pdserve.config import EdgeConfig
from pdserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc

from .events import render_inference
from .keys import APIKey
from .openai_protocol import APIError, check_context
from .parameters import MAX_CACHE_SALT_BYTES
from .generation import Generation
from .prompts import PromptEncoder
from .stream_log import DONE, BadPosition, EventsGone, StreamGone

log = logging.getLogger("pdserve.edge")

_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
           429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}


_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "abort": common_pb2.FINISH_REASON_ABORT}


def _check_sampling(p: common_pb2.SamplingParams) -> None:
    if p.temperature < 0 or p.temperature > 2:
        raise APIError(400, "sampling.temperature must be in [0, 2]")
    if not 0 <= p.top_p <= 1:
        raise APIError(400, "sampling.top_p must be in [0, 1] (0 = default 1)")
    if p.top_k < 0 or p.repetition_penalty < 0:
        raise APIError(400, "sampling.top_k and sampling.repetition_penalty must be >= 0")
    for name in ("logprobs", "prompt_logprobs"):       # its chunks carry none
        if p.HasField(name):
            raise APIError(400, f"sampling.{name} is not supported by the Inference API")


def _status_of(error: dict) -> grpc.StatusCode:
    """An error event's gRPC status."""
    if error.get("code") == "stream_cancelled":
        return grpc.StatusCode.CANCELLED
    return _BY_TYPE.get(error.get("type"), grpc.StatusCode.INTERNAL)


_BY_TYPE = {"invalid_request_error": grpc.StatusCode.INVALID_ARGUMENT,
            "not_found_error": grpc.StatusCode.NOT_FOUND,
            "server_overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
            "service_unavailable": grpc.StatusCode.UNAVAILABLE}


class InferenceService(inference_pb2_grpc.InferenceServicer):
    """Generate/Abort over the same orchestration and streams the HTTP handlers use."""

    def __init__(self, cfg: EdgeConfig, encoder: PromptEncoder, app):
        self.cfg = cfg
        self.encoder = encoder
        self.app = app
        self.running: dict[str, str] = {}           # request id -> its stream id

    def _prepare(self, request: inference_pb2.GenerateRequest, context) -> Generation:
        if request.model and request.model != self.cfg.name:
            raise APIError(404, f"model {request.model!r} is not served here")
        which = request.WhichOneof("input")
        if which == "prompt":
            ids = self.encoder.encode_text(request.prompt)
        elif which == "prompt_token_ids":
            ids = self.encoder.check_ids(list(request.prompt_token_ids.ids))
        else:
            raise APIError(400, "one of prompt or prompt_token_ids is required")
        if not ids:
            raise APIError(400, "the prompt is empty")
        _check_sampling(request.sampling)
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.max_tokens = check_context(len(ids), request.sampling.max_tokens or None,
                                            self.cfg.max_model_len)
        # The caller's own gRPC deadline is the request's budget on every hop.
        left = context.time_remaining()
        budget = min(left if left is not None else float("inf"),
                     self.cfg.request_timeout_seconds)
        if len(request.cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
            raise APIError(400, f"cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes",
                           param="cache_salt")
        return Generation(request_id=request.request_id or f"inf-{uuid.uuid4().hex}",
                          model=self.cfg.name, prompt_token_ids=ids, sampling=sampling,
                          session_id=request.session_id, deadline=time.monotonic() + budget,
                          client_salt=request.cache_salt)

    async def _key(self, context) -> APIKey:
        """The caller's key, from the `authorization` metadata (`Bearer KEY`)."""
        from .app import KEYS
        header = dict(context.invocation_metadata() or ()).get("authorization")
        key = self.app[KEYS].from_header(header)
        if key is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "a valid API key is required (metadata authorization: "
                                "Bearer KEY)")
        return key

    async def Generate(self, request, context):
        from .app import LIMITS, STREAMS, place
        streams = self.app[STREAMS]
        key = await self._key(context)
        if request.HasField("follow"):
            sid = request.follow.stream_id
            try:
                reader = await streams.read(sid, request.follow.after_seq, owner=key.key_id)
            except StreamGone as e:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
            except (EventsGone, BadPosition) as e:
                await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
            async for out in self._chunks(reader, sid, "", context):
                yield out
            return
        started = time.perf_counter()
        try:
            gen = self._prepare(request, context)
            if gen.request_id in self.running:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                    f"request {gen.request_id} is already running")
            self.app[LIMITS].take(key, len(gen.prompt_token_ids) + gen.sampling.max_tokens)
            run = await place(self.app, key, gen, started)
        except APIError as e:
            # Shed at admission (503 over HTTP) is RESOURCE_EXHAUSTED here: retry later.
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if e.type == "server_overloaded"
                    else _STATUS.get(e.status, grpc.StatusCode.INTERNAL))
            await context.abort(code, e.message)
        live = streams.start(run, lambda append: render_inference(run), owner=key.key_id)
        self.running[gen.request_id] = live.stream_id
        try:
            reader = await streams.read(live.stream_id, 0, owner=key.key_id)
            async for out in self._chunks(reader, live.stream_id, gen.request_id, context):
                yield out
        finally:
            self.running.pop(gen.request_id, None)
            # The caller went away (or cancelled): stop decoding for nobody.
            streams.cancel(live.stream_id, "the Inference call ended")
        stream = run.stream
        log.info("inference %s done: path=%s completion=%d finish=%s", gen.request_id,
                 stream.path, stream.completion_tokens, stream.finish_reason)

    async def _chunks(self, reader, stream_id: str, request_id: str, context):
        """The stream's events as GenerateChunks; an error event ends the call with
        its status."""
        async with contextlib.aclosing(reader) as batches:
            async for batch in batches:
                for event in batch:
                    if event.data == DONE:
                        return
                    obj = json.loads(event.data)
                    if "error" in obj:
                        await context.abort(_status_of(obj["error"]), obj["error"]["message"])
                    if "inference" not in obj:
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                            "this stream was started over HTTP: follow it "
                                            f"with GET /v1/streams/{stream_id}")
                    c = obj["inference"]
                    out = inference_pb2.GenerateChunk(
                        request_id=request_id, token_ids=c["token_ids"], text=c["text"],
                        path=c["path"], stream_id=stream_id, seq=event.seq)
                    if c.get("finish_reason"):
                        out.finish_reason = _FINISH.get(c["finish_reason"],
                                                        common_pb2.FINISH_REASON_ABORT)
                        out.prompt_tokens = c["prompt_tokens"]
                        out.completion_tokens = c["completion_tokens"]
                    yield out

    async def Abort(self, request, context):
        from .app import STREAMS
        streams = self.app[STREAMS]
        key = await self._key(context)
        sid = request.stream_id or self.running.get(request.request_id, "")
        try:
            found = bool(sid) and await streams.cancel_anywhere(sid, "Inference Abort",
                                                                key.key_id)
        except StreamGone:
            found = False
        return inference_pb2.AbortResponse(found=found)
