"""Stream logs shared by edge replicas, in Redis Streams (`--stream-store redis://…`).

The replica running a generation keeps its log in memory (its own readers
follow that, with no round trip) and mirrors every event into the Redis
stream `pdserve:stream:<id>`, entry id `<seq>-0`, trimmed to the log's bound
and expiring with its TTL. A reader on any other replica finds the stream
there and follows it with `XREAD BLOCK` from `Last-Event-ID`; the `[DONE]`
event ends it, as it ends every stream.

Across replicas, the owner must not abandon a generation that a reader on
another replica follows: such a reader keeps a key `…:reader` alive while it
reads, and the owner checks it before cancelling. A cancel sent to a replica
that does not run the generation is published on `pdserve:stream-cancel`,
and the owner acts on it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Callable

import redis.asyncio as aioredis

from pdserve.config import EdgeConfig

from .stream_log import DONE, BadPosition, Event, EventsGone, MemoryStreams, StreamGone, \
    StreamLog, valid_stream_id

log = logging.getLogger("pdserve.edge")

CANCEL_CHANNEL = "pdserve:stream-cancel"
_BLOCK_MS = 1000                # a remote reader re-checks (and says it is there) this often


def _key(stream_id: str) -> str:
    return f"pdserve:stream:{stream_id}"


class RedisStreams:
    """MemoryStreams for this replica's generations, mirrored into Redis."""

    def __init__(self, cfg: EdgeConfig):
        self.url = cfg.stream_store                 # redis://HOST:PORT
        self.local = MemoryStreams(cfg)
        self.max_events = cfg.stream_max_events
        self.ttl = cfg.stream_ttl_seconds
        self.redis = aioredis.from_url(self.url, decode_responses=True)
        self._pending: list[tuple[str, int, list[str], bool, str | None]] = []
        self._flushing: asyncio.Task | None = None
        self._listener: asyncio.Task | None = None
        self.on_cancel: Callable[[str], bool] = lambda stream_id: False

    # --- the owner's side: mirror what is appended -------------------------
    def create(self, stream_id: str, owner: str = "") -> StreamLog:
        self._listen()
        log = self.local.create(stream_id, owner)
        self._queue(stream_id, 0, [], finished=False, owner=owner)
        return log

    def append(self, log: StreamLog, data: list[str]) -> None:
        first = log.last_seq + 1
        log.append(data)
        self._queue(log.stream_id, first, data, finished=False)

    def finish(self, log: StreamLog) -> None:
        log.finish()
        self._queue(log.stream_id, log.last_seq + 1, [], finished=True)

    def _queue(self, stream_id: str, first: int, data: list[str], finished: bool,
               owner: str | None = None) -> None:
        self._pending.append((stream_id, first, data, finished, owner))
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.create_task(self._flush(), name="stream-mirror")

    async def _flush(self) -> None:
        """Write everything queued in one pipeline per round (events stay in order:
        one flusher at a time)."""
        while self._pending:
            batch, self._pending = self._pending, []
            pipe = self.redis.pipeline(transaction=False)
            for stream_id, first, data, finished, owner in batch:
                key, ttl = _key(stream_id), int(self.ttl) + (0 if finished else 3600)
                if owner is not None:
                    pipe.set(f"{key}:owner", owner, ex=ttl)
                for i, d in enumerate(data):
                    pipe.xadd(key, {"d": d}, id=f"{first + i}-0", maxlen=self.max_events,
                              approximate=True)
                if data or finished:
                    pipe.expire(key, ttl)
                    pipe.expire(f"{key}:owner", ttl)
            try:
                await pipe.execute()
            except Exception as e:  # noqa: BLE001 (Redis down must not stop local streams)
                log.warning("stream mirror to %s failed: %s", self.url, e)

    # --- cancels from other replicas ---------------------------------------
    def _listen(self) -> None:
        if self._listener is None:
            self._listener = asyncio.create_task(self._cancels(), name="stream-cancels")

    async def _cancels(self) -> None:
        while True:
            try:
                async with self.redis.pubsub() as sub:
                    await sub.subscribe(CANCEL_CHANNEL)
                    async for msg in sub.listen():
                        if msg.get("type") == "message":
                            self.on_cancel(msg["data"])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                log.warning("stream cancel channel on %s: %s; retrying", self.url, e)
                await asyncio.sleep(1.0)

    async def cancel(self, stream_id: str, owner: str = "") -> bool:
        """Ask the replica running `stream_id` to cancel it; False if no replica
        has it live (unknown, or finished)."""
        last = await self._last(stream_id, owner)
        if last is None:
            raise StreamGone(f"no stream {stream_id!r} (unknown, or expired)")
        if last[1] == DONE:
            return False
        await self.redis.publish(CANCEL_CHANNEL, stream_id)
        return True

    async def followed_elsewhere(self, stream_id: str) -> bool:
        """Whether a reader on another replica is following the stream now."""
        with contextlib.suppress(Exception):
            return bool(await self.redis.exists(f"{_key(stream_id)}:reader"))
        return False

    # --- readers -----------------------------------------------------------
    async def _last(self, stream_id: str, owner: str) -> tuple[int, str] | None:
        """The stream's last event, or None when unknown here or not `owner`'s."""
        if not valid_stream_id(stream_id):
            return None
        if (await self.redis.get(f"{_key(stream_id)}:owner") or "") != owner:
            return None
        entries = await self.redis.xrevrange(_key(stream_id), count=1)
        if not entries:
            return None
        ident, fields = entries[0]
        return int(ident.split("-")[0]), fields["d"]

    async def open(self, stream_id: str, after: int, idle: float | None, owner: str = ""
                   ) -> AsyncIterator[list[Event]]:
        if stream_id in self.local.logs:
            return await self.local.open(stream_id, after, idle, owner)
        last = await self._last(stream_id, owner)
        if last is None:
            raise StreamGone(f"no stream {stream_id!r} (unknown, or expired)")
        first = await self.redis.xrange(_key(stream_id), count=1)
        first_seq = int(first[0][0].split("-")[0]) if first else last[0]
        if after < 0 or (after > last[0] and last[1] == DONE):
            raise BadPosition(f"the stream has {last[0]} events; cannot resume after "
                              f"event {after}")
        if after < first_seq - 1:
            raise EventsGone(f"events up to {first_seq - 1} of this stream are no longer "
                             f"kept; resume after event {first_seq - 1} or later")
        return self._follow(stream_id, after, idle)

    async def _follow(self, stream_id: str, after: int, idle: float | None
                      ) -> AsyncIterator[list[Event]]:
        key, quiet = _key(stream_id), 0.0
        while True:
            await self.redis.set(f"{key}:reader", "1", px=_BLOCK_MS * 3)
            got = await self.redis.xread({key: f"{after}-0"}, count=512, block=_BLOCK_MS)
            batch = [Event(int(ident.split("-")[0]), fields["d"])
                     for _, entries in got for ident, fields in entries]
            if batch:
                quiet = 0.0
                after = batch[-1].seq
                yield batch
                if batch[-1].data == DONE:
                    return
                continue
            if not await self.redis.exists(key):
                return                              # expired under the reader
            quiet += _BLOCK_MS / 1000
            if idle is not None and quiet >= idle:
                quiet = 0.0
                yield []

    async def close(self) -> None:
        if self._flushing is not None:
            with contextlib.suppress(Exception):
                await self._flushing
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
        await self.local.close()
        await self.redis.aclose()
