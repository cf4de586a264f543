"""Which worker holds which prompt prefix, from the engines' own KV-cache events.

Prompts and blocks are keyed by `keystore.block_keys` (chained hashes of the
token ids in the engines' block size), salted where the engine salted them (a
block whose event names a cache salt: keystore.salted_block_keys keys a prompt
the same way); each worker's keys live in a `KeyStore`.
Workers publish `BlockStored` (with each block's token ids and its parent's
engine hash) and `BlockRemoved` over `SubscribeKvEvents`; the index maps each
engine hash to the router's key, so a removal finds its block.
"""
from __future__ import annotations

import itertools
import time
from collections import defaultdict
from typing import Iterable, Sequence

from pdserve.cache_salt import salt_key

from .keystore import ROOT, KeyStore, block_keys


def _salted_runs(blocks: list) -> list[tuple[str, list]]:
    """The blocks in runs that each start at a salted block (or the first block):
    (that block's salt or "", the run)."""
    runs: list[tuple[str, list]] = []
    for b in blocks:
        salt = b[2] if len(b) > 2 else ""
        if salt or not runs:
            runs.append((salt, [b]))
        else:
            runs[-1][1].append(b)
    return runs


class PrefixIndex:
    """Block keys per worker, kept from stored/removed events. The block size is the
    engines' (all workers of a model share it); 0 until the first event tells it.

    A prompt just placed on a worker counts as held there at once (the decision
    places its keys in the worker's store: placement.py_decide),
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
        self.stores: dict[str, KeyStore] = {}                       # worker -> its keys
        self._engine_keys: dict[str, dict[int, int]] = defaultdict(dict)  # worker: hash -> key

    def _store(self, worker: str) -> KeyStore:
        store = self.stores.get(worker)
        if store is None:
            store = self.stores[worker] = KeyStore()
        return store

    def stored(self, worker: str, parent_hash: int | None,
               blocks: Iterable[tuple[int, Sequence[int]] | tuple[int, Sequence[int], str]]
               ) -> None:
        """Blocks (engine hash, token ids[, the cache salt folded into its hash, if
        any]) stored after the block `parent_hash`."""
        blocks = list(blocks)
        if not self.block_size and blocks:
            self.block_size = len(blocks[0][1])
        keys, store = self._engine_keys[worker], self._store(worker)
        parent = ROOT if parent_hash is None else keys.get(parent_hash)
        if parent is None:
            return                        # its parent was never seen: not a prefix we can key
        full = list(itertools.takewhile(lambda b: len(b[1]) == self.block_size, blocks))
        for salt, run in _salted_runs(full):
            # A block the engine salted: its parent's key XOR the salt's (keystore.py).
            parent ^= salt_key(salt)
            tokens = [t for b in run for t in b[1]]
            for block, key in zip(run, block_keys(tokens, self.block_size, parent)):
                keys[block[0]] = parent = key
                store.confirm(key)

    def removed(self, worker: str, engine_hashes: Iterable[int]) -> None:
        """Blocks the worker evicted."""
        keys, store = self._engine_keys.get(worker, {}), self.stores.get(worker)
        for h in engine_hashes:
            key = keys.pop(h, None)
            if key is not None and store is not None:
                store.drop(key)

    def forget(self, worker: str) -> None:
        """The worker's cache is gone (cleared, restarted, or the worker left)."""
        self._engine_keys.pop(worker, None)
        self.stores.pop(worker, None)

    def matched_blocks(self, keys: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """For each worker, how many leading blocks of `keys` it holds."""
        now, stores = self.clock(), self.stores
        return {w: stores[w].match(keys, now) if w in stores else 0 for w in workers}

    def blocks_held(self, worker: str) -> int:
        """How many blocks the index thinks `worker` holds."""
        return len(self._engine_keys.get(worker, {}))
