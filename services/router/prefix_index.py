"""Which worker holds which prompt prefix, from the engines' own KV-cache events.

A prompt is cut into full blocks of the engines' block size; block i's key
chains the keys before it with its token ids, so equal keys mean equal
prefixes (the same content hashing vLLM's prefix cache does, computed here from
the token ids so that it needs no vLLM code and every router replica computes
the same keys). Workers publish `BlockStored` (with each block's token ids and
its parent's engine hash) and `BlockRemoved` over `SubscribeKvEvents`; the index
maps each engine hash to the router's key, so a removal finds its block.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Sequence

ROOT = 0


def block_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """Chained keys of the full blocks of `token_ids` (a partial last block has none).

    Python's tuple-of-int hash is not salted per process, so every router replica
    gets the same keys from the same tokens.
    """
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, *token_ids[start:start + block_size]))
        keys.append(parent)
    return keys


class PrefixIndex:
    """Block keys per worker, kept from stored/removed events."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._holders: dict[int, set[str]] = defaultdict(set)      # key -> workers
        self._engine_keys: dict[str, dict[int, int]] = defaultdict(dict)  # worker: hash -> key

    def stored(self, worker: str, parent_hash: int | None,
               blocks: Iterable[tuple[int, Sequence[int]]]) -> None:
        """Blocks (engine hash, token ids) stored after the block `parent_hash`."""
        keys = self._engine_keys[worker]
        parent = ROOT if parent_hash is None else keys.get(parent_hash)
        if parent is None:
            return                        # its parent was never seen: not a prefix we can key
        for engine_hash, tokens in blocks:
            if len(tokens) != self.block_size:
                return
            parent = hash((parent, *tokens))
            keys[engine_hash] = parent
            self._holders[parent].add(worker)

    def removed(self, worker: str, engine_hashes: Iterable[int]) -> None:
        """Blocks the worker evicted."""
        keys = self._engine_keys.get(worker, {})
        for h in engine_hashes:
            key = keys.pop(h, None)
            if key is not None:
                holders = self._holders.get(key)
                if holders is not None:
                    holders.discard(worker)
                    if not holders:
                        del self._holders[key]

    def forget(self, worker: str) -> None:
        """The worker's cache is gone (cleared, restarted, or the worker left)."""
        self.removed(worker, list(self._engine_keys.get(worker, {})))
        self._engine_keys.pop(worker, None)

    def matched_blocks(self, keys: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """For each worker, how many leading blocks of `keys` it holds."""
        out = dict.fromkeys(workers, 0)
        alive = set(out)
        for depth, key in enumerate(keys):
            alive &= self._holders.get(key, set())
            if not alive:
                break
            for w in alive:
                out[w] = depth + 1
        return out

    def blocks_held(self, worker: str) -> int:
        """How many blocks the index thinks `worker` holds."""
        return len(self._engine_keys.get(worker, {}))
