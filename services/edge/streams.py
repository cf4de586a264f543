"""Live generations and who reads them.

A streamed request's generation runs in a task of its own (the producer),
which renders the decode worker's chunks into the stream's log; the client
that asked, and anyone else with the stream id, are readers of that log. So
the generation does not depend on any one connection:

- an explicit cancel (`cancel()`: WebSocket `cancel`, `DELETE /v1/streams/{id}`,
  an Inference `Abort`) stops the producer at once, which aborts the request on
  the decode worker and frees its KV;
- when the last reader goes away without a cancel, the generation runs on for
  `resume_seconds` (a client may come back with `Last-Event-ID`); if nobody
  does, it is cancelled the same way.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from pdserve.config import EdgeConfig

from . import openai_protocol as oai
from .admitted import AdmittedGeneration
from .events import error_payload
from .stream_log import DONE, Event, MemoryStreams, StreamLog, StreamStore

log = logging.getLogger("pdserve.edge")

# Appends a batch of payloads to a stream's log, synchronously.
Append = Callable[[list[str]], None]


def open_store(cfg: EdgeConfig) -> StreamStore:
    """The stream store an EdgeConfig names."""
    if cfg.stream_store.startswith("redis://"):
        from .stream_redis import RedisStreams
        return RedisStreams(cfg)
    return MemoryStreams(cfg)


def new_stream_id() -> str:
    return f"str_{secrets.token_hex(16)}"


@dataclass(eq=False)
class LiveStream:
    """A generation in progress on this edge."""

    stream_id: str
    log: StreamLog
    generation: AdmittedGeneration
    task: asyncio.Task | None = None
    readers: int = 0
    # A failure before any output: the client that asked gets it as an HTTP
    # error, not as an event in a 200 stream.
    error: oai.APIError | None = None
    ended: str = ""                     # finished | cancelled | abandoned | failed
    cancel_reason: str = ""
    detached: bool = False              # runs on without readers (a background response)
    # The last events of a failed or cancelled stream (None: one error event).
    ending: Callable[[oai.APIError], list[str]] | None = None
    _abandon: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def owner(self) -> str:
        """The key id that started it ("" open): its log's."""
        return self.log.owner


class Streams:
    """The live generations of this edge, by stream id."""

    def __init__(self, cfg: EdgeConfig, store: StreamStore,
                 on_start: Callable[[], None] = lambda: None,
                 on_end: Callable[[LiveStream], None] = lambda live: None):
        self.store = store
        self.resume_seconds = cfg.stream_resume_seconds
        self.on_start = on_start
        self.on_end = on_end
        self.live: dict[str, LiveStream] = {}
        store.on_cancel = lambda stream_id: self.cancel(stream_id, "cancelled on another "
                                                                   "edge replica")

    def start(self, generation: AdmittedGeneration,
              render: Callable[[Append], AsyncIterator[list[str]]], owner: str = "",
              stream_id: str = "", detached: bool = False,
              ending: Callable[[oai.APIError], list[str]] | None = None) -> LiveStream:
        """Run the generation in its own task; its events go to a new log that only
        `owner` (a key id) may read or cancel. `render(append)` gives the payload
        batches of the generation's chunks; it may also hand `append` a batch itself,
        synchronously (a steady output goes to the log from the call that read it,
        no task woken for it: LegCall.chunks). `stream_id`: the log's id (default: a
        new one); `detached`: never abandoned for want of readers; `ending`: renders
        the last events of a failure or a cancel."""
        sid = stream_id or new_stream_id()
        live = LiveStream(sid, self.store.create(sid, owner), generation, detached=detached,
                          ending=ending)
        payloads = render(functools.partial(self.store.append, live.log))
        live.task = asyncio.create_task(self._produce(live, payloads), name=f"stream-{sid}")
        # A task cancelled before its first step never runs its body: end it here then.
        live.task.add_done_callback(lambda task: self._ended(live))
        self.live[sid] = live
        self.on_start()
        return live

    async def _produce(self, live: LiveStream, payloads: AsyncIterator[list[str]]) -> None:
        try:
            async with contextlib.aclosing(payloads) as batches:
                async for batch in batches:
                    self.store.append(live.log, batch)
            live.ended = "finished"
        except oai.APIError as e:
            live.ended = "failed"
            if live.log.last_seq == 0:
                live.error = e
            self.store.append(live.log, self._last_events(live, e))
        except asyncio.CancelledError:
            # Ours alone: nothing awaits this task, so the cancellation ends here.
            self._cancelled(live)
        except Exception as e:  # noqa: BLE001 (a bug must still end the stream cleanly)
            log.exception("stream %s failed", live.stream_id)
            live.ended = "failed"
            self.store.append(live.log, self._last_events(live, oai.APIError(
                500, f"internal error: {type(e).__name__}", type="internal_error")))
        finally:
            self._ended(live)

    @staticmethod
    def _last_events(live: LiveStream, e: oai.APIError) -> list[str]:
        return live.ending(e) if live.ending is not None else [error_payload(e)]

    def _cancelled(self, live: LiveStream) -> None:
        live.ended = live.ended or "cancelled"          # "abandoned" stays
        self.store.append(live.log, self._last_events(live, oai.APIError(
            499, f"the stream was cancelled ({live.cancel_reason or 'cancelled'})",
            type="cancelled", code="stream_cancelled")))

    def _ended(self, live: LiveStream) -> None:
        """Close the log and account for the end, once."""
        if live.log.finished:
            return
        if not live.ended:                      # cancelled before it ever ran
            self._cancelled(live)
        self.store.append(live.log, [DONE])
        self.store.finish(live.log)
        if live._abandon is not None:
            live._abandon.cancel()
        self.live.pop(live.stream_id, None)
        self.on_end(live)

    async def read(self, stream_id: str, after: int = 0, idle: float | None = None,
                   owner: str = "") -> AsyncIterator[list[Event]]:
        """A reader from after event `after`: a Follower (stream_log) of the log when
        the generation runs here. Raises StreamGone (also for another key's stream),
        EventsGone or BadPosition (stream_log) before anything is read."""
        live = self.live.get(stream_id)
        if live is None or live.owner != owner:
            return await self.store.open(stream_id, after, idle, owner)
        follower = live.log.follow(after, idle)
        follower.on_open = lambda: self._reader_came(live)
        follower.on_close = lambda: self._reader_left(live)
        return follower

    @staticmethod
    def _reader_came(live: LiveStream) -> None:
        live.readers += 1
        if live._abandon is not None:
            live._abandon.cancel()
            live._abandon = None

    def _reader_left(self, live: LiveStream) -> None:
        live.readers -= 1
        if live.readers == 0 and not live.log.finished and not live.detached:
            live._abandon = asyncio.get_running_loop().call_later(
                self.resume_seconds, self._abandoned, live)

    def _abandoned(self, live: LiveStream) -> None:
        live._abandon = None
        asyncio.ensure_future(self._abandon_unless_followed(live))

    async def _abandon_unless_followed(self, live: LiveStream) -> None:
        if live.readers or live.log.finished:
            return
        if await self.store.followed_elsewhere(live.stream_id):
            # A reader on another edge replica follows it: look again later.
            live._abandon = asyncio.get_running_loop().call_later(
                self.resume_seconds, self._abandoned, live)
            return
        log.info("stream %s: no reader came back in %.1f s; cancelling", live.stream_id,
                 self.resume_seconds)
        live.ended = "abandoned"
        self.cancel(live.stream_id, "no reader came back")

    async def cancel_anywhere(self, stream_id: str, reason: str, owner: str = "") -> bool:
        """Cancel `owner`'s stream here, or on the replica that runs it (shared
        store); False if it is over, StreamGone if unknown (or not `owner`'s)."""
        live = self.live.get(stream_id)
        if live is not None and live.owner == owner and self.cancel(stream_id, reason):
            return True
        return await self.store.cancel(stream_id, owner)

    def cancel(self, stream_id: str, reason: str) -> bool:
        """Stop a live generation now (the decode worker aborts it); False if it is
        not running here."""
        live = self.live.get(stream_id)
        if live is None or live.task is None or live.task.done():
            return False
        live.cancel_reason = reason
        live.task.cancel()
        return True

    async def wait_idle(self, timeout: float) -> None:
        """Wait (up to `timeout` s) until no generation is live here."""
        tasks = [live.task for live in self.live.values() if live.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    async def cut(self, reason: str) -> None:
        """Cancel every live generation and wait for them to end (their readers get
        the end, with `reason`)."""
        tasks = [live.task for live in self.live.values() if live.task is not None]
        for sid in list(self.live):
            self.cancel(sid, reason)
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Cancel every live generation, wait for them to end, close the store."""
        await self.cut("the edge is shutting down")
        await self.store.close()
