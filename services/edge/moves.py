"""Where a generation goes on when its decode leg ends early.

A leg whose worker dies (the call fails), stalls or is cut off by its drain
is abandoned, and the generation migrates: the edge asks the router for
another decode worker (the failed one excluded for `decode_exclude_seconds`)
and starts a new leg whose prompt is the original prompt plus every token
already sent, asking only for the tokens still owed (`owed`). With temperature
0 the text equals an uninterrupted run's. With sampling and a seed, the
continuation is a correct sample but not the one the dead worker would have
drawn (the new engine's generator starts afresh), and presence/frequency
penalties forget the tokens generated before the move (they count output
tokens, which the new leg sees as prompt). A structured output cannot move
once started: the grammar's state lived in the failed engine.

A preempted generation (admission.py took its slot back for a tenant owed it)
is abandoned the same way, waits to be admitted again, and goes on as a moved
generation does, on whichever decode worker the router picks (the one it
left, usually: its prefix is cached there); that is a pause, not a migration.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from opentelemetry.trace import Span

from pdserve import telemetry
from pdserve.config import EdgeConfig
from pdserve.v1 import common_pb2

from .engine_requests import constrained
from .generation import Generation, deadline_passed
from .leg import DecodeLeg, Slot
from .openai_protocol import APIError
from .stats import GenerationStats, Placed

log = logging.getLogger("pdserve.edge")

# (generation, engine request id, prompt ids, workers to avoid) -> a new leg and its placement
Place = Callable[[Generation, str, list[int], set[str]], Awaitable[tuple[DecodeLeg, Placed]]]


def owed(sampling: common_pb2.SamplingParams, sent: int) -> common_pb2.SamplingParams | None:
    """What a leg is asked for once `sent` tokens are out: the rest of max_tokens and of
    min_tokens (the request's own sampling when none are); None when none is owed."""
    if not sent:
        return sampling
    rest = common_pb2.SamplingParams()
    rest.CopyFrom(sampling)
    rest.max_tokens -= sent
    rest.min_tokens = max(0, rest.min_tokens - sent)
    return rest if rest.max_tokens > 0 else None


class Mover:
    """Takes one generation on to its next leg, after a failure (`migrate`) or a
    preemption (`resume`); records each move's time in its stats."""

    __slots__ = ("gen", "cfg", "place", "stats", "span", "aborts", "failed")

    def __init__(self, gen: Generation, cfg: EdgeConfig, place: Place, stats: GenerationStats,
                 span: Span, aborts: set):
        self.gen, self.cfg, self.place, self.stats = gen, cfg, place, stats
        self.span, self.aborts = span, aborts
        self.failed: dict[str, float] = {}      # worker id -> when it failed this generation

    async def migrate(self, old: DecodeLeg, failure: str, sent: list[int]) -> DecodeLeg:
        """The next leg after `old` failed (`failure`: why), on another decode worker;
        raises the APIError that ends the stream when the generation cannot move."""
        rid, began = self.gen.request_id, time.perf_counter()
        old.abandon(self.aborts, f"request {rid} moved off {old.worker_id}")
        self.failed[old.worker_id] = time.monotonic()
        self._check_movable(old, failure, len(sent))
        log.warning("request %s: decode worker %s failed after %d tokens (%s); moving it",
                    rid, old.worker_id, len(sent), failure)
        migrations = self.stats.migrations
        leg = await self._next_leg(f"{rid}-m{len(migrations) + 1}", self._excluded, sent)
        migrations.append((time.perf_counter() - began) * 1000)
        log.info("request %s: moved from %s to %s in %.0f ms", rid, old.worker_id,
                 leg.worker_id, migrations[-1])
        return leg

    def _check_movable(self, old: DecodeLeg, failure: str, sent: int) -> None:
        """Raise the error that ends the stream if the generation may not move again."""
        rid, moves = self.gen.request_id, len(self.stats.migrations)
        if sent and constrained(self.gen.sampling):
            # The grammar's state lived in the failed engine: another would start it over.
            log.warning("request %s: decode worker %s failed (%s) after %d tokens of "
                        "structured output, which cannot move", rid, old.worker_id,
                        failure, sent)
            raise APIError(503, f"decode worker {old.worker_id} failed ({failure}); a "
                           "structured output cannot move to another worker once started",
                           type="service_unavailable")
        if moves >= self.cfg.max_migrations:
            log.warning("request %s: decode worker %s failed (%s); %d moves already, giving up",
                        rid, old.worker_id, failure, moves)
            raise APIError(503, f"decode worker {old.worker_id} failed ({failure}) and the "
                           f"generation already moved {moves} times",
                           type="service_unavailable")

    async def resume(self, old: DecodeLeg, slot: Slot | None, sent: list[int]) -> DecodeLeg:
        """After a preemption: abort `old`, wait to be admitted again (`slot.resume()`,
        within the request's deadline; no slot: at once), and place the rest."""
        rid, began = self.gen.request_id, time.perf_counter()
        old.abandon(self.aborts, f"request {rid} preempted")
        if slot is not None:
            try:
                async with asyncio.timeout(self.gen.remaining()):
                    await slot.resume()
            except TimeoutError:
                raise deadline_passed() from None
        preemptions = self.stats.preemptions
        leg = await self._next_leg(f"{rid}-p{len(preemptions) + 1}", set, sent)
        preemptions.append((time.perf_counter() - began) * 1000)
        log.info("request %s: preempted after %d tokens on %s, went on on %s after %.0f ms",
                 rid, len(sent), old.worker_id, leg.worker_id, preemptions[-1])
        return leg

    async def _next_leg(self, request_id: str, excluded: Callable[[], set[str]],
                        sent: list[int]) -> DecodeLeg:
        """Place the rest of the generation (its prompt plus every token sent) as a
        new leg, waiting a while for a decode worker to serve if none does. The
        workers to avoid are asked again at each try: one excluded for failing this
        generation is welcome again once its window has passed (the only decode
        worker of a small pool, which stalled for a moment, takes the rest then)."""
        wait_until = time.monotonic() + min(self.cfg.decode_place_wait_seconds,
                                            self.gen.remaining())
        prompt = self.gen.prompt_token_ids + sent
        while True:
            try:
                with telemetry.current(self.span):
                    leg, _ = await self.place(self.gen, request_id, prompt, excluded())
                return leg
            except APIError as e:
                if e.status != 503 or time.monotonic() >= wait_until:
                    raise
            await asyncio.sleep(0.25)           # no decode worker serves yet: wait for one

    def _excluded(self) -> set[str]:
        """Workers that failed this generation recently (a restarted one, with the same
        id, is welcome again once the window has passed)."""
        since = time.monotonic() - self.cfg.decode_exclude_seconds
        return {w for w, at in self.failed.items() if at > since}
