"""One placed generation, streamed from a decode worker, surviving that worker.

A `GenerationStream` reads its tokens from one decode leg at a time (leg.py:
a streaming `Generate` on a decode worker, which pulls the prefill's KV or
prefills locally). When a leg fails, stalls or is preempted, the stream asks
its `Mover` (moves.py) for the next leg and goes on: the client's stream just
continues, since the output (output.py: ids, detokenizer, token count) carries
over, so there is no gap and no duplicate.

A leg whose prefill sampled its first token, on a decode worker that goes on
after such a token (`DecodeLeg.first_token`), sends that token to the client as
soon as its decode call has started, before the decode engine answers: the
client's first token does not wait for the KV handover, and the decode leg is
asked for the rest, as a moved leg is.

The stream calls nothing of its reader's but what the reader passes to
`chunks()`: the slot a preemption gives up and waits for again (admission's
Ticket, held by admitted.py), and the reader's synchronous step for steady
outputs. Admission reaches it through `preempt()` alone.

Every leg that ends early is aborted explicitly on its worker (decode engine,
and the prefill lease it never pulled), not left to a timeout. All calls run
against the request's own deadline.
"""
from __future__ import annotations

import contextlib
import time
from typing import AsyncIterator, Callable

import grpc
from opentelemetry.trace import INVALID_SPAN, Span

from pdserve.config import EdgeConfig

from .detokenizer import TextStream
from .engine_requests import constrained, decode_request
from .generation import Generation, api_error, deadline_passed
from .leg import DecodeLeg, Heard, LegCall, Preempted, Slot, Stalled, fresh_lease
from .moves import Mover, Place, owed
from .openai_protocol import APIError
from .output import Chunk, Output
from .stats import GenerationStats

# What a failing decode leg may be: anything but bad input and our own budget
# running out moves the generation to another worker.
_FINAL = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED)


class GenerationStream:
    """A placed generation: its path is known; iterate `chunks()` for tokens and text."""

    __slots__ = ("gen", "leg", "output", "stats", "span", "cfg", "heard", "aborts", "_mover",
                 "_call", "_preempted")

    def __init__(self, gen: Generation, leg: DecodeLeg, text: TextStream,
                 stats: GenerationStats, cfg: EdgeConfig, place: Place | None = None,
                 heard: Heard | None = None, aborts: set | None = None,
                 span: Span = INVALID_SPAN):
        self.gen, self.leg, self.stats, self.cfg = gen, leg, stats, cfg
        self.output = Output(text, stats)
        self.span = span                        # the generation's trace span (telemetry.py)
        self.heard = heard if heard is not None else Heard()   # shared by the edge's legs
        self.aborts = aborts if aborts is not None else set()  # in-flight Aborts, referenced
        self._mover = Mover(gen, cfg, place, stats, span, self.aborts)
        self._call: LegCall | None = None       # the current leg's call
        self._preempted = False                 # between legs: the next one pauses first

    @property
    def path(self) -> str:
        """"disaggregated" | "local": where the prompt's KV was computed."""
        return self.stats.path

    @property
    def decode_worker(self) -> str:
        return self.leg.worker_id

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason

    @property
    def completion_tokens(self) -> int:
        return len(self.output.ids)

    @property
    def cached_tokens(self) -> int:
        return self.stats.cached_tokens

    async def chunks(self, slot: Slot | None = None,
                     steady: Callable[[Chunk], None] | None = None) -> AsyncIterator[Chunk]:
        """Chunks in order, across moves and pauses; leaving early cancels the call and
        aborts the request wherever it runs. `slot`: what a preemption gives up and
        waits for again (None: it goes on at once). `steady`: see LegCall.chunks."""
        try:
            while True:
                try:
                    async with contextlib.aclosing(self._leg(slot, steady)) as leg_chunks:
                        async for chunk in leg_chunks:
                            yield chunk
                    return
                except grpc.aio.AioRpcError as e:
                    if e.code() in _FINAL:
                        raise self._final_error(e) from e
                    failure = f"{e.code().name}: {e.details()}"
                except Stalled as e:
                    failure = str(e)
                except Preempted:
                    self._preempted = False
                    self.leg = await self._mover.resume(self.leg, slot, self.output.ids)
                    continue
                self.leg = await self._mover.migrate(self.leg, failure, self.output.ids)
        finally:
            self._call = None
            rid = self.gen.request_id
            if self.output.finish_reason is None:
                self.leg.abandon(self.aborts, f"request {rid} ended early")
            else:
                self.leg.end_lease(self.aborts, f"request {rid} ended")

    def _leg(self, slot: Slot | None, steady) -> AsyncIterator[Chunk]:
        """The current leg's chunks: its call on the decode worker, unless the
        generation ends without one. Raises Preempted if preempted between legs."""
        if self._preempted:
            raise Preempted()
        out, leg = self.output, self.leg
        first_leg = not out.ids
        token, leg.first_token = leg.first_token, None
        early = None
        if token is not None:
            # The prefill's token, out before the decode's handover; the decode leg is
            # asked for what follows it, like a moved leg.
            early = out.take_prefill_token(token, self.gen.sampling.max_tokens)
            if first_leg:                       # pdserve:prefill_first_tokens
                self.stats.prefill_first_token = True
            if out.finish_reason is not None:   # it ended the generation: no decode
                return out.ended(early)
        sampling = owed(self.gen.sampling, len(out.ids))
        if sampling is None:                    # the last token came, its end did not
            out.finish_reason = "length"
            return out.ended(early)
        req = decode_request(leg.request_id, self.gen.prompt_token_ids + out.ids, sampling,
                             leg.prefill_params, leg.prefill_address,
                             fresh_lease(leg, time.monotonic()))
        call = self._call = LegCall(leg, out, self.stats, self.heard, self.cfg,
                                    self.gen.cache_salt)
        return call.chunks(req, self.gen.remaining(), self.span, early, first_leg, slot, steady)

    def preempt(self) -> bool:
        """Give the slot up (Ticket.on_preempt): stop the current leg's call (or, between
        legs, the next one before it starts); `chunks()` then pauses and goes on once
        admitted again. False when it cannot now: it was just preempted, or its last
        output came."""
        out = self.output
        if (self._preempted or out.finish_reason is not None
                or len(out.ids) >= self.gen.sampling.max_tokens
                or (out.ids and constrained(self.gen.sampling))):
            return False
        call = self._call
        if call is not None and call.running:
            return call.preempt()
        self._preempted = True                  # between legs: the next one pauses first
        return True

    def close(self) -> None:
        """The generation is over. End the prefill's lease if the decode never pulled it
        (the request ended before its decode ran): its blocks are freed now, not when
        the lease runs out."""
        self.leg.end_lease(self.aborts, f"request {self.gen.request_id} ended before its "
                                        "decode")

    def _final_error(self, e: grpc.aio.AioRpcError) -> APIError:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return deadline_passed()
        return api_error(e, f"decode worker {self.leg.worker_id}")
