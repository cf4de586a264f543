"""Block keys: a prompt's, and the ones each worker holds.

A prompt is cut into full blocks of the engines' block size; block i's key
chains the key before it with a hash of its token ids, so equal keys mean
equal prefixes (what vLLM's prefix cache does, computed here from the token ids
so that it needs no vLLM code and every router replica computes the same keys).
The hash is fast and the same in every process (no per-process salt), not
cryptographic: a crafted collision can only misplace a request, never serve
wrong KV, because the engine matches its own hashes.

Two implementations of `block_keys` and `KeyStore`: the C module `_placement`
(built with the package; what a router runs) and the Python below (the reference,
and what runs where no compiler built the module); pdserve.native picks one
(PDSERVE_NATIVE), for registry.py and placement.py alike. The C one exists for the
decision's latency: a router idle between requests meets them with cold caches,
and there a dozen numpy calls and a hundred dict lookups cost 3-6x what they
cost back to back (docs/design/2026-12-05-placement-in-c.md).
"""
from __future__ import annotations

import functools
import math
import sys
from array import array
from collections import deque
from typing import Sequence

import numpy as np

from pdserve import native
from pdserve.cache_salt import plan, salt_key

ROOT = 0
_MASK = (1 << 64) - 1
_MULT = 0x9E3779B97F4A7C15                 # odd: invertible mod 2^64
MAX_BLOCKS = 1 << 14


@functools.lru_cache(maxsize=8)
def _weights(block_size: int) -> np.ndarray:
    return np.array([pow(_MULT, j + 1, 1 << 64) for j in range(block_size)], dtype=np.uint64)


@functools.lru_cache(maxsize=1)
def _powers() -> tuple[np.ndarray, np.ndarray]:
    """_MULT^i and _MULT^-i mod 2^64, for i < MAX_BLOCKS."""
    inv = pow(_MULT, -1, 1 << 64)
    up, down, a, b = [], [], 1, 1
    for _ in range(MAX_BLOCKS):
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


def py_block_keys(token_ids, block_size: int, parent: int = ROOT) -> memoryview:
    """Keys of the full blocks of `token_ids` (a partial last block has none), as
    uint64s: key_i = chain(key_{i-1}, content_hash(block_i)), key_-1 = `parent` (ROOT:
    the blocks start a prompt; else the key of the block before them).

    Computed for all blocks at once: key_i = parent M^(i+1) + sum_j c_j M^(i-j)
    = M^i * (parent M + cumsum(c_j M^-j)), all mod 2^64.
    """
    ids = np.array(token_ids, dtype=np.uint64)
    n = min(len(ids) // block_size, MAX_BLOCKS)
    # A matrix-vector product wraps mod 2^64 like the elementwise form, at half its cost.
    contents = ids[:n * block_size].reshape(n, block_size) @ _weights(block_size)
    up, down = _powers()
    sums = np.cumsum(contents * down[:n], dtype=np.uint64) + np.uint64(parent * _MULT & _MASK)
    return memoryview((sums * up[:n]).tobytes()).cast("Q")


def packed(token_ids: Sequence[int]) -> bytes:
    """Token ids as `RouteRequest.prompt_token_ids_packed`: uint32, little-endian."""
    ids = array("I", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def unpacked(data: bytes) -> Sequence[int]:
    """The token ids of `prompt_token_ids_packed` (ValueError unless 4 bytes each)."""
    if len(data) % 4:
        raise ValueError(f"packed token ids are 4 bytes each; got {len(data)} bytes")
    if sys.byteorder == "big":
        ids = array("I", data)
        ids.byteswap()
        return ids
    return memoryview(data).cast("I")


class PyKeyStore:
    """One worker's block keys, each held until a time: `inf` once its engine
    reported the block, a finite time while it is only placed there (provisional)."""

    def __init__(self):
        self._until: dict[int, float] = {}
        self._placed: deque[tuple[int, float]] = deque()     # provisional, oldest first

    def match(self, keys, now: float) -> int:
        """How many leading `keys` are held at `now`."""
        until, depth = self._until, 0
        for key in keys:
            if until.get(key, 0.0) <= now:
                break
            depth += 1
        return depth

    def place(self, keys, start: int, until: float) -> None:
        """`keys[start:]` were placed here: held until `until`, unless reported."""
        if not 0 < until < math.inf:
            raise ValueError("until must be a finite time > 0")
        held = self._until
        for key in keys[max(start, 0):]:
            if held.get(key) != math.inf:
                held[key] = until
                self._placed.append((key, until))

    def confirm(self, key: int) -> None:
        """The engine reported the block: held for good (until dropped)."""
        self._until[key] = math.inf

    def drop(self, key: int) -> None:
        """The engine evicted the block."""
        self._until.pop(key, None)

    def expire(self, now: float) -> None:
        """Forget provisional keys whose time is up (not placed again, nor reported)."""
        placed, held = self._placed, self._until
        while placed and placed[0][1] <= now:
            key, until = placed.popleft()
            if held.get(key) == until:
                del held[key]

    def __len__(self) -> int:
        return len(self._until)


def salt_points(salt: str, block_size: int) -> tuple[int, int, int]:
    """A request's cache salt as its keys take it: (block 0's parent, the block a second
    salt folds into or 0, that salt's key). A salt folds in as the engine's does: into
    the hash of the block it starts at, here XORed into that block's parent key."""
    folds = plan(salt).folds(block_size) if salt else ()
    root = at = second = 0
    for index, part in folds:
        if index == 0:
            root = salt_key(part)
        else:
            at, second = index, salt_key(part)
    return root, at, second


def salted_block_keys(token_ids, block_size: int, root: int = ROOT, at: int = 0,
                      second: int = 0) -> memoryview:
    """`block_keys` of a salted prompt (`salt_points`): blocks before `at` chained from
    `root`, the rest from the key before them XOR `second`."""
    n = min(len(token_ids) // block_size, MAX_BLOCKS)
    if not 0 < at < n:
        return block_keys(token_ids, block_size, root)
    head = block_keys(token_ids[:at * block_size], block_size, root)
    tail = block_keys(token_ids[at * block_size:n * block_size], block_size,
                      head[-1] ^ second)
    return memoryview(head.tobytes() + tail.tobytes()).cast("Q")


_C = native.load("placement")
NATIVE = _C is not None
if NATIVE:
    KeyStore = _C.KeyStore

    def block_keys(token_ids, block_size: int, parent: int = ROOT) -> memoryview:
        """Keys of the full blocks of `token_ids`, as uint64s (see py_block_keys)."""
        return memoryview(_C.block_keys(token_ids, block_size, parent)).cast("Q")
else:
    KeyStore = PyKeyStore
    block_keys = py_block_keys
