"""Decode legs on one shared call per worker (`pdserve.v1.BatchedGenerate`).

With `--decode-calls batched`, the edge reads the tokens of all its
generations on a worker through one bidirectional call, whose messages each
carry every output the worker produced in one turn of its loop (see
services/worker/batched.py): at 1,000 streams x 20 tokens/s that is a third of
the gRPC CPU per token of one `Generate` call per generation, on both sides
(docs/design/2026-12-02-batched-decode-calls.md). Prefill, Abort and everything
else stay on vLLM's `VllmEngine`; a worker that does not offer the service (a
stock `vllm ... --grpc`) gets per-request calls, and so do the first `BATCH_FROM`
legs open on a worker that does (alone, a call of its own is cheaper than a
shared one).

A `BatchedLeg` behaves as the per-request call it replaces, as far as a
leg's call (leg.py) can tell: iterating it yields `GenerateResponse`s, then
ends, or raises `grpc.aio.AioRpcError` with the generation's status (the
shared call failing is UNAVAILABLE for every generation on it, so each moves
to another worker as it would when its own call broke); `cancel()` makes the
iteration raise `CancelledError` and aborts the generation on the worker; the
deadline holds on this side too. A leg with a `sink` (LegCall._steady)
hands it each output that arrives while its reader waits with nothing queued:
the stream takes it in this call's reader task, so a token costs no task
wake-up between the shared call and the client's socket (sse.pushed).
"""
from __future__ import annotations

import asyncio
import collections
import logging

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from pdserve.rpc import OpenCall, call_error, status_code
from pdserve.v1 import batched_pb2, batched_pb2_grpc

log = logging.getLogger("pdserve.edge")

SERVICE_NAME = batched_pb2.DESCRIPTOR.services_by_name["BatchedGenerate"].full_name
# Legs open on a worker before new ones share its call: alone, a call of its own is one
# hop less. (A shared call for every leg read 55 ms of edge CPU per request against 41 at
# 1 request/s, in runs one after another; paired, with this threshold, the two modes
# measured the same: docs/design/2026-12-02-batched-decode-calls.md.)
BATCH_FROM = 4
_CANCELLED = object()                           # ended by cancel() on this side


class BatchedLeg:
    """One generation on a shared call: an async iterator of GenerateResponse."""

    def __init__(self, call: _SharedCall, request_id: str):
        self._call, self.request_id = call, request_id
        self._outputs: collections.deque = collections.deque()
        self._end: object | tuple[grpc.StatusCode, str] | None = None
        self._waiter: asyncio.Future | None = None
        self._deadline: asyncio.TimerHandle | None = None
        # Takes an output synchronously while the reader waits with nothing queued
        # (LegCall._steady); False hands it to the reader after all.
        self.sink = None

    def __aiter__(self) -> BatchedLeg:
        return self

    async def __anext__(self) -> vllm_engine_pb2.GenerateResponse:
        while not self._outputs:
            if self._end is _CANCELLED:
                raise asyncio.CancelledError()
            if self._end is not None:
                code, details = self._end
                if code == grpc.StatusCode.OK:
                    raise StopAsyncIteration
                raise call_error(code, details)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._outputs.popleft()

    def cancel(self) -> bool:
        """Stop reading and abort it on the worker; False once it has ended."""
        if self._end is not None:
            return False
        self._call.abort(self.request_id)
        self._ended(_CANCELLED)
        return True

    def _push(self, response: vllm_engine_pb2.GenerateResponse) -> None:
        if self._end is not None:
            return
        waiter = self._waiter
        if (self.sink is not None and waiter is not None and not waiter.done()
                and not self._outputs):
            # The reader is parked in __anext__ with everything before delivered, so
            # taking this one here keeps the order, and saves waking it.
            try:
                if self.sink(response):
                    return
            except Exception:  # noqa: BLE001 (never break the shared call for the others)
                log.exception("generation %s: taking an output failed", self.request_id)
                self.sink = None
                self._call.abort(self.request_id)
                self._ended((grpc.StatusCode.INTERNAL, "the edge failed to take an output"))
                return
        self._outputs.append(response)
        self._wake()

    def _ended(self, end) -> None:
        if self._end is None:
            self._end = end
            if self._deadline is not None:
                self._deadline.cancel()
            self._call.legs.pop(self.request_id, None)
            self._wake()

    def _past_deadline(self) -> None:
        if self._end is None:
            self._call.abort(self.request_id)
            self._ended((grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _SharedCall(OpenCall):
    """One open `BatchedGenerate` call and the legs on it (each generation's trace context
    travels in its own request's metadata)."""

    def __init__(self, stub: batched_pb2_grpc.BatchedGenerateStub, on_end):
        self.legs: dict[str, BatchedLeg] = {}
        self.messages = 0                       # read so far
        super().__init__(stub.Generate, lambda: self._read(on_end))

    def start(self, request: vllm_engine_pb2.GenerateRequest, timeout: float | None,
              metadata) -> BatchedLeg:
        rid = request.request_id
        if rid in self.legs:
            raise ValueError(f"request {rid} is already running on this call")
        leg = self.legs[rid] = BatchedLeg(self, rid)
        self._requests.put_nowait(batched_pb2.BatchedRequest(
            request_id=rid, generate=request.SerializeToString(),
            timeout_seconds=timeout or 0.0, metadata=dict(metadata or ())))
        if timeout:
            leg._deadline = asyncio.get_running_loop().call_later(timeout, leg._past_deadline)
        return leg

    def abort(self, request_id: str) -> None:
        if not self._reader.done():
            self._requests.put_nowait(batched_pb2.BatchedRequest(request_id=request_id,
                                                                 abort=True))

    async def _read(self, on_end) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, "the batched call ended"
        try:
            parse = vllm_engine_pb2.GenerateResponse.FromString
            async for batch in self._call:
                self.messages += 1
                for out in batch.outputs:
                    leg = self.legs.get(out.request_id)
                    if leg is None:
                        continue                # cancelled here: its last outputs
                    if out.response:
                        leg._push(parse(out.response))
                    if out.ended:
                        leg._ended((status_code(out.status_code),
                                    out.status_details))
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), f"the batched call failed: {e.details()}"
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "the edge closed the batched call"
            raise
        finally:
            on_end(self)
            if self.legs:
                log.warning("batched call ended (%s: %s) with %d generations open",
                            code.name, details, len(self.legs))
            for leg in list(self.legs.values()):
                # UNAVAILABLE, as a broken per-request call: each generation moves on.
                leg._ended((grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.OK else code,
                            details))


class BatchedCalls:
    """This edge's decode legs on one worker: a `Generate` call each while few are open
    (a message per token costs no more than a batch of one, and a shared call adds a
    hop), then the shared call, opened when first needed and again after it ends."""

    def __init__(self, channel: grpc.aio.Channel, batch_from: int = BATCH_FROM):
        self._stub = batched_pb2_grpc.BatchedGenerateStub(channel)
        self._engine = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        self._call: _SharedCall | None = None
        self.batch_from = batch_from
        self.own_calls = 0                      # legs open on calls of their own
        self._messages_before = 0               # read on shared calls that have ended

    @property
    def open_legs(self) -> int:
        return self.own_calls + (len(self._call.legs) if self._call is not None else 0)

    def Generate(self, request: vllm_engine_pb2.GenerateRequest, timeout: float | None = None,
                 metadata=None):
        """A leg for `request`, as `VllmEngineStub.Generate` would give a call."""
        if self.open_legs < self.batch_from:
            call = self._engine.Generate(request, timeout=timeout, metadata=metadata)
            self.own_calls += 1
            call.add_done_callback(self._own_call_done)
            return call
        if self._call is None:
            self._call = _SharedCall(self._stub, self._ended)
        return self._call.start(request, timeout, metadata)

    @property
    def messages_read(self) -> int:
        """Messages read on this worker's shared calls (each carries many outputs)."""
        return self._messages_before + (self._call.messages if self._call is not None else 0)

    def _own_call_done(self, _call) -> None:
        self.own_calls -= 1

    def _ended(self, call: _SharedCall) -> None:
        self._messages_before += call.messages
        if self._call is call:
            self._call = None

    async def close(self) -> None:
        if self._call is not None:
            await self._call.close()
