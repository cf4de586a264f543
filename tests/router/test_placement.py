"""Placement with a prefix index and bounded loads, on a registry without gRPC."""
from __future__ import annotations

import random

from pdserve.v1 import common_pb2, router_pb2
from pdserve.services.router.keystore import ROOT, block_keys, chain, content_hash, packed, unpacked
from pdserve.services.router.placement import Policy, load, place
from pdserve.services.router.prefix_index import PrefixIndex
from pdserve.services.router.registry import WorkerRegistry

PREFILL, DECODE = common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE
BLOCK = 4


def _registry(decoders: int, prefillers: int = 1) -> WorkerRegistry:
    reg = WorkerRegistry(timeout=1e9)
    for role, n, name in ((DECODE, decoders, "d"), (PREFILL, prefillers, "p")):
        for i in range(n):
            reg.register(router_pb2.WorkerInfo(worker_id=f"{name}{i}", role=role, model="m",
                                               address=f"127.0.0.1:{1000 + i}", serving=True))
    return reg


def _store(index: PrefixIndex, worker: str, ids: list[int]) -> None:
    """Simulate the engine's BlockStored events for the full blocks of `ids`."""
    blocks = [(hash((worker, i)), ids[i * BLOCK:(i + 1) * BLOCK])
              for i in range(len(ids) // BLOCK)]
    index.stored(worker, None, blocks)


def _req(ids, session="", **kw) -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(model="m", prompt_token_ids=ids, session_id=session, **kw)


def test_block_keys_chain_the_prefix_and_ignore_a_partial_block():
    a, b = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), block_keys([1, 2, 3, 4, 5, 6, 7, 0], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert block_keys([9, 9, 9, 9, 1, 2, 3, 4], 4)[1] != a[0]   # same block, other prefix


def test_vectorized_keys_equal_the_chain_kv_events_are_keyed_with():
    ids = [random.Random(1).randrange(0, 1 << 32) for _ in range(16 * 300)]
    keys, parent = [], ROOT
    for i in range(300):
        parent = chain(parent, content_hash(ids[i * 16:(i + 1) * 16]))
        keys.append(parent)
    assert block_keys(ids, 16).tolist() == keys and len(set(keys)) == 300


def test_packed_and_repeated_token_ids_place_alike():
    """The edge sends the prompt packed (`prompt_token_ids_packed`); other callers may
    send the repeated field: the same prefix, the same worker and cached count."""
    ids = list(range(100, 140))
    got = []
    for req in (_req(ids), router_pb2.RouteRequest(model="m", prompt_token_ids_packed=packed(ids))):
        index = PrefixIndex(BLOCK)
        _store(index, "d2", ids[:24])
        decision, _, _ = place(_registry(3), req, Policy(), index)
        got.append((decision.decode.worker_id, decision.cached_tokens))
    assert got == [("d2", 24), ("d2", 24)]
    assert list(unpacked(packed([0, 1, 70000, (1 << 32) - 1]))) == [0, 1, 70000, (1 << 32) - 1]


def test_index_follows_stored_and_removed_events():
    PrefixIndex().stored("d0", None, [])          # no blocks, no block size yet: nothing
    index = PrefixIndex(BLOCK)
    ids = list(range(12))
    keys = block_keys(ids, BLOCK)
    _store(index, "d0", ids)
    index.stored("d1", None, [(7, ids[:4])])
    index.stored("d1", 7, [(8, ids[4:8])])                       # continues from its parent
    assert index.matched_blocks(keys, ["d0", "d1", "d2"]) == {"d0": 3, "d1": 2, "d2": 0}
    index.removed("d0", [hash(("d0", 1))])                       # evicts the middle block
    assert index.matched_blocks(keys, ["d0"]) == {"d0": 1}
    index.stored("d2", 999, [(5, ids[:4])])                      # unknown parent: not keyed
    index.forget("d1")
    assert index.matched_blocks(keys, ["d1", "d2"]) == {"d1": 0, "d2": 0}


def test_a_placed_prompt_counts_as_held_until_reported_or_expired():
    now = [0.0]
    reg = _registry(2, prefillers=0)
    index = PrefixIndex(BLOCK, provisional_ttl=10.0, clock=lambda: now[0])
    ids = list(range(12))
    keys = block_keys(ids, BLOCK)
    d = place(reg, _req(ids), Policy(), index)[1].info.worker_id
    other = "d1" if d == "d0" else "d0"
    assert index.matched_blocks(keys, [d, other]) == {d: 3, other: 0}
    _store(index, d, ids[:8])                                     # the engine reports 2 of 3
    now[0] = 11.0
    assert index.matched_blocks(keys, [d]) == {d: 2}              # the third one expired
    assert len(index.stores[d]) == 3                              # ... and is not swept yet
    went = place(reg, _req([50] * BLOCK), Policy(), index)[1].info.worker_id
    assert len(index.stores[d]) == 2 + (went == d)                # any placement sweeps
    index.forget(d)
    assert index.matched_blocks(keys, [d]) == {d: 0}


def test_a_burst_sharing_a_system_prompt_stays_together_before_any_event():
    reg, index = _registry(4), PrefixIndex(BLOCK)
    system = list(range(100, 400))
    chosen = {place(reg, _req(system + [i] * 8), Policy(balance=4.0), index)[1].info.worker_id
              for i in range(6)}
    assert len(chosen) == 1                                       # no events yet, still one home


def test_the_worker_holding_the_prefix_wins_without_a_session():
    reg, index = _registry(3), PrefixIndex(BLOCK)
    ids = list(range(400))
    _store(index, "d2", ids[:200])
    decision, decode, _ = place(reg, _req(ids), Policy(), index)
    assert decode.info.worker_id == "d2" and decision.cached_tokens == 200


def test_load_bound_spills_a_shared_prefix_instead_of_piling_on_one_worker():
    reg, index = _registry(4), PrefixIndex(BLOCK)
    system = list(range(100, 400))
    _store(index, "d0", system)
    chosen = []
    for i in range(40):
        _, decode, _ = place(reg, _req(system + [i, i, i, i]),
                             Policy(balance=1.25, balance_slack=0), index)
        reg.placed(decode)                                        # nothing finishes
        chosen.append(decode.info.worker_id)
        loads = [load(e) for e in reg.serving(DECODE)]
        assert max(loads) <= -(-1.25 * sum(loads) // 4)           # ceil(c * mean)
    assert chosen[0] == "d0" and set(chosen) == {"d0", "d1", "d2", "d3"}


def test_slack_keeps_a_session_home_a_few_requests_over_the_mean():
    # 3 requests on the session's home, none on the other worker: one more makes the
    # mean 2, so c = 1.25 caps a worker at 3 and the session spills; a slack of 2
    # requests caps it at 4, and it stays with its KV.
    def home_after(slack: int) -> str:
        reg, index = _registry(2), PrefixIndex(BLOCK)
        history = list(range(1, 201))
        _store(index, "d0", history)
        [d0] = [e for e in reg.serving(DECODE) if e.info.worker_id == "d0"]
        d0.reported(3)
        return place(reg, _req(history + [5] * 8, "s"), Policy(balance=1.25, balance_slack=slack),
                     index)[1].info.worker_id
    assert (home_after(0), home_after(2)) == ("d1", "d0")


def test_a_session_follows_its_kv_and_short_uncached_turns_prefill_locally():
    reg, index = _registry(2), PrefixIndex(BLOCK)
    turn1 = list(range(1, 301))
    d1, decode1, prefill1 = place(reg, _req(turn1, "s"), Policy(), index)
    assert not d1.local_prefill and prefill1 is not None and d1.reason.startswith("remote:")
    _store(index, decode1.info.worker_id, turn1 + [7] * 40)     # the prompt + its reply
    turn2 = turn1 + [7] * 40 + [9] * 60
    d2, decode2, prefill2 = place(reg, _req(turn2, "s"), Policy(), index)
    assert decode2 is decode1 and prefill2 is None and d2.local_prefill
    assert d2.cached_tokens == 340 and "holds 340 of 400" in d2.reason


def test_saturated_or_missing_prefill_pool_means_local_prefill():
    reg = _registry(1, prefillers=1)
    ids = list(range(500))
    [p] = reg.serving(PREFILL)
    p.load = 8
    d, _, prefill = place(reg, _req(ids), Policy(prefill_saturated=8), PrefixIndex(BLOCK))
    assert prefill is not None                    # a polled load is not trusted to say "full"
    p.load_pushed = True
    d, _, prefill = place(reg, _req(ids), Policy(prefill_saturated=8), PrefixIndex(BLOCK))
    assert prefill is None and "every prefill worker" in d.reason
    d, _, prefill = place(reg, _req(ids, exclude_workers=["p0"]), Policy(), PrefixIndex(BLOCK))
    assert prefill is None and "no prefill worker" in d.reason


def test_each_placement_no_report_covers_stops_counting_after_a_second():
    """A worker whose load reports stalled (or whose short requests ended between two
    ticks) is not read as busy for ever."""
    now = [0.0]
    reg = WorkerRegistry(timeout=6.0, clock=lambda: now[0])
    for i in range(2):
        reg.register(router_pb2.WorkerInfo(worker_id=f"d{i}", role=DECODE, address=f"h:{i}", model="m",
                                           serving=True))
    d0 = reg.workers["d0"]
    for at in (0.0, 0.0, 0.5):
        now[0] = at
        reg.placed(d0)
    now[0] = 0.9
    assert [load(e) for e in reg.serving(DECODE)] == [3, 0]
    _, decode, _ = place(reg, _req([1, 2, 3]), Policy(balance=1.25))
    assert decode.info.worker_id == "d1"                   # d0 is over the bound
    now[0] = 1.1
    assert [load(e) for e in reg.serving(DECODE)] == [1, 0]   # the two from t=0 aged out
    d0.reported(0)
    assert [load(e) for e in reg.serving(DECODE)] == [0, 0]
