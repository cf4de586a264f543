"""One decode leg: a generation's tokens from one decode worker, on one call.

A `DecodeLeg` is where the tokens come from now: the decode worker, and the
prefill lease whose blocks it pulls (if any). A `LegCall` runs the leg's
streaming `Generate` (per request, or on the worker's shared call: batched.py)
and reads its outputs into the generation's `Output`. It ends by raising when
the leg cannot go on: `AioRpcError` (the worker failed the call), `Stalled`
(no output within `decode_stall_seconds`; before the first,
`decode_first_token_seconds`) or `Preempted` (admission took the slot back);
generation_stream.py then moves or pauses the generation (moves.py).

A leg counts as stalled only when its worker as a whole has been silent that
long (`Heard`): an edge that is itself behind reads every stream late, and a
stream it has not read for seconds is not its worker's fault (at 10,000
streams on one overloaded edge, blaming the worker moved 1,127 healthy
generations and cut them short). A single request stuck on a worker that
serves others is left to the request's deadline.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from pdserve import telemetry
from pdserve.config import EdgeConfig
from pdserve.v1 import transfer_pb2, transfer_pb2_grpc
from pdserve.transfer.params import lease_id, lease_is_fresh

from .batched import BatchedLeg
from .engine_requests import call_metadata
from .output import Chunk, Output
from .stats import GenerationStats

log = logging.getLogger("pdserve.edge")


class Stalled(Exception):
    """A decode leg sent nothing within its stall deadline."""


class Preempted(Exception):
    """Admission took the generation's slot back; it goes on once admitted again."""


class Slot(Protocol):
    """A generation's hold on the decode pool, as its legs use it (admission's Ticket)."""

    def running(self) -> None:
        """Called as each leg's call starts: it may be preempted from now on."""

    async def resume(self) -> None:
        """Called after a preemption; returns once the generation is admitted again."""


class Heard:
    """When this edge last read output from each decode worker, on any of its legs."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}             # worker id -> loop.time()

    def since(self, worker_id: str, leg_last: float) -> float:
        """The last sign of life that clears a leg of `worker_id` silent since
        `leg_last`: its own output, or its worker's on another leg."""
        return max(leg_last, self.at.get(worker_id, leg_last))


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


class LegCall:
    """One decode leg's `Generate` call: starts it, reads its outputs into the
    generation's `Output`, and watches it for stalls (one timer per leg, not one per
    token). `chunks()` once; `preempt()` from admission while it runs."""

    __slots__ = ("leg", "output", "stats", "heard", "cfg", "cache_salt", "call", "steady",
                 "preempted", "stalled", "_last", "_watchdog")

    def __init__(self, leg: DecodeLeg, output: Output, stats: GenerationStats, heard: Heard,
                 cfg: EdgeConfig, cache_salt: str = ""):
        self.leg, self.output, self.stats, self.heard, self.cfg = leg, output, stats, heard, cfg
        self.cache_salt = cache_salt            # the generation's (engine_requests.py)
        self.call = None                        # the engine's call, while it runs
        self.steady: Callable[[Chunk], None] | None = None
        self.preempted = self.stalled = False
        self._last = 0.0                        # loop.time() of the leg's last output
        self._watchdog: asyncio.TimerHandle | None = None

    @property
    def running(self) -> bool:
        return self.call is not None

    async def chunks(self, req: vllm_engine_pb2.GenerateRequest, timeout: float, parent,
                     early: Chunk | None, first_leg: bool, slot: Slot | None = None,
                     steady: Callable[[Chunk], None] | None = None) -> AsyncIterator[Chunk]:
        """The leg's chunks: `early` (the prefill's token) once the call has started,
        then the decode engine's. `slot.running()` is told when the call starts.
        `steady`: the reader's step for one chunk, which it can take synchronously (the
        stream log's renderer): a batched leg then hands it the steady outputs (neither
        the leg's first nor its last) from the call that read them, and no task wakes
        per token (`_steady`)."""
        output, error, sent = self.output, None, len(self.output.ids)
        call, span = self._start(req, timeout, parent, slot)
        prompt_tokens = len(req.tokenized.input_ids)
        try:
            if early is not None:
                # NOTE: after the call starts, so that the decode request leaves first
                # (its handover is what the next token waits for); a preemption meanwhile
                # cancels the call, and reading it below raises.
                yield early
            async for resp in call:
                if (chunk := self._take(resp, prompt_tokens, first_leg)) is None:
                    continue
                yield chunk
                if chunk.finish_reason is not None:
                    return                      # the edge saw the stop string first
                if (steady is not None and self.steady is None and isinstance(call, BatchedLeg)
                        and not output.text.has_stop_strings):
                    self.steady, call.sink = steady, self._steady
            if output.finish_reason is not None:
                yield output.end()
        except asyncio.CancelledError as e:
            error = self._why_cancelled(e)
            if error is None:                   # preempted once its last message was in
                yield output.end()
                return
            if error is e:
                raise
            raise error from None
        except grpc.aio.AioRpcError as e:
            if output.finish_reason is None:
                error = e
                raise
            # The call failed after its last message: nothing is lost.
            yield output.end()
        except BaseException as e:
            error = e
            raise
        finally:
            self.call = self.steady = None      # no cycle through the shared call's sink
            self._watchdog.cancel()
            call.cancel()                       # a no-op once the call has ended
            telemetry.end(span, error, pdserve__decode__tokens=len(output.ids) - sent)

    def _start(self, req: vllm_engine_pb2.GenerateRequest, timeout: float, parent,
               slot: Slot | None):
        """Start the leg's call, traced as its own span, and its watchdog: (call, span)."""
        leg = self.leg
        span = telemetry.span("decode", parent=parent, attributes={
            "pdserve.worker.id": leg.worker_id, "pdserve.request.id": leg.request_id,
            "pdserve.decode.pull": leg.prefill_params is not None})
        with telemetry.current(span):           # the call carries the decode span's context
            call = self.call = (leg.calls or leg.stub).Generate(
                req, timeout=timeout, metadata=call_metadata(self.cache_salt))
        self._last = asyncio.get_running_loop().time()
        self._watch()
        if slot is not None:
            slot.running()                      # it may be preempted from now on
        return call, span

    def _take(self, resp: vllm_engine_pb2.GenerateResponse, prompt_tokens: int,
              first_leg: bool) -> Chunk | None:
        """One message of the call, taken into the output: its chunk, or None for one
        with no tokens (the last message: it sets the finish reason)."""
        self._last = self.heard.at[self.leg.worker_id] = asyncio.get_running_loop().time()
        if not resp.HasField("chunk"):
            # The last message; the call ends right after it. Reading on to its end
            # lets the call close cleanly (and its trace span end).
            self.output.finish_reason = resp.complete.finish_reason or "stop"
            return None
        c = resp.chunk
        if not self.leg.started:
            self._started(c, prompt_tokens, first_leg)
        if not c.token_ids:
            return None
        return self.output.take(list(c.token_ids),     # read out of the message once
                                c.output_logprobs if c.HasField("output_logprobs") else None)

    def _why_cancelled(self, e: asyncio.CancelledError) -> BaseException | None:
        """What a cancelled call means: the task's own cancellation (`e`), this side's
        stall or preemption (the exception the stream moves or pauses on), or nothing
        (preempted once its last message was in: nothing is owed)."""
        if asyncio.current_task().cancelling():
            return e
        if self.preempted:
            return None if self.output.finish_reason is not None else Preempted()
        if self.stalled:
            return Stalled(f"decode worker {self.leg.worker_id} sent nothing for "
                           f"{self._stall_limit():.1f} s")
        return e

    def _started(self, c, prompt_tokens: int, first_leg: bool) -> None:
        """The leg's first output: from now on the shorter stall deadline; it says
        whether the KV travelled (a pull leaves all but the prompt's last token cached)."""
        leg = self.leg
        leg.started = True
        self._watch()
        leg.pulled = leg.prefill_params is not None and c.cached_tokens >= prompt_tokens - 1
        if first_leg:
            self._first_output(c.cached_tokens)
            if c.HasField("input_logprobs"):
                self.output.prompt_logprobs = c.input_logprobs

    def _first_output(self, cached_tokens: int) -> None:
        """The generation's first decode output. If the prefill's blocks were not pulled,
        the decode worker prefilled itself (it refused a lease that was gone, or the pull
        failed)."""
        leg, stats = self.leg, self.stats
        if leg.prefill_params is not None and not leg.pulled:
            stats.path, stats.pull_refused = "local", True
            log.warning("request %s: the decode worker %s prefilled locally (%d tokens "
                        "cached); the prefill's KV was not used", leg.request_id,
                        leg.worker_id, cached_tokens)
        stats.decode_cached_tokens = cached_tokens
        stats.decode_external_tokens = cached_tokens if leg.pulled else 0

    def _steady(self, resp: vllm_engine_pb2.GenerateResponse) -> bool:
        """An output of the batched leg, handed over by the shared call's reader while
        the stream's task waits for it (BatchedLeg.sink): taken here, as `chunks()`
        would take it, if it carries tokens or nothing; False (left to the task) for
        the leg's last message. Only set once the leg has started and its first token
        is out, and only without stop strings (those end the leg from the task)."""
        if not resp.HasField("chunk"):
            return False
        self._last = self.heard.at[self.leg.worker_id] = asyncio.get_running_loop().time()
        if ids := resp.chunk.token_ids:
            c = resp.chunk
            self.steady(self.output.take(list(ids), c.output_logprobs
                                         if c.HasField("output_logprobs") else None))
        return True

    def preempt(self) -> bool:
        """Stop the call for a preemption; False when it cannot (it had ended already,
        or it was preempted before)."""
        if self.preempted or self.call is None or not self.call.cancel():
            return False
        self.preempted = True
        return True

    def _stall_limit(self) -> float:
        cfg = self.cfg
        return cfg.decode_stall_seconds if self.leg.started else cfg.decode_first_token_seconds

    def _watch(self) -> None:
        """(Re)arm the leg's watchdog for its current stall deadline."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = asyncio.get_running_loop().call_at(
            self._last + self._stall_limit(), self._check_stall)

    def _check_stall(self) -> None:
        """The watchdog: cancels the call when the leg and its worker have been silent
        too long, else looks again when it next could be."""
        loop = asyncio.get_running_loop()
        due = self.heard.since(self.leg.worker_id, self._last) + self._stall_limit()
        if loop.time() < due:
            self._watchdog = loop.call_at(due, self._check_stall)
        elif self.call is not None:
            self.stalled = True
            self.call.cancel()


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
