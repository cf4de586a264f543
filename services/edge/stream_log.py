"""Stream logs: every generation's events, in order, for whoever follows it.

A generation's events (the SSE `data:` payloads, already rendered as JSON
text) are numbered from 1 and appended to its `StreamLog`. A reader follows a
log from any sequence number: it gets what is there, then waits for more,
until the log is finished. Readers share the one log, so a reader costs no
memory of its own, and the slowest reader never holds up the writer or the
others. A log is bounded: it keeps its last `max_events` events, and lives
`ttl` seconds after it finishes (a reader that asks for older events is told
they are gone).

`MemoryStreams` keeps logs in this process. `stream_redis.RedisStreams` keeps
them in memory too and mirrors them into Redis Streams, so a reader can
follow from another edge replica.
"""
from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

from pdserve.config import EdgeConfig

DONE = "[DONE]"
_STREAM_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class StreamGone(Exception):
    """The stream id is unknown here, or its log expired."""


class EventsGone(Exception):
    """The reader asked for events the bounded log no longer holds."""


class BadPosition(Exception):
    """The reader asked to start after an event the stream never had."""


def valid_stream_id(stream_id: str) -> bool:
    return bool(_STREAM_ID.match(stream_id))


@dataclass(slots=True)
class Event:
    seq: int
    data: str                       # JSON text, or DONE


def numbered(seq: int, data: list[str]) -> list[Event]:
    """Events `seq`, `seq + 1`... holding `data`."""
    return [Event(seq + i, d) for i, d in enumerate(data)]


class StreamLog:
    """One generation's events; its readers are `Follower`s (`follow()`)."""

    def __init__(self, stream_id: str, max_events: int, ttl: float, owner: str = ""):
        self.stream_id = stream_id
        self.owner = owner                      # the key id that may read it ("" open)
        self.max_events = max_events
        self.ttl = ttl
        self.events: list[str] = []
        self.first_seq = 1                      # the seq of events[0]
        self.finished_at: float | None = None
        self._grew: asyncio.Event | None = None  # what waiting readers wait on
        # Keepalive: one timer per log wakes its readers every half keepalive
        # interval (not a timeout per reader per event, which cost 14 % of the
        # edge's CPU at 20,000 events/s).
        self._ticker: asyncio.TimerHandle | None = None
        self._listeners: list = []              # see listen()

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.events) - 1

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    def append(self, data: list[str]) -> None:
        if self.finished_at is not None or not data:
            return
        events = self.events
        events.extend(data)
        over = len(events) - self.max_events
        if over > 0:
            del events[:over]
            self.first_seq += over
        if self._grew is not None:
            self._wake()
        else:                                   # once per token: no call to _wake
            for listener in self._listeners:
                listener()

    def finish(self) -> None:
        """No more events; followers drain what is there and stop."""
        if not self.finished:
            self.finished_at = time.monotonic()
            if self._ticker is not None:
                self._ticker.cancel()
            self._wake()

    def _tick(self, period: float) -> None:
        self._wake()
        self._ticker = asyncio.get_running_loop().call_later(period, self._tick, period)

    def expired(self, now: float) -> bool:
        return self.finished_at is not None and now - self.finished_at > self.ttl

    def _wake(self) -> None:
        if (grew := self._grew) is not None:
            self._grew = None
            grew.set()
        for listener in self._listeners:
            listener()

    def check_position(self, after: int) -> None:
        """Raise if following from after `after` cannot give a gapless stream."""
        if after < 0 or after > self.last_seq and self.finished:
            raise BadPosition(f"the stream has {self.last_seq} events; cannot resume after "
                              f"event {after}")
        if after < self.first_seq - 1:
            raise EventsGone(f"events up to {self.first_seq - 1} of this stream are no longer "
                             f"kept; resume after event {self.first_seq - 1} or later")

    def follow(self, after: int = 0, idle: float | None = None) -> Follower:
        """A reader of the events after seq `after` (see Follower). A bad position
        raises here, before anything is read."""
        self.check_position(after)
        return Follower(self, after, idle)

    def listen(self, listener) -> None:
        """Call `listener()` on every change: events appended, the log finished, and
        the keepalive ticks of its readers. It runs inside the writer's call and must
        not raise."""
        self._listeners.append(listener)

    def unlisten(self, listener) -> None:
        self._listeners.remove(listener)


class Follower:
    """One reader's place in a log, from after seq `after`.

    Iterate it (async) for batches of events as they come, until the log finishes;
    with `idle`, an empty batch comes after that many seconds without events
    (keepalive time). Or, while the reader keeps up, take what is new with `take()`
    whenever the log calls a listener (`StreamLog.listen`): a socket writer does that
    from the appending call itself, with no task woken per event. Either way the
    place is the same, so a reader may switch between the two. A reader that falls
    so far behind that its next event is gone gets EventsGone. `on_open` runs when
    it is first read and `on_close` when it is closed after that (a reader that
    never read is no reader)."""

    __slots__ = ("log", "after", "idle", "_last", "_state", "on_open", "on_close")

    def __init__(self, log: StreamLog, after: int, idle: float | None):
        self.log, self.after, self.idle = log, after, idle
        self._last = 0.0                        # time.monotonic() it last got anything
        self._state = "new"                     # new | open | closed
        self.on_open = self.on_close = lambda: None

    def _open(self) -> None:
        if self._state == "new":
            self._state = "open"
            self._last = time.monotonic()
            log = self.log
            if self.idle is not None and log._ticker is None and not log.finished:
                log._tick(self.idle / 2)
            self.on_open()

    def take(self) -> list[Event]:
        """The events after the reader's place, now (maybe none); moves past them."""
        return numbered(*self.take_data())

    def take_data(self) -> tuple[int, list[str]]:
        """As `take()`, without an Event per event (the socket writer's step, once per
        token): the seq of the first event, and the events' data."""
        if self._state == "new":
            self._open()
        log, after = self.log, self.after
        if after < log.first_seq - 1:
            raise EventsGone(f"fell behind: events up to {log.first_seq - 1} are gone")
        start = after - log.first_seq + 1
        if start >= len(log.events):
            return after + 1, []
        data = log.events[start:]
        self.after = after + len(data)
        self._last = time.monotonic()
        return after + 1, data

    def keepalive_due(self) -> bool:
        """Whether the reader has been quiet for `idle` (it then counts as fed)."""
        if self.idle is None:
            return False
        now = time.monotonic()
        if now - self._last < self.idle:
            return False
        self._last = now
        return True

    def __aiter__(self) -> Follower:
        return self

    async def __anext__(self) -> list[Event]:
        if self._state == "closed":
            raise StopAsyncIteration
        log = self.log
        while True:
            if batch := self.take():
                return batch
            if log.finished:
                raise StopAsyncIteration
            if self.keepalive_due():
                return []                       # quiet for `idle`: a keepalive
            if log._grew is None:
                log._grew = asyncio.Event()
            await log._grew.wait()

    async def aclose(self) -> None:
        if self._state == "open":
            self.on_close()
        self._state = "closed"


class StreamStore(Protocol):
    """Where stream logs live: this process only, or shared by edge replicas."""

    def create(self, stream_id: str, owner: str) -> StreamLog: ...

    def append(self, log: StreamLog, data: list[str]) -> None: ...

    def finish(self, log: StreamLog) -> None: ...

    async def open(self, stream_id: str, after: int, idle: float | None, owner: str
                   ) -> AsyncIterator[list[Event]]:
        """A reader of the stream from after `after` (see StreamLog.follow); raises
        StreamGone (also when `owner` is not the stream's), EventsGone or
        BadPosition before anything is read."""
        ...

    async def cancel(self, stream_id: str, owner: str) -> bool:
        """Cancel a stream no generation of this process runs: True if one elsewhere
        will; False if it is over; StreamGone if unknown."""
        ...

    async def followed_elsewhere(self, stream_id: str) -> bool:
        """Whether a reader outside this process follows the stream now."""
        ...

    async def close(self) -> None: ...


class MemoryStreams:
    """Stream logs in this process; finished ones are dropped after their TTL."""

    def __init__(self, cfg: EdgeConfig):
        self.max_events = cfg.stream_max_events
        self.ttl = cfg.stream_ttl_seconds
        self.logs: dict[str, StreamLog] = {}
        self._swept = time.monotonic()
        self.on_cancel = lambda stream_id: False    # only other processes would call it

    def create(self, stream_id: str, owner: str = "") -> StreamLog:
        self._sweep()
        log = self.logs[stream_id] = StreamLog(stream_id, self.max_events, self.ttl, owner)
        return log

    # store.append(log, data) is log.append(data), with no call of its own between.
    append = staticmethod(StreamLog.append)

    def finish(self, log: StreamLog) -> None:
        log.finish()

    def find(self, stream_id: str, owner: str = "") -> StreamLog:
        log = self.logs.get(stream_id) if valid_stream_id(stream_id) else None
        # Someone else's stream is as unknown as one that never was.
        if log is None or log.expired(time.monotonic()) or log.owner != owner:
            raise StreamGone(f"no stream {stream_id!r} (unknown, or expired)")
        return log

    async def open(self, stream_id: str, after: int, idle: float | None, owner: str = ""
                   ) -> AsyncIterator[list[Event]]:
        return self.find(stream_id, owner).follow(after, idle)

    async def cancel(self, stream_id: str, owner: str = "") -> bool:
        self.find(stream_id, owner)
        return False                    # known, and not live here: over already

    async def followed_elsewhere(self, stream_id: str) -> bool:
        return False

    def _sweep(self) -> None:
        """Drop expired logs, at most once a second (creation pays for it)."""
        now = time.monotonic()
        if now - self._swept < 1.0:
            return
        self._swept = now
        for sid in [sid for sid, log in self.logs.items() if log.expired(now)]:
            del self.logs[sid]

    async def close(self) -> None:
        self.logs.clear()
