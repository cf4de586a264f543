"""A worker's watch on its engine core: the process dies with it.

vLLM's `AsyncLLM` runs its engine core in a child process (on CPU too: pdserve's
single-rank engines run the model in that process, with no worker behind it). When
that process dies (OOM kill, a CUDA fault, a segfault in a kernel), AsyncLLM's
monitor thread marks the engine dead and every call on it fails from then on; the
worker's gRPC server, its heartbeats to the router and its TCP port would all go on
as if nothing had happened. `until_engine_dead` notices it; the worker then reports
NOT_SERVING on every health name (ENGINE_ALIVE included: the liveness probe's), leaves
the router, and exits with EXIT_ENGINE_DEAD so that its supervisor (`pdserve up`, the
kubelet) starts it afresh.
"""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

# The health name a liveness probe asks: SERVING from start until the engine dies.
# NOTE: unlike the service names, a drain leaves it SERVING (a draining worker is
# alive; a liveness failure then would kill the streams it is finishing).
ENGINE_ALIVE = "pdserve.v1.EngineAlive"
EXIT_ENGINE_DEAD = 70                   # sysexits' EX_SOFTWARE: restart me
CHECK_SECONDS = 0.2                     # how often the engine's state is read


class EngineDied(Exception):
    """The worker's engine core died: the worker must exit and be restarted."""


def engine_dead(llm) -> bool:
    """True once `llm` (an AsyncLLM) can run nothing more: its engine core process
    died (AsyncLLM's monitor thread saw it) or its output loop ended with an error."""
    return llm is None or bool(llm.errored)


async def until_engine_dead(llm, every: float = CHECK_SECONDS) -> None:
    """Return once `llm` is dead; checked every `every` seconds (a flag read: cheap)."""
    while not engine_dead(llm):
        await asyncio.sleep(every)
    log.error("engine core died; this worker stops serving and exits (code %d) to be "
              "restarted", EXIT_ENGINE_DEAD)
