"""Cache salts in the router's keys: a tenant's prompt matches the blocks its own
requests left on a worker, never another tenant's, and an operator's shared prefix
matches across the group (pdserve/cache_salt.py)."""
from __future__ import annotations

from pdserve.cache_salt import plan, salt_key, shared
from pdserve.services.router.keystore import block_keys, salt_points, salted_block_keys
from pdserve.services.router.placement import Policy, place
from pdserve.services.router.prefix_index import PrefixIndex
from test_placement import BLOCK, _registry, _req

IDS = list(range(200, 240))                                  # 10 blocks


def _engine_events(index: PrefixIndex, worker: str, ids: list[int], salt: str) -> None:
    """The BlockStored events a vLLM engine publishes for `ids` under `salt`: each
    block's extra keys name the salt folded into its hash (services/worker/salted_blocks.py
    puts the shared form's two salts at their blocks)."""
    at = dict(plan(salt).folds(BLOCK))
    blocks = [(hash((worker, salt, i)), ids[i * BLOCK:(i + 1) * BLOCK], at.get(i, ""))
              for i in range(len(ids) // BLOCK)]
    index.stored(worker, None, blocks)


def test_a_salt_changes_every_key_and_two_salts_share_none():
    plain = block_keys(IDS, BLOCK).tolist()
    a = salted_block_keys(IDS, BLOCK, *salt_points("tenant-a", BLOCK)).tolist()
    b = salted_block_keys(IDS, BLOCK, *salt_points("tenant-b", BLOCK)).tolist()
    assert len(a) == len(b) == 10
    assert not set(a) & set(b) and not set(a) & set(plain)


def test_a_shared_prefix_keys_its_blocks_alike_and_the_rest_apart():
    """13 shared tokens: blocks 0-2 (12 tokens) shared, block 3 on salted per tenant."""
    a = salted_block_keys(IDS, BLOCK, *salt_points(shared(13, "g", "tenant-a"), BLOCK)).tolist()
    b = salted_block_keys(IDS, BLOCK, *salt_points(shared(13, "g", "tenant-b"), BLOCK)).tolist()
    group = salted_block_keys(IDS, BLOCK, salt_key("g")).tolist()
    assert a[:3] == b[:3] == group[:3]
    assert not set(a[3:]) & set(b[3:])
    everyone = salted_block_keys(IDS, BLOCK, *salt_points(shared(13, "", "tenant-a"),
                                                          BLOCK)).tolist()
    assert everyone[:3] == block_keys(IDS, BLOCK).tolist()[:3] and everyone[3:] != a[3:]


def test_the_index_keys_salted_events_as_placement_keys_prompts():
    for salt in ("tenant-a", shared(13, "g", "tenant-a"), shared(9, "", "tenant-a")):
        index = PrefixIndex(BLOCK)
        _engine_events(index, "d0", IDS, salt)
        keys = salted_block_keys(IDS, BLOCK, *salt_points(salt, BLOCK))
        assert index.matched_blocks(keys, ["d0"]) == {"d0": 10}, salt


def test_a_tenant_is_placed_on_its_own_prefix_and_never_scores_anothers():
    index = PrefixIndex(BLOCK)
    _engine_events(index, "d1", IDS, "tenant-a")
    decision, decode, _ = place(_registry(3), _req(IDS, cache_salt="tenant-a"), Policy(), index)
    assert decode.info.worker_id == "d1" and decision.cached_tokens == 39
    decision, _, _ = place(_registry(3), _req(IDS, cache_salt="tenant-b"), Policy(), index)
    assert decision.cached_tokens == 0
    decision, _, _ = place(_registry(3), _req(IDS), Policy(), index)     # no salt: none
    assert decision.cached_tokens == 0


def test_a_group_member_scores_the_shared_prefix_only():
    index = PrefixIndex(BLOCK)
    _engine_events(index, "d2", IDS, shared(13, "g", "tenant-a"))
    decision, decode, _ = place(_registry(3), _req(IDS, cache_salt=shared(13, "g", "tenant-b")),
                                Policy(), index)
    assert decode.info.worker_id == "d2" and decision.cached_tokens == 12


def test_a_stored_blocks_salt_is_its_text_extra_key():
    from smg_grpc_proto.generated import common_pb2
    from pdserve.services.router.probes import block_salt
    salted = common_pb2.KvBlock(block_hash=1, token_ids=[1, 2], extra_keys=[
        common_pb2.KvBlockExtraKey(number=7), common_pb2.KvBlockExtraKey(text="tenant-a")])
    assert block_salt(salted) == "tenant-a"
    assert block_salt(common_pb2.KvBlock(block_hash=2, token_ids=[3, 4])) == ""
