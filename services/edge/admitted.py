"""A generation's life on this edge, from its admission to its end.

Admission gives a request a `Ticket` (its slot in the decode pool); the
orchestrator gives it a `GenerationStream`. An `AdmittedGeneration` holds both,
and the references go one way: the app and its readers hold it and read its
chunks; it hands its ticket to each iteration of the stream (what a preemption
gives up and waits for again); admission reaches the stream through the
ticket's `on_preempt` alone, until `end()` releases the ticket. So nothing of
the stream points back at its readers, and its objects go with their last
reference, not in a full garbage collection (which stalled the edge's loop
~190 ms at the end of 1,000 streams, bench/README.md). It is counted in the
edge's metrics when it starts and when it ends, and its trace span ends with it.
"""
from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Callable

from pdserve import genai, telemetry

from .admission import Admission
from .ticket import Ticket
from .generation import Generation
from .generation_stream import GenerationStream
from .keys import APIKey
from .metrics import EdgeMetrics, observe_all
from .orchestrator import Orchestrator
from .output import Chunk

log = logging.getLogger("pdserve.edge")


async def admit(admission: Admission, orchestrator: Orchestrator, key: APIKey,
                gen: Generation, started: float) -> AdmittedGeneration:
    """Wait for room in the pool, then route and prefill (`started`: perf_counter()
    when the request came). The generation's span starts here and ends with it."""
    span = telemetry.span(genai.span_name(gen.kind, gen.model), attributes={
        **genai.request_attributes(gen.kind, gen.model, len(gen.prompt_token_ids),
                                   gen.sampling),
        "pdserve.request.id": gen.request_id, "pdserve.tenant": key.tenant})
    ticket = None
    try:
        with telemetry.current(span):
            admitting = telemetry.span("admit")
            try:
                ticket = await admission.admit(key)
            finally:
                telemetry.end(admitting, None if ticket else "refused",
                              pdserve__queue_seconds=ticket.waited if ticket else 0.0)
            stream = await orchestrator.start(gen, span)
    except BaseException as e:
        if ticket is not None:
            ticket.release()
        telemetry.end(span, e)
        raise
    return AdmittedGeneration(stream, ticket, started)


class AdmittedGeneration:
    """One admitted generation: its stream, the ticket it holds, when its request came."""

    __slots__ = ("stream", "ticket", "started")

    def __init__(self, stream: GenerationStream, ticket: Ticket, started: float):
        self.stream, self.ticket = stream, ticket
        self.started = started                  # perf_counter() when the request came
        ticket.on_preempt = stream.preempt

    def chunks(self, steady: Callable[[Chunk], None] | None = None) -> AsyncIterator[Chunk]:
        """The stream's chunks, paused and resumed through the ticket when preempted;
        `steady`: see LegCall.chunks."""
        return self.stream.chunks(self.ticket, steady)

    def count_start(self, metrics: EdgeMetrics, model: str) -> None:
        """Count the generation as started (`end` counts its end)."""
        placed = self.stream.stats.placed
        if placed.prefill_fallback:
            metrics.prefill_fallbacks.labels(model).inc()
        metrics.prefill_failovers.labels(model).inc(placed.prefill_failovers)
        metrics.prompt_tokens.labels(model).inc(len(self.stream.gen.prompt_token_ids))
        metrics.placements.labels(model, placed.placement).inc()
        metrics.running.labels(model).inc()

    def end(self, metrics: EdgeMetrics, model: str) -> None:
        """The generation is over (streamed or not, read or abandoned): give the slot
        back, end the prefill's lease if the decode never pulled it, and count it."""
        self.ticket.release()                   # drops on_preempt: nothing points back
        stream, stats = self.stream, self.stream.stats
        stream.close()
        if stats.pull_refused:
            metrics.prefill_fallbacks.labels(model).inc()
        if stats.prefill_first_token:
            metrics.prefill_first_tokens.labels(model).inc()
        for ms in stats.migrations:
            metrics.migrations.labels(model).inc()
            metrics.migration_seconds.labels(model).observe(ms / 1000)
        metrics.running.labels(model).dec()
        metrics.generation_tokens.labels(model).inc(stream.completion_tokens)
        metrics.kv_external_tokens.labels(model).inc(stats.decode_external_tokens)
        metrics.e2e.labels(model, stream.path).observe(time.perf_counter() - self.started)
        if stats.first_token_at is not None:
            metrics.ttft.labels(model, stream.path).observe(stats.first_token_at - self.started)
        observe_all(metrics.itl.labels(model, stream.path), stats.token_gaps)
        self._trace_end()

    def _trace_end(self) -> None:
        """End the generation's span, and log its line."""
        stream, stats = self.stream, self.stream.stats
        telemetry.end(stream.span, None if stream.finish_reason else "ended early",
                      pdserve__path=stream.path, pdserve__placement=stats.placed.placement,
                      pdserve__decode_worker=stream.decode_worker,
                      pdserve__migrations=len(stats.migrations),
                      attributes=genai.response_attributes(
                          stream.gen.request_id, stream.gen.model, stream.completion_tokens,
                          stream.finish_reason))
        log.info("request %s done: path=%s prompt=%d completion=%d finish=%s moves=%d %.0f ms",
                 stream.gen.request_id, stream.path, len(stream.gen.prompt_token_ids),
                 stream.completion_tokens, stream.finish_reason, len(stats.migrations),
                 (time.perf_counter() - self.started) * 1000)
