"""Where /v1/responses keeps its responses: for `GET /v1/responses/{id}`, cancel,
delete, and the conversation a `previous_response_id` continues.

A record is the Response object as the client last saw it, the conversation
(chat messages, instructions excluded: OpenAI does not carry them over), the
chain's session key, whether it runs in the background, and the API key id that
owns it: another key's lookup finds nothing, as for streams. Records expire
`response_ttl_seconds` after their last write. The events of a response are its
stream log's (stream_log.py), under the response's id.

`MemoryResponses` keeps records in this process, at most `MAX_RECORDS` (the
oldest go first). `RedisResponses` keeps them in Redis (`pdserve:response:<id>`)
when the stream store is Redis, so any replica answers; a write not yet in Redis
is answered from this process meanwhile.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from typing import Protocol

from pdserve.config import EdgeConfig

log = logging.getLogger("pdserve.edge")

MAX_RECORDS = 10_000                # per edge, in memory
TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})


class ResponseStore(Protocol):
    """Response records by id (see the module's docstring for a record's fields)."""

    def put(self, response_id: str, record: dict) -> None:
        """Write a record now (the edge running the response calls it as its status
        changes); readers on other replicas see it once it is stored."""
        ...

    async def stored(self, response_id: str) -> None:
        """Wait until the record's last write is where every replica reads it."""
        ...

    async def get(self, response_id: str, owner: str) -> dict | None:
        """The record, or None when unknown, expired or not `owner`'s."""
        ...

    async def delete(self, response_id: str, owner: str) -> bool:
        """Forget the record; False when there was none of `owner`'s."""
        ...

    async def close(self) -> None: ...


class MemoryResponses:
    """Records in this process, bounded in count and age."""

    def __init__(self, cfg: EdgeConfig, max_records: int = MAX_RECORDS):
        self.ttl, self.max_records = cfg.response_ttl_seconds, max_records
        self.records: OrderedDict[str, tuple[float, dict]] = OrderedDict()

    def put(self, response_id: str, record: dict) -> None:
        self.records.pop(response_id, None)
        self.records[response_id] = (time.monotonic() + self.ttl, record)
        while len(self.records) > self.max_records:
            self.records.popitem(last=False)
        self._sweep()

    def _sweep(self) -> None:
        """Drop expired records from the oldest end (they expire in write order)."""
        now = time.monotonic()
        while self.records and next(iter(self.records.values()))[0] < now:
            self.records.popitem(last=False)

    async def stored(self, response_id: str) -> None:
        return None                             # one process: stored when put

    async def get(self, response_id: str, owner: str) -> dict | None:
        return self.find(response_id, owner)

    def find(self, response_id: str, owner: str) -> dict | None:
        held = self.records.get(response_id)
        if held is None or held[0] < time.monotonic() or held[1]["owner"] != owner:
            return None
        return held[1]

    async def delete(self, response_id: str, owner: str) -> bool:
        if self.find(response_id, owner) is None:
            return False
        del self.records[response_id]
        return True

    async def close(self) -> None:
        self.records.clear()


def _key(response_id: str) -> str:
    return f"pdserve:response:{response_id}"


class RedisResponses:
    """Records in Redis, shared by the edge replicas of one stream store."""

    def __init__(self, cfg: EdgeConfig):
        import redis.asyncio as aioredis
        self.url, self.ttl = cfg.stream_store, cfg.response_ttl_seconds
        self.redis = aioredis.from_url(self.url, decode_responses=True)
        self.pending: dict[str, dict] = {}      # written here, not yet in Redis
        self._writing: asyncio.Task | None = None

    def put(self, response_id: str, record: dict) -> None:
        self.pending[response_id] = record
        if self._writing is None or self._writing.done():
            self._writing = asyncio.create_task(self._write(), name="response-store")

    async def _write(self) -> None:
        """Write what is pending, one pipeline per round (one writer at a time, so a
        later record of a response never lands before an earlier one)."""
        while self.pending:
            batch = dict(self.pending)
            pipe = self.redis.pipeline(transaction=False)
            for response_id, record in batch.items():
                pipe.set(_key(response_id), json.dumps(record), ex=max(1, int(self.ttl)))
            try:
                await pipe.execute()
            except Exception as e:  # noqa: BLE001 (Redis down: keep it here, try again)
                log.warning("response store %s: %s", self.url, e)
                await asyncio.sleep(1.0)
                continue
            for response_id, record in batch.items():
                if self.pending.get(response_id) is record:
                    del self.pending[response_id]

    async def stored(self, response_id: str) -> None:
        # Bounded: with Redis away the response still runs, and this replica answers.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                while response_id in self.pending and self._writing is not None:
                    await asyncio.shield(self._writing)

    async def get(self, response_id: str, owner: str) -> dict | None:
        record = self.pending.get(response_id)
        if record is None:
            raw = await self.redis.get(_key(response_id))
            record = json.loads(raw) if raw else None
        return record if record is not None and record["owner"] == owner else None

    async def delete(self, response_id: str, owner: str) -> bool:
        if await self.get(response_id, owner) is None:
            return False
        self.pending.pop(response_id, None)
        await self.redis.delete(_key(response_id))
        return True

    async def close(self) -> None:
        if self._writing is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._writing, 2.0)
        await self.redis.aclose()


def open_responses(cfg: EdgeConfig) -> ResponseStore:
    """The response store beside the stream store an EdgeConfig names."""
    if cfg.stream_store.startswith("redis://"):
        return RedisResponses(cfg)
    return MemoryResponses(cfg)
