"""A request's cache salt as the edge sends it, the worker applies it and the router keys it.

vLLM folds a request's `cache_salt` into the hash of its first KV block, so two
requests share cached blocks only when their salts are equal. pdserve's salt is
one string with two forms:

- plain (`S`): vLLM's own meaning, S folded into block 0 (the whole prompt salted);
- shared (`pdserve-shared:1:N:G:T`): block 0 salted with G (empty: no salt, the
  prefix is shared by everyone) and block N // block_size with T, so the whole
  blocks of the first N tokens (an operator's shared system prompt) are shared by
  all requests with the same G and what follows is T's alone (N under one block:
  T salts block 0, nothing is shared). Only pdserve's worker reads this form
  (services/worker/salted_blocks.py); an engine that does not treats the whole
  string as a plain salt, which isolates and shares nothing: never the reverse.

The edge sends it to the workers as `METADATA_KEY` on every Generate call (prefill
and decode legs, moved and restarted legs alike) and to the router in
`RouteRequest.cache_salt`. `salt_key` is the 64-bit form the router's prefix index
folds into its block keys (services/router/keystore.py): the parent key of the
salted block is XORed with it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

SHARED_TAG = "pdserve-shared:1:"
# The gRPC metadata that carries it from the edge to a worker's `Generate` (vLLM's
# engine protocol has no field for it).
METADATA_KEY = "pdserve-cache-salt"
MAX_SALT_BYTES = 1024           # what a worker accepts (the edge sends ~100)


@dataclass(frozen=True, slots=True)
class SaltPlan:
    """Where salts fold into a prompt's block hashes: `first` at block 0, `rest` at
    the block that holds token `at` (0 and "" when there is no second salt)."""

    first: str = ""
    at: int = 0
    rest: str = ""

    def folds(self, block_size: int) -> tuple[tuple[int, str], ...]:
        """(block index, salt) for each salt that folds in, in block order."""
        k = self.at // block_size if block_size else 0
        if not self.rest or k == 0:
            return ((0, self.rest or self.first),) if (self.rest or self.first) else ()
        return ((0, self.first), (k, self.rest)) if self.first else ((k, self.rest),)


def shared(tokens: int, group_salt: str, own_salt: str) -> str:
    """The salt that shares the whole blocks of the first `tokens` tokens among
    `group_salt`'s requests and salts the rest with `own_salt`."""
    if tokens <= 0 or not own_salt:
        return own_salt
    return f"{SHARED_TAG}{tokens}:{group_salt}:{own_salt}"


def plan(salt: str) -> SaltPlan:
    """Where `salt` folds in (a malformed shared form counts as a plain salt)."""
    if not salt.startswith(SHARED_TAG):
        return SaltPlan(first=salt)
    tokens, sep1, tail = salt[len(SHARED_TAG):].partition(":")
    group, sep2, own = tail.partition(":")
    if not (sep1 and sep2 and tokens.isdigit() and int(tokens) > 0 and own):
        return SaltPlan(first=salt)
    return SaltPlan(first=group, at=int(tokens), rest=own)


def salt_key(salt: str) -> int:
    """A salt as 64 bits for the router's block keys (0 for no salt)."""
    if not salt:
        return 0
    digest = hashlib.sha256(b"pdserve cache salt\0" + salt.encode()).digest()
    return int.from_bytes(digest[:8], "little") or 1
