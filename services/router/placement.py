"""Where one request runs: a decode worker, and a prefill worker or local prefill.

The policy, in order:
1. **Bounded load** (consistent hashing with bounded loads, Mirrokni et al.): a
   decode worker is a candidate while `load + 1 <= ceil(balance * mean)`, or
   `<= ceil(mean) + balance_slack` if that is more (`mean = (total + 1) / n`),
   `load` being its engine's running + waiting requests as last reported plus
   what was placed there since. No worker runs more than `balance` x the mean,
   or `balance_slack` requests over it: at a few requests per worker a relative
   bound alone moves sessions off their KV for one request of imbalance (SMG's
   spill gate has an absolute margin for the same reason).
2. **Prefix, then session.** Among candidates, the worker holding the longest
   prefix of the prompt (from the engines' KV events, in whole blocks) wins.
   With a session key the remaining ties go by rendezvous hashing of the key,
   so a session's first turn has a stable home and later turns follow their KV;
   losing a worker moves only the sessions it held. Without a session the
   cost is `uncached prompt tokens + load_tokens * load`, ties by placements.
3. **Conditional disaggregation.** Remote prefill unless the decode worker
   already holds most of the prompt (`local_cached_fraction`), the uncached
   part is short (`local_below_tokens`), no prefill worker serves, or every
   prefill worker is saturated (`prefill_saturated` requests in flight, by the
   load its engine pushes; then the idle decode engine prefills). The
   prefill worker is the least-cost one by the same formula. The reason starts
   with one word the edge counts by: short, cached, no-prefill,
   prefill-saturated, remote.

Every input is either the request or state every router replica receives
alike (worker reports, KV events); a replica's own are the count of requests
placed since the last report and the prefixes it placed that the engines have
not reported yet (`PrefixIndex.placed`): two replicas agree again once the
workers' next events arrive, within a step of the engines.
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

from pdserve.config import RouterConfig
from pdserve.v1 import common_pb2, router_pb2

from .keystore import block_keys, unpacked
from .prefix_index import PrefixIndex
from .registry import WorkerEntry, WorkerRegistry


class NoWorkerError(Exception):
    """No decode worker can take the request."""


_DEFAULTS = RouterConfig()


@dataclass(frozen=True, slots=True)
class Policy:
    """The knobs of placement; the defaults are RouterConfig's (see `bench/README.md`,
    router section, for how they were chosen)."""

    balance: float = _DEFAULTS.balance                        # CHWBL's c: max / mean load
    balance_slack: int = _DEFAULTS.balance_slack              # ... or this many over the mean
    local_below_tokens: int = _DEFAULTS.local_prefill_below_tokens    # fewer uncached: local
    local_cached_fraction: float = _DEFAULTS.local_cached_fraction    # held this much: local
    prefill_saturated: int = _DEFAULTS.prefill_saturated      # this many in flight: full (0 off)
    load_tokens: int = 256              # one request in flight costs this many tokens to prefill


@functools.lru_cache(maxsize=1 << 16)
def _score(session_id: str, worker_id: str) -> int:
    """Rendezvous weight of a session on a worker (cached: a session's turns ask again)."""
    return int.from_bytes(hashlib.blake2b(f"{session_id}/{worker_id}".encode(),
                                          digest_size=8).digest(), "big")


def load(e: WorkerEntry) -> int:
    """A worker's requests in flight: last report plus what was placed since."""
    return e.load + e.pending


def load_cap(total: int, n: int, balance: float, slack: int) -> int:
    """The most requests one of `n` workers may run once one more joins their `total`:
    `balance` x the mean, or `slack` over the mean, whichever is more."""
    mean = (total + 1) / n
    return max(math.ceil(balance * mean), math.ceil(mean) + slack)


def bounded(candidates: list[WorkerEntry], balance: float, slack: int) -> list[WorkerEntry]:
    """The workers that may take one more request within the load cap."""
    cap = load_cap(sum(load(e) for e in candidates), len(candidates), balance, slack)
    return [e for e in candidates if load(e) + 1 <= cap] or candidates


def place(registry: WorkerRegistry, req: router_pb2.RouteRequest, policy: Policy,
          index: PrefixIndex | None = None
          ) -> tuple[router_pb2.RouteDecision, WorkerEntry, WorkerEntry | None]:
    """Decide placement; raises NoWorkerError when no decode worker serves."""
    exclude = set(req.exclude_workers)
    decoders = registry.serving(common_pb2.WORKER_ROLE_DECODE, req.model, exclude)
    if not decoders:
        raise NoWorkerError(f"no decode worker serves model {req.model!r}")
    packed = req.prompt_token_ids_packed
    ids = unpacked(packed) if packed else req.prompt_token_ids
    prompt = len(ids) or req.prompt_tokens
    block = index.block_size if index else 0
    keys = block_keys(ids, block) if block and ids else []

    def matched(entries: list[WorkerEntry]) -> dict[str, int]:
        if not keys:
            return {e.worker_id: 0 for e in entries}
        return index.matched_blocks(keys, [e.worker_id for e in entries])

    under = bounded(decoders, policy.balance, policy.balance_slack)
    held = matched(under)
    if req.session_id:
        session = req.session_id
        decode = max(under, key=lambda e: (held[e.worker_id], _score(session, e.worker_id)))
    else:
        decode = min(under, key=lambda e: ((len(keys) - held[e.worker_id]) * block
                                           + policy.load_tokens * load(e), e.routed,
                                           e.worker_id))
    # vLLM always computes the last prompt token itself, so at most prompt - 1 is cached.
    cached = min(prompt - 1, held[decode.worker_id] * block)
    prefill, reason = _prefill(registry, req, policy, prompt, cached, exclude, matched, block,
                               len(keys))
    if keys:
        index.placed(decode.worker_id, keys, held[decode.worker_id])
        if prefill is not None:
            index.placed(prefill.worker_id, keys)
    decision = router_pb2.RouteDecision(decode=decode.info, local_prefill=prefill is None,
                                        reason=reason, cached_tokens=cached)
    if prefill is not None:
        decision.prefill.CopyFrom(prefill.info)
    return decision, decode, prefill


def _prefill(registry, req, policy: Policy, prompt: int, cached: int, exclude, matched,
             block: int, n_keys: int) -> tuple[WorkerEntry | None, str]:
    """The prefill worker, or None for local prefill; and why."""
    uncached = prompt - cached
    if uncached < policy.local_below_tokens:
        return None, f"short: {uncached} uncached tokens < {policy.local_below_tokens}"
    if cached >= policy.local_cached_fraction * prompt:
        return None, f"cached: decode worker holds {cached} of {prompt} tokens"
    prefillers = registry.serving(common_pb2.WORKER_ROLE_PREFILL, req.model, exclude)
    if not prefillers:
        return None, "no-prefill: no prefill worker serves"
    # Only a load the engine pushes is fresh enough to call a worker full: a polled
    # one (read every few seconds) plus what was placed since overstates it.
    free = [e for e in prefillers if not (policy.prefill_saturated and e.load_pushed
                                          and load(e) >= policy.prefill_saturated)]
    if not free:
        return None, (f"prefill-saturated: every prefill worker has >= "
                      f"{policy.prefill_saturated} requests")
    held = matched(free)
    best = min(free, key=lambda e: ((n_keys - held[e.worker_id]) * block
                                    + policy.load_tokens * load(e), e.routed, e.worker_id))
    return best, f"remote: {uncached} uncached tokens"
