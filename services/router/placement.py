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
   With a session key the remaining ties go to the least loaded, then by
   rendezvous hashing of the key: a session's first turn (which shares at most a
   system prompt with others) goes where there is room, and later turns follow
   their KV; losing a worker moves only the sessions it held. (Ties by the hash
   alone left the load to the bound, which then spilled sessions off their KV:
   in `pdserve bench router --seeds 8` the load-first tie raised the hit rate
   from 0.853 to 0.868 median and kept the busiest worker within 1.20x the
   mean on every seed.) Without a session the cost is `uncached prompt tokens +
   load_tokens * load`, ties by placements.
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
not reported yet (provisional keys): two replicas agree again once the
workers' next events arrive, within a step of the engines.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from pdserve import native
from pdserve.config import RouterConfig
from pdserve.v1 import common_pb2, router_pb2

from .keystore import KeyStore, packed, salt_points, salted_block_keys, unpacked
from .prefix_index import PrefixIndex
from .registry import PENDING_SECONDS, WorkerEntry, WorkerRegistry, live, name_hash


class NoWorkerError(Exception):
    """No decode worker can take the request."""


_DEFAULTS = RouterConfig()
_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Policy:
    """The knobs of placement; the defaults are RouterConfig's (how they were chosen:
    docs/design/2026-12-05-placement-defaults.md)."""

    balance: float = _DEFAULTS.balance                        # CHWBL's c: max / mean load
    balance_slack: int = _DEFAULTS.balance_slack              # ... or this many over the mean
    local_below_tokens: int = _DEFAULTS.local_prefill_below_tokens    # fewer uncached: local
    local_cached_fraction: float = _DEFAULTS.local_cached_fraction    # held this much: local
    prefill_saturated: int = _DEFAULTS.prefill_saturated      # this many in flight: full (0 off)
    load_tokens: int = 256              # one request in flight costs this many tokens to prefill


def rendezvous(session: int, seed: int) -> int:
    """A session's weight on a worker (hashes by registry.name_hash): splitmix64's
    finalizer of the two, as the C decision computes it."""
    x = session ^ seed
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


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


# Why a request prefills where it does: decide()'s reason codes.
REMOTE, SHORT, CACHED, NO_PREFILL, SATURATED = range(5)


@dataclass(slots=True)
class Query:
    """What one decision is asked, beside the workers and the keys they hold: the
    request, the policy, and the clocks it is judged by (`place` makes one a request;
    nothing changes it)."""

    # NOTE: not frozen: a frozen dataclass's __init__ took 1.65 us here, this one 0.56.
    policy: Policy
    model: str
    prompt_ids: bytes = b""          # packed token ids (`prompt_token_ids_packed`)
    prompt_tokens: int = 0           # the prompt's length when no ids came
    session: str = ""
    exclude: frozenset[str] | None = None    # worker ids not to place on
    block: int = 0                   # the engines' block size (0: unknown, no keys)
    now: float = 0.0                 # the registry's clock,
    timeout: float = 10.0            # ... its heartbeat timeout,
    horizon: float = PENDING_SECONDS     # ... and how long a placement counts as load
    index_now: float = 0.0           # the prefix index's clock,
    ttl: float = 0.0                 # ... and how long a placed prefix counts as held
    salt: tuple[int, int, int] = (0, 0, 0)   # the cache salt (keystore.salt_points)


def place(registry: WorkerRegistry, req: router_pb2.RouteRequest, policy: Policy,
          index: PrefixIndex | None = None
          ) -> tuple[router_pb2.RouteDecision, WorkerEntry, WorkerEntry | None]:
    """Decide placement; raises NoWorkerError when no decode worker serves, ValueError
    for packed token ids of a broken length."""
    prompt_ids = req.prompt_token_ids_packed
    if not prompt_ids and req.prompt_token_ids:
        prompt_ids = packed(req.prompt_token_ids)        # a caller that sends them unpacked
    if index is None:
        index = _NO_INDEX
    query = Query(policy=policy, model=req.model, prompt_ids=prompt_ids,
                  prompt_tokens=req.prompt_tokens, session=req.session_id,
                  exclude=frozenset(req.exclude_workers) if req.exclude_workers else None,
                  block=index.block_size, now=registry.clock(), timeout=registry.timeout,
                  index_now=index.clock(), ttl=index.provisional_ttl,
                  salt=salt_points(req.cache_salt, index.block_size))
    decided = decide(registry.entries(), index.stores, query)
    if decided is None:
        raise NoWorkerError(f"no decode worker serves model {req.model!r}")
    decode, prefill, cached, reason, uncached, prompt = decided
    decision = router_pb2.RouteDecision(decode=decode.info, local_prefill=prefill is None,
                                        reason=_reason(reason, policy, cached, uncached, prompt),
                                        cached_tokens=cached)
    if prefill is not None:
        decision.prefill.CopyFrom(prefill.info)
    return decision, decode, prefill


@functools.lru_cache(maxsize=16)
def _knobs(policy: Policy) -> tuple:
    """The policy as the C decision reads it."""
    return (float(policy.balance), policy.balance_slack, policy.local_below_tokens,
            float(policy.local_cached_fraction), policy.prefill_saturated, policy.load_tokens)


def _reason(code: int, policy: Policy, cached: int, uncached: int, prompt: int) -> str:
    """The decision's reason; its first word is what the edge counts by."""
    if code == SHORT:
        return f"short: {uncached} uncached tokens < {policy.local_below_tokens}"
    if code == CACHED:
        return f"cached: decode worker holds {cached} of {prompt} tokens"
    if code == NO_PREFILL:
        return "no-prefill: no prefill worker serves"
    if code == SATURATED:
        return (f"prefill-saturated: every prefill worker has >= "
                f"{policy.prefill_saturated} requests")
    return f"remote: {uncached} uncached tokens"


def c_decide(workers, stores, q: Query):
    """The decision in C (`_placement.decide`, which takes the query's fields as they
    are): as py_decide."""
    return _C.decide(workers, stores, _knobs(q.policy), q.model, q.exclude, q.prompt_ids,
                     q.prompt_tokens, q.block, q.session, q.now, q.timeout, q.horizon,
                     q.index_now, q.ttl, *q.salt)


def py_decide(workers, stores, q: Query):
    """The decision, the Python reference of `c_decide`. `workers`: every registered
    worker; `stores`: worker id -> its KeyStore (a store is made for a worker placed
    without one). Returns None when no decode worker serves, else (decode, prefill or
    None for local prefill, cached tokens, reason code, uncached tokens, prompt tokens)."""
    p = q.policy
    model, now, timeout, block, index_now = q.model, q.now, q.timeout, q.block, q.index_now
    exclude = q.exclude or ()

    def serving(role: int) -> list:
        return live(workers, role, model, exclude, now, timeout)

    for e in workers:
        e.decay(now, q.horizon)
    decoders = serving(common_pb2.WORKER_ROLE_DECODE)
    if not decoders:
        return None
    ids = unpacked(q.prompt_ids)
    prompt = len(ids) or q.prompt_tokens
    keys = salted_block_keys(ids, block, *q.salt) if block and ids else []

    def matched(entries: list) -> list[int]:
        return [stores[e.worker_id].match(keys, index_now)
                if keys and e.worker_id in stores else 0 for e in entries]

    def least_cost(entries: list, held: list[int]) -> int:
        return min(range(len(entries)), key=lambda i: (
            (len(keys) - held[i]) * block + p.load_tokens * load(entries[i]),
            entries[i].routed, entries[i].worker_id))

    under = bounded(decoders, p.balance, p.balance_slack)
    held = matched(under)
    if q.session:
        h = name_hash(q.session)
        d = max(range(len(under)), key=lambda i: (held[i], -load(under[i]),
                                                  rendezvous(h, under[i].seed)))
    else:
        d = least_cost(under, held)
    decode, prefill = under[d], None
    # vLLM always computes the last prompt token itself, so at most prompt - 1 is cached.
    cached = min(prompt - 1, held[d] * block)
    uncached = prompt - cached
    prefill, reason = _where_to_prefill(
        p, uncached, cached, prompt,
        lambda: serving(common_pb2.WORKER_ROLE_PREFILL),
        lambda free: free[least_cost(free, matched(free))])
    if keys:                    # the placed prompt counts as held there, provisionally
        _hold(stores, keys, ((decode, held[d]), (prefill, 0)), index_now, index_now + q.ttl)
    return decode, prefill, cached, reason, uncached, prompt


def _where_to_prefill(p, uncached: int, cached: int, prompt: int, prefillers, pick):
    """(The prefill worker, or None for a prefill on the decode worker; the reason).
    `prefillers()`: the serving prefill workers (asked only when needed); `pick(free)`:
    the one of those not saturated to use."""
    if uncached < p.local_below_tokens:
        return None, SHORT
    if cached >= p.local_cached_fraction * prompt:
        return None, CACHED
    serving = prefillers()
    # Only a load the engine pushes is fresh enough to call a worker full: a polled
    # one (read every few seconds) plus what was placed since overstates it.
    free = [e for e in serving
            if not (p.prefill_saturated and e.load_pushed and load(e) >= p.prefill_saturated)]
    if not serving:
        return None, NO_PREFILL
    if not free:
        return None, SATURATED
    return pick(free), REMOTE


def _hold(stores, keys: list[int], placed, index_now: float, until: float) -> None:
    """Count `keys` as held from each (worker, first block) of `placed` on (a worker
    placed without a store gets one) until `until`, once expired entries are gone."""
    for store in stores.values():
        store.expire(index_now)
    for worker, start in placed:
        if worker is not None:
            store = stores.get(worker.worker_id)
            if store is None:
                store = stores[worker.worker_id] = KeyStore()
            store.place(keys, start, until)


class _NoIndex:
    """No prefix index: no block size, so no keys."""
    block_size, provisional_ttl, stores = 0, 0.0, {}
    clock = staticmethod(lambda: 0.0)


_NO_INDEX = _NoIndex()

_C = native.load("placement")
decide = py_decide if _C is None else c_decide
