"""The internal Inference gRPC API: what the HTTP edge offers, for services.

Same validation, placement and streaming as HTTP (it shares the orchestrator
and the prompt encoder); errors are gRPC status codes instead of OpenAI JSON.
`Abort` ends an in-flight `Generate` by request id, from any connection.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

import grpc

from pdserve.config import EdgeConfig
from pdserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc

from .openai_protocol import APIError, check_context
from .orchestrator import Generation, Orchestrator
from .prompts import PromptEncoder

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


class InferenceService(inference_pb2_grpc.InferenceServicer):
    """Generate/Abort over the same orchestration the HTTP handlers use."""

    def __init__(self, cfg: EdgeConfig, orchestrator: Orchestrator, encoder: PromptEncoder):
        self.cfg = cfg
        self.orchestrator = orchestrator
        self.encoder = encoder
        self.running: dict[str, asyncio.Task] = {}

    def _prepare(self, request: inference_pb2.GenerateRequest) -> Generation:
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
        return Generation(request_id=request.request_id or f"inf-{uuid.uuid4().hex}",
                          model=self.cfg.name, prompt_token_ids=ids, sampling=sampling,
                          session_id=request.session_id)

    async def Generate(self, request, context):
        try:
            gen = self._prepare(request)
            if gen.request_id in self.running:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                    f"request {gen.request_id} is already running")
            stream = await self.orchestrator.start(gen)
        except APIError as e:
            await context.abort(_STATUS.get(e.status, grpc.StatusCode.INTERNAL), e.message)
        # The decode stream is pumped by its own task so that Abort, arriving on
        # another call, can cancel it; the finished task itself marks the end.
        queue: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            async with contextlib.aclosing(stream.chunks()) as chunks:
                async for chunk in chunks:
                    queue.put_nowait(chunk)

        task = asyncio.create_task(pump(), name=f"generate-{gen.request_id}")
        task.add_done_callback(queue.put_nowait)
        self.running[gen.request_id] = task
        try:
            while not isinstance(item := await queue.get(), asyncio.Task):
                out = inference_pb2.GenerateChunk(request_id=gen.request_id,
                                                  token_ids=item.token_ids, text=item.text,
                                                  path=stream.path)
                if item.finish_reason:
                    out.finish_reason = _FINISH.get(item.finish_reason,
                                                    common_pb2.FINISH_REASON_ABORT)
                    out.prompt_tokens = len(gen.prompt_token_ids)
                    out.completion_tokens = stream.completion_tokens
                yield out
        finally:
            task.cancel()  # the caller went away: stop decoding for nobody
            self.running.pop(gen.request_id, None)
        log.info("inference %s done: path=%s completion=%d finish=%s", gen.request_id,
                 stream.path, stream.completion_tokens, stream.finish_reason)
        if item.cancelled():
            await context.abort(grpc.StatusCode.CANCELLED, f"request {gen.request_id} aborted")
        if isinstance(item.exception(), APIError):
            e = item.exception()
            await context.abort(_STATUS.get(e.status, grpc.StatusCode.INTERNAL), e.message)
        if item.exception() is not None:
            raise item.exception()

    async def Abort(self, request, context):
        task = self.running.get(request.request_id)
        if task is not None:
            task.cancel()  # the Generate call ends CANCELLED; decode is cancelled with it
        return inference_pb2.AbortResponse(found=task is not None)
