"""Many generations on one call (`pdserve.v1.BatchedGenerate`), beside `VllmEngine`.

Each generation the caller starts runs through the worker's own `Generate`
(vLLM's servicer, or the synthetic engine), so validation, the KV handover,
drain accounting and aborts are the ones a per-request call gets. Only the
transport differs: outputs are gathered in one list, and the call sends the
whole list as one message once the event loop has run everything that was
ready in that turn. A lone output goes out at once; under load, one message
(one write here, one wake-up at the edge) carries many streams' tokens.

A generation ends with an `ended` output holding its status: OK, the status its
`Generate` aborted with (INVALID_ARGUMENT for a bad request...), DEADLINE_EXCEEDED
past its `timeout_seconds`, or CANCELLED when the caller aborted it. When the
call ends, every generation still open on it is cancelled (vLLM frees its KV).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from smg_grpc_proto import vllm_engine_pb2

from pdserve import telemetry
from pdserve.v1 import batched_pb2, batched_pb2_grpc

log = logging.getLogger(__name__)

MESSAGE_BYTES = 1 << 20                 # a message's outputs, at most (roughly)
SERVICE_NAME = batched_pb2.DESCRIPTOR.services_by_name["BatchedGenerate"].full_name
GENERATION_SPAN = f"/{SERVICE_NAME}/Generate"


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """What a `Generate` handler uses of its call's context, for one generation."""

    def __init__(self, metadata: dict[str, str]):
        self._metadata = tuple(metadata.items())

    def invocation_metadata(self):
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        raise _Aborted(code, details)


class BatchedGenerateServicer(batched_pb2_grpc.BatchedGenerateServicer):
    """`BatchedGenerate` over an engine servicer's `Generate`."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = 0                          # calls opened, messages sent, outputs in them
        self.messages = 0
        self.outputs = 0

    async def Generate(self, request_iterator, context):
        call = _Call(self.engine)
        self.calls += 1
        log.info("batched call %d opened by %s", self.calls, context.peer())
        reader = asyncio.create_task(call.read(request_iterator))
        try:
            while not (reader.done() and not call.running and not call.outbox):
                await call.ready.wait()
                await asyncio.sleep(0)          # let this turn's other outputs join
                call.ready.clear()
                outputs, call.outbox = call.outbox, []
                for message in _messages(outputs):
                    self.messages += 1
                    self.outputs += len(message)
                    yield batched_pb2.BatchedOutputs(outputs=message)
        finally:
            reader.cancel()
            for task in list(call.running.values()):
                task.cancel()


def _messages(outputs: list) -> list[list]:
    """The outputs cut into messages of at most MESSAGE_BYTES (a reader that fell
    behind finds many waiting; gRPC refuses messages over 4 MiB)."""
    messages, size = [[]], 0
    for out in outputs:
        cost = len(out.response) + len(out.request_id) + 16
        if messages[-1] and size + cost > MESSAGE_BYTES:
            messages.append([])
            size = 0
        messages[-1].append(out)
        size += cost
    return messages if messages[0] else []


def add_to_server(engine, server) -> BatchedGenerateServicer:
    """Serve `BatchedGenerate` over `engine`'s Generate on `server`."""
    servicer = BatchedGenerateServicer(engine)
    batched_pb2_grpc.add_BatchedGenerateServicer_to_server(servicer, server)
    return servicer


class _Call:
    """The generations of one `BatchedGenerate` call, and their outbox."""

    def __init__(self, engine):
        self.engine = engine
        self.running: dict[str, asyncio.Task] = {}
        self.outbox: list[batched_pb2.BatchedOutput] = []
        self.ready = asyncio.Event()

    async def read(self, requests) -> None:
        try:
            async for req in requests:
                if req.WhichOneof("kind") == "abort":
                    task = self.running.get(req.request_id)
                    if task is not None:
                        task.cancel()
                elif req.request_id in self.running:
                    self._end(req.request_id, grpc.StatusCode.ALREADY_EXISTS,
                              f"request {req.request_id} is already running on this call")
                else:
                    self.running[req.request_id] = asyncio.create_task(self._run(req))
        finally:
            self.ready.set()                    # the caller is done sending

    def _put(self, output: batched_pb2.BatchedOutput) -> None:
        self.outbox.append(output)
        self.ready.set()

    def _end(self, rid: str, code: grpc.StatusCode = grpc.StatusCode.OK, details: str = ""):
        self._put(batched_pb2.BatchedOutput(request_id=rid, ended=True,
                                            status_code=code.value[0], status_details=details))

    async def _run(self, req: batched_pb2.BatchedRequest) -> None:
        rid, metadata = req.request_id, dict(req.metadata)
        span = None
        if telemetry.enabled():
            from opentelemetry import propagate, trace
            parent = trace.get_current_span(propagate.extract(metadata))
            # Named as a call of its own would be: one per generation.
            span = telemetry.span(GENERATION_SPAN, parent=parent, kind=trace.SpanKind.SERVER,
                                  attributes={"pdserve.request.id": rid})
        error: BaseException | str | None = None
        try:
            request = vllm_engine_pb2.GenerateRequest.FromString(req.generate)
            with telemetry.current(span) if span is not None else contextlib.nullcontext():
                async with asyncio.timeout(req.timeout_seconds or None):
                    async for resp in self.engine.Generate(request, _Context(metadata)):
                        self._put(batched_pb2.BatchedOutput(
                            request_id=rid, response=resp.SerializeToString()))
            self._end(rid)
        except _Aborted as e:
            error = e.details
            self._end(rid, e.code, e.details)
        except TimeoutError:
            error = "deadline exceeded"
            self._end(rid, grpc.StatusCode.DEADLINE_EXCEEDED, "the generation's deadline passed")
        except asyncio.CancelledError:
            error = "cancelled"
            self._end(rid, grpc.StatusCode.CANCELLED, "aborted by the caller")
        except Exception as e:  # noqa: BLE001 (one generation's bug must not end the call)
            log.exception("batched generate %s failed", rid)
            error = e
            self._end(rid, grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")
        finally:
            self.running.pop(rid, None)
            if span is not None:
                telemetry.end(span, error)
