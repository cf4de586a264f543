"""One placed generation, streamed from a decode worker, surviving that worker.

A `GenerationStream` reads its tokens from one decode leg at a time: a
streaming `Generate` on a decode worker (which pulls the prefill's KV, or
prefills locally). When that worker dies (the call fails), stalls (no output
within `stall_seconds`; before the first output, `first_token_seconds`) or is
cut off by its drain, the generation migrates: the edge asks the router for
another decode worker (the failed one excluded for `exclude_seconds`) and
starts a new leg whose prompt is the original prompt plus every token already
sent, asking only for the tokens still owed. The client's stream just goes on:
the detokenizer and the token count carry over, so there is no gap and no
duplicate. With temperature 0 the text equals an uninterrupted run's. With
sampling and a seed, the continuation is a correct sample but not the one the
dead worker would have drawn (the new engine's generator starts afresh), and
presence/frequency penalties forget the tokens generated before the move
(they count output tokens, which the new leg sees as prompt).

A leg whose prefill sampled its first token, on a decode worker that goes on
after such a token (`DecodeLeg.first_token`), sends that token to the client as
soon as its decode call has started, before the decode engine answers: the
client's first token does not wait for the KV handover, and the decode leg is
asked for the rest, as a moved leg is.

A generation may also be preempted (admission.py takes its slot back for a
tenant owed it): its leg is aborted, it waits to be admitted again
(`readmit`), and it goes on as a moved generation does, on whichever decode
worker the router picks (the one it left, usually: its prefix is cached there),
with the same guarantees; that is a pause, not a migration.

A leg counts as stalled only when its worker as a whole has been silent that
long (`Heard`): an edge that is itself behind reads every stream late, and a
stream it has not read for seconds is not its worker's fault (at 10,000
streams on one overloaded edge, blaming the worker moved 1,127 healthy
generations and cut them short). A single request stuck on a worker that
serves others is left to the request's deadline.

Every leg that ends early is aborted explicitly on its worker (decode engine,
and the prefill lease it never pulled), not left to a timeout. All calls run
against the request's own deadline.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
from opentelemetry.trace import INVALID_SPAN, Span
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from pdserve import telemetry
from pdserve.v1 import common_pb2, transfer_pb2, transfer_pb2_grpc
from transfer.params import lease_id, lease_is_fresh

from .batched import BatchedLeg
from .detokenizer import TextStream
from .engine_requests import constrained, decode_request
from .openai_protocol import APIError

log = logging.getLogger("pdserve.edge")

# What a failing decode leg may be: anything but bad input and our own budget
# running out moves the generation to another worker.
_FINAL = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True, slots=True)
class Resilience:
    """How the edge rides out failing workers."""

    prefill_timeout: float = 30.0       # a prefill leg slower than this is tried elsewhere
    prefill_attempts: int = 2           # prefill workers tried before prefilling locally
    stall_seconds: float = 5.0          # a decode leg silent this long is moved...
    first_token_seconds: float = 30.0   # ...or this long before its first output
    max_migrations: int = 3             # moves per generation before it fails
    exclude_seconds: float = 10.0       # a worker that failed a generation is skipped this long
    place_wait_seconds: float = 30.0    # how long a move waits for a decode worker to serve


@dataclass(slots=True)
class Generation:
    """What the edge asks the cluster to generate (already tokenized and validated)."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    session_id: str = ""
    deadline: float = 0.0               # time.monotonic() it must end by; 0 = the edge's default
    kind: str = "completion"            # "chat" | "completion": the GenAI operation

    def remaining(self) -> float:
        """Seconds left of the request's budget; raises the deadline error at 0."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise deadline_passed()
        return left


@dataclass(slots=True)
class Chunk:
    """A piece of one request's output, as the edge relays it."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None            # "stop" | "length" | "abort" on the last
    logprobs: Any = None                        # the engine's OutputLogProbs, when asked for


@dataclass(slots=True)
class DecodeLeg:
    """Where a generation's tokens come from now: one decode worker, and the prefill
    lease whose blocks it pulls (if any)."""

    request_id: str                             # the engine's id (a moved leg gets a suffix)
    worker_id: str
    stub: vllm_engine_pb2_grpc.VllmEngineStub
    prefill_params: dict[str, Any] | None = None
    prefill_address: str = ""
    leases: transfer_pb2_grpc.KVTransferStub | None = None
    prefilled_at: float = 0.0                   # time.monotonic() when the prefill answered
    prefill_channel: Any = None                 # this edge's channel to the prefill worker
    calls: Any = None                           # BatchedCalls (batched.py), else stub's Generate
    # The token the prefill sampled, when the decode engine goes on after it: sent to
    # the client once the decode call starts, before its answer (taken once; else None).
    first_token: int | None = None
    started: bool = False                       # its first output came
    pulled: bool = False                        # ...and it had pulled the prefill's blocks
    abandoned: bool = False

    def abandon(self, running: set, why: str) -> None:
        """Drop the leg everywhere it lives, once: the decode engine's request, and the
        prefill's lease if the decode never got to pull it."""
        if self.abandoned:
            return
        self.abandoned = True
        in_background(self.stub.Abort(vllm_engine_pb2.AbortRequest(
            request_ids=[self.request_id]), timeout=2.0), running)
        self.end_lease(running, why)

    def end_lease(self, running: set, why: str) -> None:
        """End the prefill's lease unless the decode pulled it: its blocks are freed now,
        not when the lease runs out."""
        lease = lease_id(self.prefill_params or {})
        if self.leases is None or self.pulled or not lease:
            return
        leases, self.leases = self.leases, None
        in_background(leases.Abort(transfer_pb2.LeaseRequest(lease_id=lease, reason=why),
                                   timeout=2.0), running)


# (generation, engine request id, prompt ids, workers to avoid) -> a new leg and its stats
Place = Callable[[Generation, str, list[int], set[str]], Awaitable[tuple[DecodeLeg, dict]]]


class _Stalled(Exception):
    """A decode leg sent nothing within its stall deadline."""


class _Preempted(Exception):
    """Admission took the generation's slot back; it goes on once admitted again."""


class Heard:
    """When this edge last read output from each decode worker, on any of its legs."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}             # worker id -> loop.time()

    def since(self, worker_id: str, leg_last: float) -> float:
        """The last sign of life that clears a leg of `worker_id` silent since
        `leg_last`: its own output, or its worker's on another leg."""
        return max(leg_last, self.at.get(worker_id, leg_last))


@dataclass(slots=True)
class GenerationStream:
    """A placed request: its path is known; iterate `chunks()` for tokens and text."""

    gen: Generation
    path: str                                   # "disaggregated" | "local"
    leg: DecodeLeg
    text: TextStream
    place: Place                                # how a move finds its next leg
    resilience: Resilience = field(default_factory=Resilience)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_at: float | None = None         # perf_counter() when the first token arrived
    token_gaps: list[float] = field(default_factory=list)   # s between consecutive outputs
    stats: dict = field(default_factory=dict)
    span: Span = INVALID_SPAN                   # the generation's trace span (telemetry.py)
    migrations: list[float] = field(default_factory=list)   # ms from failure to next leg
    # How the generation waits to be admitted again after a preemption (Ticket.resume).
    readmit: Callable[[], Awaitable[None]] | None = None
    running: Callable[[], None] | None = None   # called as each leg's call starts
    preemptions: list[float] = field(default_factory=list)  # ms paused, each time
    failed: dict[str, float] = field(default_factory=dict)  # worker id -> when it failed us
    aborts: set = field(default_factory=set)    # in-flight Abort calls (kept referenced)
    heard: Heard = field(default_factory=Heard)  # shared by the edge's generations
    # The reader's step for one chunk, if it has one it can take synchronously (the
    # stream log's renderer): then a batched leg hands this stream its steady outputs
    # (neither the leg's first nor its last) from the call that read them, and no
    # task wakes per token (`_steady`).
    on_chunk: Callable[[Chunk], None] | None = None
    prompt_logprobs: Any = None                 # the engine's InputLogProbs, when asked for
    _last_output: float = 0.0                   # loop.time() of the leg's last output
    _last_token_at: float = 0.0                 # perf_counter() of the last output with tokens
    _stalled: bool = False
    _preempted: bool = False
    _call: Any = None                           # the current leg's call, while it runs
    _watchdog: asyncio.TimerHandle | None = None

    @property
    def decode_worker(self) -> str:
        return self.leg.worker_id

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV was cached where the prompt was computed: the prefill
        worker's prefix hit, or the decode worker's when it prefilled locally."""
        if self.stats.get("decode_external_tokens"):
            return self.stats.get("prefill_cached_tokens", 0)
        return self.stats.get("decode_cached_tokens", 0)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Chunks in order, across moves; leaving early cancels the call and aborts
        the request wherever it runs."""
        try:
            while True:
                try:
                    async with contextlib.aclosing(self._leg_chunks()) as leg_chunks:
                        async for chunk in leg_chunks:
                            yield chunk
                    return
                except grpc.aio.AioRpcError as e:
                    if e.code() in _FINAL:
                        raise self._final_error(e) from e
                    failure = f"{e.code().name}: {e.details()}"
                except _Stalled as e:
                    failure = str(e)
                except _Preempted:
                    await self._pause()
                    continue
                await self._migrate(failure)
        finally:
            if self.finish_reason is None:
                self.leg.abandon(self.aborts, f"request {self.gen.request_id} ended early")
            else:
                self.leg.end_lease(self.aborts, f"request {self.gen.request_id} ended")

    async def _leg_chunks(self) -> AsyncIterator[Chunk]:
        """The current leg's output; raises AioRpcError or _Stalled when it fails, and
        _Preempted when admission takes its slot back."""
        leg, sent = self.leg, len(self.output_ids)
        if self._preempted:                     # preempted before this leg's call
            raise _Preempted()
        first_leg = not sent
        token, leg.first_token = leg.first_token, None
        early = None if token is None else self._tokens([token])
        if early is not None:
            if first_leg:                       # pdserve:prefill_first_tokens
                self.stats["prefill_first_token"] = True
            # The prefill's token, out before the decode's handover; the decode leg is
            # asked for what follows it, like a moved leg.
            if early.finish_reason is None:
                if self.text.stops_at(token):
                    self.finish_reason = "stop"
                elif len(self.output_ids) >= self.gen.sampling.max_tokens:
                    self.finish_reason = "length"
            if self.finish_reason is not None:      # it ended the generation: no decode
                yield early
                if early.finish_reason is None:
                    yield self._end_chunk()
                return
            sent = len(self.output_ids)
        sampling = self.gen.sampling
        if sent:                                # a moved leg owes only the rest
            sampling = common_pb2.SamplingParams()
            sampling.CopyFrom(self.gen.sampling)
            sampling.max_tokens -= sent
            sampling.min_tokens = max(0, sampling.min_tokens - sent)
            if sampling.max_tokens <= 0:        # the last token came, its end did not
                self.finish_reason = "length"
                yield self._end_chunk()
                return
        req = decode_request(leg.request_id, self.gen.prompt_token_ids + self.output_ids,
                             sampling, leg.prefill_params, leg.prefill_address,
                             fresh_lease(leg, time.monotonic()))
        span = telemetry.span("decode", parent=self.span, attributes={
            "pdserve.worker.id": leg.worker_id, "pdserve.request.id": leg.request_id,
            "pdserve.decode.pull": leg.prefill_params is not None})
        error: BaseException | None = None
        with telemetry.current(span):           # the call carries the decode span's context
            call = (leg.calls or leg.stub).Generate(req, timeout=self.gen.remaining(),
                                                    metadata=telemetry.metadata())
        loop = asyncio.get_running_loop()
        self._last_output, self._stalled = loop.time(), False
        self._call = call
        self._watch(call)
        if self.running is not None:
            self.running()                      # it may be preempted from now on
        try:
            if early is not None:
                # NOTE: after the call starts, so that the decode request leaves first
                # (its handover is what the next token waits for); a preemption meanwhile
                # cancels the call, and reading it below raises.
                yield early
            async for resp in call:
                self._last_output = self.heard.at[leg.worker_id] = loop.time()
                if not resp.HasField("chunk"):
                    # The last message; the call ends right after it. Reading on to its
                    # end lets the call close cleanly (and its trace span end).
                    self.finish_reason = resp.complete.finish_reason or "stop"
                    continue
                c = resp.chunk
                if not leg.started:
                    leg.started = True
                    self._watch(call)           # from now on the shorter stall deadline
                    # A pull leaves all but the last token of the leg's prompt cached.
                    leg.pulled = (leg.prefill_params is not None and
                                  c.cached_tokens >= len(req.tokenized.input_ids) - 1)
                    if first_leg:
                        self._first_chunk(c.cached_tokens)
                        if c.HasField("input_logprobs"):
                            self.prompt_logprobs = c.input_logprobs
                if not c.token_ids:
                    continue
                chunk = self._tokens(list(c.token_ids),     # read out of the message once
                                     c.output_logprobs if c.HasField("output_logprobs") else None)
                yield chunk
                if chunk.finish_reason is not None:
                    return                      # the edge saw the stop string first
                if (self.on_chunk is not None and isinstance(call, BatchedLeg)
                        and not self.text.has_stop_strings):
                    call.sink = self._steady
            if self.finish_reason is not None:
                yield self._end_chunk()
        except asyncio.CancelledError as e:
            error = e
            if asyncio.current_task().cancelling() == 0:
                if self._preempted and self.finish_reason is not None:
                    # Preempted once its last message was in: nothing is owed.
                    error = None
                    yield self._end_chunk()
                    return
                if self._preempted:
                    error = _Preempted()
                    raise error from None
                if self._stalled:
                    error = _Stalled(f"decode worker {leg.worker_id} sent nothing for "
                                     f"{self._stall_limit():.1f} s")
                    raise error from None
            raise
        except grpc.aio.AioRpcError as e:
            if self.finish_reason is None:
                error = e
                raise
            # The call failed after its last message: nothing is lost.
            yield self._end_chunk()
        except BaseException as e:
            error = e
            raise
        finally:
            self._call = None
            self._watchdog.cancel()
            call.cancel()                       # a no-op once the call has ended
            telemetry.end(span, error, pdserve__decode__tokens=len(self.output_ids) - sent)

    def _end_chunk(self) -> Chunk:
        """The stream's last chunk, once `finish_reason` is known: the text held back."""
        return Chunk([], self.text.finish(), self.finish_reason)

    def _tokens(self, ids: list[int], logprobs=None) -> Chunk:
        """Output tokens taken into the stream: timings, ids, text (and their logprobs)."""
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self.token_gaps.append(now - self._last_token_at)
        self._last_token_at = now
        self.output_ids += ids
        text = self.text.add(ids)
        if self.text.stop_string is not None:
            self.finish_reason = "stop"         # the edge saw the stop string: it ends here
            return Chunk(ids, text, "stop", logprobs)
        return Chunk(ids, text, logprobs=logprobs)

    def _steady(self, resp: vllm_engine_pb2.GenerateResponse) -> bool:
        """An output of the current batched leg, handed over by the call's reader
        while this stream's task waits for it (BatchedLeg.sink): taken here, as
        `_leg_chunks` would take it, if it carries tokens or nothing; False (left to
        the task) for the leg's last message. Only set once the leg has started and
        the first token is out, and only without stop strings (those end the leg
        from the task)."""
        if not resp.HasField("chunk"):
            return False
        self._last_output = self.heard.at[self.leg.worker_id] = \
            asyncio.get_running_loop().time()
        if ids := resp.chunk.token_ids:
            c = resp.chunk
            self.on_chunk(self._tokens(list(ids), c.output_logprobs
                                       if c.HasField("output_logprobs") else None))
        return True

    def preempt(self) -> bool:
        """Give the slot up (Ticket.on_preempt): stop the current leg's call (or, between
        legs, the next one before it starts); `chunks()` then pauses and goes on once
        admitted again. False when it cannot now: it was just preempted, or its last
        output came."""
        if (self.readmit is None or self._preempted or self.finish_reason is not None
                or len(self.output_ids) >= self.gen.sampling.max_tokens
                or (self.output_ids and constrained(self.gen.sampling))):
            return False
        self._preempted = True
        if self._call is None:                  # between legs: the next one pauses first
            return True
        if not self._call.cancel():             # it had ended already
            self._preempted = False
        return self._preempted

    async def _pause(self) -> None:
        """After a preemption: abort the leg, wait to be admitted again (within the
        request's deadline), and place the rest of the generation."""
        old, began = self.leg, time.perf_counter()
        old.abandon(self.aborts, f"request {self.gen.request_id} preempted")
        self._preempted = False
        try:
            async with asyncio.timeout(self.gen.remaining()):
                await self.readmit()
        except TimeoutError:
            raise deadline_passed() from None
        rid = f"{self.gen.request_id}-p{len(self.preemptions) + 1}"
        await self._next_leg(rid, set)         # no worker to avoid: it failed nothing
        self.preemptions.append((time.perf_counter() - began) * 1000)
        log.info("request %s: preempted after %d tokens on %s, went on on %s after %.0f ms",
                 self.gen.request_id, len(self.output_ids), old.worker_id,
                 self.leg.worker_id, self.preemptions[-1])

    def close(self) -> None:
        """The generation is over. End the prefill's lease if the decode never pulled it
        (the request ended before its decode ran): its blocks are freed now, not when
        the lease runs out. Drop the callbacks that point back at this stream (its
        reader's renderer, its admission ticket): without those cycles its objects go
        with their last reference, not in a full garbage collection, which stalled the
        edge's loop ~190 ms at the end of 1,000 streams
        (docs/design/2026-12-05-edge-garbage-collection.md)."""
        self.leg.end_lease(self.aborts, f"request {self.gen.request_id} ended before its decode")
        self.on_chunk = self.readmit = self.running = None

    def _stall_limit(self) -> float:
        r = self.resilience
        return r.stall_seconds if self.leg.started else r.first_token_seconds

    def _watch(self, call) -> None:
        """(Re)arm the leg's watchdog for its current stall deadline."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = asyncio.get_running_loop().call_at(
            self._last_output + self._stall_limit(), self._check_stall, call)

    def _check_stall(self, call) -> None:
        """The watchdog: cancels the call when the leg and its worker have been silent
        too long, else looks again when it next could be (one timer per leg, not one
        per token)."""
        loop = asyncio.get_running_loop()
        due = self.heard.since(self.leg.worker_id, self._last_output) + self._stall_limit()
        if loop.time() >= due:
            self._stalled = True
            call.cancel()
        else:
            self._watchdog = loop.call_at(due, self._check_stall, call)

    def _first_chunk(self, cached_tokens: int) -> None:
        """The decode engine's first output says whether the KV travelled. If the
        prefill's blocks were not pulled, the decode worker prefilled itself (it
        refused a lease that was gone, or the pull failed)."""
        pulled = self.leg.pulled
        if self.leg.prefill_params is not None and not pulled:
            self.path = "local"
            self.stats["pull_refused"] = True
            log.warning("request %s: the decode worker %s prefilled locally (%d tokens "
                        "cached); the prefill's KV was not used", self.gen.request_id,
                        self.leg.worker_id, cached_tokens)
        self.stats.update(decode_cached_tokens=cached_tokens,
                          decode_external_tokens=cached_tokens if pulled else 0)

    async def _migrate(self, failure: str) -> None:
        """Continue on another decode worker, or raise the error that ends the stream."""
        old, began = self.leg, time.perf_counter()
        old.abandon(self.aborts, f"request {self.gen.request_id} moved off {old.worker_id}")
        self.failed[old.worker_id] = time.monotonic()
        if self.output_ids and constrained(self.gen.sampling):
            # The grammar's state lived in the failed engine: another would start it over.
            log.warning("request %s: decode worker %s failed (%s) after %d tokens of "
                        "structured output, which cannot move", self.gen.request_id,
                        old.worker_id, failure, len(self.output_ids))
            raise APIError(503, f"decode worker {old.worker_id} failed ({failure}); a "
                           "structured output cannot move to another worker once started",
                           type="service_unavailable")
        if len(self.migrations) >= self.resilience.max_migrations:
            log.warning("request %s: decode worker %s failed (%s); %d moves already, giving up",
                        self.gen.request_id, old.worker_id, failure, len(self.migrations))
            raise APIError(503, f"decode worker {old.worker_id} failed ({failure}) and the "
                           f"generation already moved {len(self.migrations)} times",
                           type="service_unavailable")
        log.warning("request %s: decode worker %s failed after %d tokens (%s); moving it",
                    self.gen.request_id, old.worker_id, len(self.output_ids), failure)
        await self._next_leg(f"{self.gen.request_id}-m{len(self.migrations) + 1}",
                             self._excluded)
        self.migrations.append((time.perf_counter() - began) * 1000)
        log.info("request %s: moved from %s to %s in %.0f ms", self.gen.request_id,
                 old.worker_id, self.leg.worker_id, self.migrations[-1])

    async def _next_leg(self, request_id: str, excluded: Callable[[], set[str]]) -> None:
        """Place the rest of the generation (its prompt plus every token sent) as a
        new leg, waiting a while for a decode worker to serve if none does. The
        workers to avoid are asked again at each try: one excluded for failing this
        generation is welcome again once its window has passed (the only decode
        worker of a small pool, which stalled for a moment, takes the rest then)."""
        wait_until = time.monotonic() + min(self.resilience.place_wait_seconds,
                                            self.gen.remaining())
        prompt = self.gen.prompt_token_ids + self.output_ids
        while True:
            try:
                with telemetry.current(self.span):
                    self.leg, _ = await self.place(self.gen, request_id, prompt, excluded())
                return
            except APIError as e:
                if e.status != 503 or time.monotonic() >= wait_until:
                    raise
            await asyncio.sleep(0.25)           # no decode worker serves yet: wait for one

    def _excluded(self) -> set[str]:
        """Workers that failed this generation recently (a restarted one, with the same
        id, is welcome again once the window has passed)."""
        since = time.monotonic() - self.resilience.exclude_seconds
        return {w for w, at in self.failed.items() if at > since}

    def _final_error(self, e: grpc.aio.AioRpcError) -> APIError:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return deadline_passed()
        return api_error(e, f"decode worker {self.leg.worker_id}")


def deadline_passed() -> APIError:
    """The error a request gets when its budget runs out (one wording, one status)."""
    return APIError(504, "the request's deadline passed before it finished",
                    type="timeout", code="deadline_exceeded")


def fresh_lease(leg: DecodeLeg, now: float) -> bool:
    """Whether the decode worker may pull `leg`'s prefill blocks without claiming their
    lease (transfer/claim.py): a leg is tried once, so this is its params' first use (a
    moved generation prefills anew); the lease is young; and this edge's connection to
    the prefill worker still stands. A worker killed after it answered drops that
    connection at once: a claim then finds it gone within milliseconds, where a pull
    from it would wait out NIXL's timeout (5 s here) before the decode computed the
    prompt itself."""
    return (leg.prefill_params is not None and leg.prefill_channel is not None
            and leg.prefill_channel.get_state() == grpc.ChannelConnectivity.READY
            and lease_is_fresh(leg.prefill_params, now - leg.prefilled_at))


def in_background(call, running: set) -> None:
    """Run a fire-and-forget call (an Abort): kept referenced in `running` until it
    ends, its failure swallowed (the worker may be gone; nothing waits on it)."""
    task = asyncio.ensure_future(call)
    running.add(task)
    task.add_done_callback(lambda t: (running.discard(t), t.cancelled() or t.exception()))


def api_error(e: grpc.aio.AioRpcError, who: str) -> APIError:
    """A worker's gRPC status as the error the client sees (mapped once, here)."""
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, e.details() or "invalid request")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return APIError(429, "the server is overloaded; retry later", type="server_overloaded")
    log.warning("%s failed: %s %s", who, code.name, e.details())
    return APIError(503, f"{who} is unavailable ({code.name})", type="service_unavailable")
