"""Which worker holds which prompt prefix, from the engines' own KV-cache events.

A prompt is cut into full blocks of the engines' block size; block i's key
chains the key before it with a hash of its token ids, so equal keys mean
equal prefixes (what vLLM's prefix cache does, computed here from the token ids
so that it needs no vLLM code and every router replica computes the same keys).
The hash is fast and the same in every process (no per-process salt), not
cryptographic: a crafted collision can only misplace a request, never serve
wrong KV, because the engine matches its own hashes. Workers publish `BlockStored` (with each block's token ids and
its parent's engine hash) and `BlockRemoved` over `SubscribeKvEvents`; the index
maps each engine hash to the router's key, so a removal finds its block.
"""
from __future__ import annotations

import functools
import time
from collections import defaultdict
from typing import Iterable, Sequence

import numpy as np

ROOT = 0
_MASK = (1 << 64) - 1
_MULT = 0x9E3779B97F4A7C15                 # odd: invertible mod 2^64
_MAX_BLOCKS = 1 << 14


@functools.lru_cache(maxsize=8)
def _weights(block_size: int) -> np.ndarray:
    return np.array([pow(_MULT, j + 1, 1 << 64) for j in range(block_size)], dtype=np.uint64)


@functools.lru_cache(maxsize=1)
def _powers() -> tuple[np.ndarray, np.ndarray]:
    """_MULT^i and _MULT^-i mod 2^64, for i < _MAX_BLOCKS."""
    inv = pow(_MULT, -1, 1 << 64)
    up, down, a, b = [], [], 1, 1
    for _ in range(_MAX_BLOCKS):
        up.append(a)
        down.append(b)
        a, b = a * _MULT & _MASK, b * inv & _MASK
    return np.array(up, dtype=np.uint64), np.array(down, dtype=np.uint64)


def chain(parent: int, content: int) -> int:
    """The key of a block whose parent block has key `parent`."""
    return (parent * _MULT + content) & _MASK


def content_hash(tokens: Sequence[int]) -> int:
    """One block's content hash: a polynomial in its token ids mod 2^64."""
    return sum(t * w for t, w in zip(tokens, _weights(len(tokens)).tolist())) & _MASK


def block_keys(token_ids, block_size: int) -> list[int]:
    """Keys of the full blocks of `token_ids` (a partial last block has none):
    key_i = chain(key_{i-1}, content_hash(block_i)), key_-1 = ROOT.

    Computed for all blocks at once: key_i = sum_j c_j M^(i-j) = M^i * cumsum(c_j M^-j),
    all mod 2^64 (~15 us for 1,500 tokens; the router hashes every prompt it places).
    """
    ids = np.array(token_ids, dtype=np.uint64)
    n = min(len(ids) // block_size, _MAX_BLOCKS)
    if n == 0:
        return []
    # A matrix-vector product wraps mod 2^64 like the elementwise form, at half its cost.
    contents = ids[:n * block_size].reshape(n, block_size) @ _weights(block_size)
    up, down = _powers()
    return (np.cumsum(contents * down[:n], dtype=np.uint64) * up[:n]).tolist()


class PrefixIndex:
    """Block keys per worker, kept from stored/removed events. The block size is the
    engines' (all workers of a model share it); 0 until the first event tells it.

    A prompt just placed on a worker counts as held there at once (`placed`),
    before the engine has computed it and published its blocks: otherwise a burst
    of requests sharing a system prompt would scatter, each placed before the
    first one's blocks are reported. Such a provisional entry ends when the
    engine's `BlockStored` confirms it, or after `provisional_ttl` seconds.
    """

    def __init__(self, block_size: int = 0, provisional_ttl: float = 10.0,
                 clock=time.monotonic):
        self.block_size = block_size
        self.provisional_ttl = provisional_ttl
        self.clock = clock
        self._holders: dict[int, set[str]] = defaultdict(set)      # key -> workers
        self._engine_keys: dict[str, dict[int, int]] = defaultdict(dict)  # worker: hash -> key
        # worker -> {key: expiry}, oldest first (keys placed but not yet reported)
        self._provisional: dict[str, dict[int, float]] = defaultdict(dict)

    def placed(self, worker: str, keys: Sequence[int], held: int = 0) -> None:
        """`worker` was just given a prompt with these block keys, of which it holds the
        first `held` already."""
        now = self.clock()
        for w in list(self._provisional):
            self._expire(w, now)
        pending, until = self._provisional[worker], now + self.provisional_ttl
        for key in keys[held:]:
            holders = self._holders[key]
            if worker in holders and key not in pending:
                continue                              # reported already
            holders.add(worker)
            pending.pop(key, None)                    # re-placed: to the back of the line
            pending[key] = until

    def _expire(self, worker: str, now: float) -> None:
        pending = self._provisional.get(worker)
        while pending:
            key, until = next(iter(pending.items()))
            if until > now:
                return
            del pending[key]
            self._drop(key, worker)

    def _drop(self, key: int, worker: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[key]

    def stored(self, worker: str, parent_hash: int | None,
               blocks: Iterable[tuple[int, Sequence[int]]]) -> None:
        """Blocks (engine hash, token ids) stored after the block `parent_hash`."""
        blocks = list(blocks)
        if not self.block_size and blocks:
            self.block_size = len(blocks[0][1])
        keys = self._engine_keys[worker]
        parent = ROOT if parent_hash is None else keys.get(parent_hash)
        if parent is None:
            return                        # its parent was never seen: not a prefix we can key
        for engine_hash, tokens in blocks:
            if len(tokens) != self.block_size:
                return
            parent = chain(parent, content_hash(tokens))
            keys[engine_hash] = parent
            self._holders[parent].add(worker)
            self._provisional[worker].pop(parent, None)     # confirmed

    def removed(self, worker: str, engine_hashes: Iterable[int]) -> None:
        """Blocks the worker evicted."""
        keys = self._engine_keys.get(worker, {})
        for h in engine_hashes:
            key = keys.pop(h, None)
            if key is not None:
                self._drop(key, worker)

    def forget(self, worker: str) -> None:
        """The worker's cache is gone (cleared, restarted, or the worker left)."""
        self.removed(worker, list(self._engine_keys.get(worker, {})))
        self._engine_keys.pop(worker, None)
        for key in self._provisional.pop(worker, {}):
            self._drop(key, worker)

    def matched_blocks(self, keys: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """For each worker, how many leading blocks of `keys` it holds."""
        out = dict.fromkeys(workers, 0)
        alive, depth = set(out), 0
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                break
            if not alive <= holders:            # some workers' prefixes end here
                for w in alive - holders:
                    out[w] = depth
                alive &= holders
                if not alive:
                    break
            depth += 1
        for w in alive:
            out[w] = depth
        return out

    def blocks_held(self, worker: str) -> int:
        """How many blocks the index thinks `worker` holds."""
        return len(self._engine_keys.get(worker, {}))
