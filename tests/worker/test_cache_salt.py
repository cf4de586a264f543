"""A worker call's cache salt reaches vLLM's prompt, and the shared form salts the block
after the shared prefix in vLLM's own block hasher (no engine: its functions)."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.cache_salt import METADATA_KEY, shared
from pdserve.services.worker import salted_blocks
from pdserve.services.worker.request_salt import CURRENT, SaltedEngine, salt_of

BLOCK = 16


class _Request:
    """What vLLM's hasher reads of a request."""

    def __init__(self, ids: list[int], salt: str | None):
        self.all_token_ids, self.num_tokens, self.cache_salt = ids, len(ids), salt
        self.block_hashes: list = []
        self.mm_features, self.lora_request, self.prompt_embeds = [], None, None


@pytest.fixture(scope="module")
def hashes():
    """The block hashes vLLM computes for (token ids, salt), with pdserve's wrapper."""
    utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    assert salted_blocks.install() and salted_blocks.install()       # idempotent
    from vllm.utils.hashing import sha256
    utils.init_none_hash(sha256)
    hasher = utils.get_request_block_hasher(BLOCK, sha256)
    return lambda ids, salt: hasher(_Request(ids, salt))


def test_a_shared_prefix_hashes_alike_and_the_rest_apart(hashes):
    ids = list(range(1000, 1000 + 6 * BLOCK))
    a = hashes(ids, shared(2 * BLOCK + 5, "group", "tenant-a"))
    b = hashes(ids, shared(2 * BLOCK + 5, "group", "tenant-b"))
    group = hashes(ids, "group")                    # vLLM's own: the group's salt at block 0
    assert a[:2] == b[:2] == group[:2]
    assert not set(a[2:]) & set(b[2:]) and a[2:] != group[2:]
    everyone = hashes(ids, shared(2 * BLOCK, "", "tenant-a"))
    assert everyone[:2] == hashes(ids, None)[:2] and everyone[2:] != a[2:]


def test_a_plain_salt_is_left_to_vllm(hashes):
    ids = list(range(7, 7 + 3 * BLOCK))
    a, b, none = hashes(ids, "tenant-a"), hashes(ids, "tenant-b"), hashes(ids, None)
    assert not set(a) & set(b) and not set(a) & set(none)


def test_the_calls_salt_goes_into_the_prompt_it_runs():
    seen = []

    class Engine:
        errored = False

        def generate(self, prompt, **kw):
            seen.append(prompt)

    engine = SaltedEngine(Engine())
    assert engine.errored is False                      # the rest is the engine's

    async def call(salt: str, prompt: dict):
        CURRENT.set(salt)
        await asyncio.sleep(0)
        engine.generate(prompt=prompt, request_id="r")

    async def main():
        await asyncio.gather(call("a", {"prompt_token_ids": [1]}), call("", {"x": 1}),
                             call("b", {"cache_salt": "image"}))
    asyncio.run(main())
    assert seen == [{"prompt_token_ids": [1], "cache_salt": "a"}, {"x": 1},
                    {"cache_salt": "b|image"}]


def test_a_salt_that_is_too_long_is_refused():
    assert salt_of([(METADATA_KEY, "s")]) == ("s", None)
    assert salt_of(None) == ("", None)
    assert salt_of([(METADATA_KEY, "s" * 2000)])[1]


def test_a_pull_lands_only_under_the_salt_its_blocks_were_computed_under():
    from pdserve.transfer.params import SALT_TAG, salt_mismatch, with_salt_tag
    a = with_salt_tag({"remote_block_ids": [1]}, "tenant-a")
    assert "tenant-a" not in str(a[SALT_TAG])                 # a digest, not the salt
    assert not salt_mismatch(a, "tenant-a") and salt_mismatch(a, "tenant-b")
    assert salt_mismatch(a, "") and not salt_mismatch(with_salt_tag({}, ""), "")
    assert not salt_mismatch({"remote_block_ids": [1]}, "tenant-a")   # a stock prefill's
