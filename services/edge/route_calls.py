"""The router's Route, for every request of this edge on one open call.

A unary `Route` was a quarter of the edge's main thread per start at 1,500
starts/s (py-spy), and ~0.27 ms of the router's CPU per route. On one open call
the router spends half that, the edge about what it did (a message write costs
it what the call did), and the whole run's p99 at 1,000 starts in a second read
0.4x (docs/design/2026-12-05-route-on-one-open-call.md). `RouteCalls` keeps one
`RouteStream` call open to the router and sends the requests on it, those queued
together in one message; each answer carries its request's id and, when the
request cannot be placed, the status a unary Route would have failed with, which
is raised here as that call's `AioRpcError`. When the call itself breaks (its
router replica went away), every request waiting on it is asked again on a new
call, which the channel opens to another replica: up to four tries, 50 ms apart
and doubling; UNAVAILABLE if they all fail. A unary Route that a stopping replica
cancels is asked again the same way. To
the orchestrator it is the `RouterStub` it replaces: `Route` and `ListWorkers`.

With tracing on, each request takes a unary Route, so that the router's side
joins the request's trace (a message on a shared call carries no context); so
does every request to a router that does not offer `RouteStream` (one from
before it, in a rolling upgrade), for a minute at a time.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve import telemetry
from pdserve.rpc import OpenCall, call_error, status_code
from pdserve.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger("pdserve.edge")

_UNARY = object()                   # the router has no RouteStream: ask again, unary
_NOT_OFFERED = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL)
UNARY_SECONDS = 60.0                # then RouteStream is tried again (the router may be new)
ATTEMPTS = 4                        # tries of one Route while replicas go away under it
BACKOFF = 0.05                      # seconds before the second try, doubling after


class _Gone(Exception):
    """The router replica a try reached went away under it: `error` is how it failed."""

    def __init__(self, error: grpc.aio.AioRpcError):
        super().__init__(error)
        self.error = error


class _OpenCall(OpenCall):
    """One `RouteStream` call and the requests waiting for their answers on it."""

    def __init__(self, stub: router_pb2_grpc.RouterStub, on_end):
        self.waiting: dict[str, asyncio.Future] = {}
        super().__init__(stub.RouteStream, lambda: self._read(on_end))

    async def _sent(self):
        """The requests, those queued since the last message in one (a write each
        was as dear as the unary call it replaced)."""
        requests = self._requests
        while (first := await requests.get()) is not None:
            batch = [first]
            while not requests.empty():
                if (request := requests.get_nowait()) is None:
                    yield router_pb2.RouteRequests(requests=batch)
                    return
                batch.append(request)
            yield router_pb2.RouteRequests(requests=batch)

    def send(self, request: router_pb2.RouteRequest) -> asyncio.Future:
        answer = self.waiting[request.request_id] = \
            asyncio.get_running_loop().create_future()
        self._requests.put_nowait(request)
        return answer

    async def _read(self, on_end) -> None:
        end: object = call_error(grpc.StatusCode.UNAVAILABLE, "the router's call ended")
        answered = False
        try:
            async for answers in self._call:
                answered = True
                for answer in answers.answers:
                    waiter = self.waiting.pop(answer.request_id, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(answer)
        except grpc.aio.AioRpcError as e:
            # A router without the method answers UNIMPLEMENTED, or, when our first
            # request crosses its refusal, the call ends INTERNAL: either way, before
            # any answer, its requests are asked again as unary calls.
            end = (_UNARY if not answered and e.code() in _NOT_OFFERED else
                   call_error(grpc.StatusCode.UNAVAILABLE, f"the router's call failed: "
                              f"{e.code().name}: {e.details()}"))
        except asyncio.CancelledError:
            end = call_error(grpc.StatusCode.CANCELLED, "the edge closed the router's call")
            raise
        finally:
            on_end(self, end)
            for waiter in self.waiting.values():
                if not waiter.done():
                    if end is _UNARY:
                        waiter.set_result(_UNARY)
                    else:
                        waiter.set_exception(end)
            self.waiting.clear()


class RouteCalls:
    """`RouterStub`'s Route over one open call; its other methods as they are."""

    def __init__(self, channel: grpc.aio.Channel):
        self._stub = router_pb2_grpc.RouterStub(channel)
        self.ListWorkers = self._stub.ListWorkers
        self._call: _OpenCall | None = None
        self._unary_until = 0.0             # loop.time() until which Route is unary

    async def Route(self, request: router_pb2.RouteRequest, timeout: float | None = None
                    ) -> router_pb2.RouteDecision:
        """`request`'s decision; asked again, up to ATTEMPTS tries within `timeout`, while
        the replica a try reached goes away under it (the channel moves to another)."""
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        for attempt in range(ATTEMPTS):
            left = None if end is None else end - loop.time()
            if left is not None and left <= 0:
                raise call_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            try:
                result = await self._try(request, left)
                break
            except _Gone as gone:
                if attempt + 1 == ATTEMPTS:
                    raise gone.error from None
            await asyncio.sleep(BACKOFF * 2 ** attempt)
        if isinstance(result, router_pb2.RouteDecision):
            return result
        if result.status_code:
            raise call_error(status_code(result.status_code), result.status_details)
        return result.decision

    async def _try(self, request: router_pb2.RouteRequest, timeout: float | None
                   ) -> router_pb2.RouteDecision | router_pb2.RouteAnswer:
        """One try: a unary call's decision or the open call's answer; _Gone when the
        replica it reached went away under it."""
        rid = request.request_id
        if (self.streamed and not telemetry.enabled() and rid
                and (self._call is None or rid not in self._call.waiting)):
            try:
                result = await self._answer(request, timeout)
            except grpc.aio.AioRpcError as e:
                # _read makes a broken call UNAVAILABLE; CANCELLED: this edge closed it
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                raise _Gone(e) from None
            if result is not _UNARY:
                return result
        try:
            return await self._stub.Route(request, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            # A replica stopping cancels the calls it took as it stopped; the channel's
            # retry policy has already asked again those refused UNAVAILABLE.
            if e.code() == grpc.StatusCode.CANCELLED:
                raise _Gone(e) from None
            raise

    async def _answer(self, request: router_pb2.RouteRequest, timeout: float | None):
        """`request`'s answer on the open call (opened if need be), or _UNARY; raises the
        call's own failure."""
        if self._call is None:
            self._call = _OpenCall(self._stub, self._ended)
        call, rid = self._call, request.request_id
        answer = call.send(request)
        deadline = None
        if timeout is not None:
            deadline = asyncio.get_running_loop().call_later(timeout, _past_deadline, answer)
        try:
            return await answer
        finally:
            if deadline is not None:
                deadline.cancel()
            if call.waiting.get(rid) is answer:
                del call.waiting[rid]

    @property
    def streamed(self) -> bool:
        """Whether Route goes on the open call now."""
        return asyncio.get_running_loop().time() >= self._unary_until

    def _ended(self, call: _OpenCall, end) -> None:
        if self._call is call:
            self._call = None
        if end is _UNARY and self.streamed:
            self._unary_until = asyncio.get_running_loop().time() + UNARY_SECONDS
            log.warning("the router answered no RouteStream: a call per request for %.0f s",
                        UNARY_SECONDS)

    async def close(self) -> None:
        if self._call is not None:
            await self._call.close()


def _past_deadline(answer: asyncio.Future) -> None:
    if not answer.done():
        answer.set_exception(call_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
