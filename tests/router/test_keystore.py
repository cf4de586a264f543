"""The prefix index's two implementations (C `_placement`, Python reference) agree."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from pdserve import native
from pdserve.v1 import router_pb2
from pdserve.services.router import keystore
from pdserve.services.router.keystore import PyKeyStore, py_block_keys
from support import c_part


@pytest.fixture
def c():
    """The C module, whichever implementation this process's router runs."""
    return c_part("placement")


@pytest.fixture(params=["c", "python"])
def impl(request):
    """Each implementation in turn: (block_keys, KeyStore)."""
    if request.param == "python":
        return py_block_keys, PyKeyStore
    c = c_part("placement")
    return (lambda ids, block, parent=0: memoryview(c.block_keys(ids, block, parent)).cast("Q"),
            c.KeyStore)


def test_the_router_runs_the_index_pdserve_native_picks():
    c = native.load("placement")
    assert keystore.NATIVE == (c is not None)
    assert keystore.KeyStore is (PyKeyStore if c is None else c.KeyStore)


@pytest.mark.parametrize("block", [1, 4, 16, 64])
def test_block_keys_equal_the_reference_for_every_kind_of_token_list(impl, block):
    block_keys, _ = impl
    rng = random.Random(block)
    for n in (0, block - 1, block, 5 * block + 3, 1500):
        ids = [rng.randrange(0, 1 << 32) for _ in range(n)]
        want = py_block_keys(ids, block).tolist()
        assert len(want) == n // block
        as_proto = router_pb2.RouteRequest(prompt_token_ids=ids).prompt_token_ids
        for given in (ids, tuple(ids), as_proto, np.array(ids, dtype=np.uint32),
                      np.array(ids, dtype=np.int64)):
            assert block_keys(given, block).tolist() == want


def test_block_keys_go_on_from_a_parent_key_as_the_chain_does(impl):
    """Blocks stored after a known block (a KV event's parent) key from its key."""
    block_keys, _ = impl
    from pdserve.services.router.keystore import chain, content_hash
    rng = random.Random(3)
    ids = [rng.randrange(0, 1 << 32) for _ in range(16 * 5)]
    for parent in (0, 1, rng.getrandbits(64), (1 << 64) - 1):
        want, key = [], parent
        for i in range(5):
            key = chain(key, content_hash(ids[i * 16:(i + 1) * 16]))
            want.append(key)
        assert block_keys(ids, 16, parent).tolist() == want


def test_c_block_keys_refuse_what_is_not_token_ids(c):
    with pytest.raises(ValueError):
        c.block_keys([1, 2, 3], 0)
    with pytest.raises(TypeError):
        c.block_keys(["a"] * 8, 4)
    with pytest.raises(TypeError):
        c.block_keys(42, 4)
    with pytest.raises(TypeError, match="integers"):
        c.block_keys(np.ones(8, dtype=np.float64), 4)


def test_a_c_keystore_reads_keys_of_any_integer_width_as_ints(c):
    """Keys as block_keys gives them (uint64s, or its raw bytes), or any sequence of
    ints: a buffer of narrower ints is read int by int, never reinterpreted."""
    s = c.KeyStore()
    s.place([1, 2, 3, 4], 0, 10.0)
    wide = np.array([1, 2, 3, 4], dtype=np.uint64)
    for keys in ([1, 2, 3, 4], (1, 2, 3, 4), wide, memoryview(wide.tobytes()).cast("Q"),
                 wide.tobytes(), np.array([1, 2, 3, 4], dtype=np.uint32),
                 memoryview(np.array([1, 2, 3, 4], dtype=np.uint32).tobytes()).cast("I")):
        assert s.match(keys, 5.0) == 4, keys


def test_c_and_python_keystores_agree_over_random_operations(c):
    """The same random mix of places, reports, evictions, expiries and matches on both,
    with keys that collide in the C table's slots (small key space, many deletions)."""
    rng = random.Random(7)
    stores = (c.KeyStore(), PyKeyStore())
    universe = [rng.getrandbits(64) for _ in range(300)] + [0, 1, 2, (1 << 64) - 1]
    now = 1.0
    for step in range(20_000):
        op = rng.random()
        if op < 0.3:
            keys = rng.sample(universe, rng.randrange(0, 20))
            start, until = rng.randrange(0, 5), now + rng.uniform(0.5, 10)
            for s in stores:
                s.place(keys, start, until)
        elif op < 0.5:
            key = rng.choice(universe)
            for s in stores:
                s.confirm(key)
        elif op < 0.65:
            key = rng.choice(universe)
            for s in stores:
                s.drop(key)
        elif op < 0.75:
            now += rng.uniform(0, 2)
            for s in stores:
                s.expire(now)
        else:
            keys = np.array(rng.sample(universe, rng.randrange(0, 10)), dtype=np.uint64)
            at = now + rng.uniform(-1, 5)
            got = [s.match(memoryview(keys.tobytes()).cast("Q"), at) for s in stores]
            assert got[0] == got[1], f"step {step}"
        assert len(stores[0]) == len(stores[1]), f"step {step}"
    assert len(stores[0]) > 0


def test_a_keystore_holds_reported_keys_for_good_and_placed_ones_until_their_time(impl):
    _, KeyStore = impl
    s = KeyStore()
    s.place([1, 2, 3], 0, 10.0)
    assert s.match([1, 2, 3, 4], 5.0) == 3 and s.match([1, 2, 3], 10.0) == 0
    s.confirm(1)
    s.place([1, 2], 1, 20.0)                 # 2 placed again: its later time counts
    s.expire(15.0)                           # 3's time is up; 1 is reported; 2 runs to 20
    assert len(s) == 2 and s.match([1, 2, 3], 15.0) == 2 and s.match([1, 2], 25.0) == 1
    s.drop(1)
    assert s.match([1, 2], 15.0) == 0
    with pytest.raises(ValueError):
        s.place([5], 0, math.inf)


@pytest.mark.parametrize("hidden", [False, True])
def test_with_pdserve_native_python_the_router_places_with_the_python_reference(hidden):
    """Told to (PDSERVE_NATIVE=python), or by auto where the module is not built."""
    import os
    import subprocess
    import sys
    code = ("import sys\n"
            + ("sys.modules['pdserve.services.router._placement'] = None\n" if hidden else "")
            + "from pdserve.services.router import keystore\n"
            "from pdserve.services.router.prefix_index import PrefixIndex\n"
            "assert not keystore.NATIVE and keystore.KeyStore is keystore.PyKeyStore\n"
            "index = PrefixIndex(4)\n"
            "index.stored('w', None, [(1, [1, 2, 3, 4]), (2, [5, 6, 7, 8])])\n"
            "keys = keystore.block_keys(list(range(1, 11)), 4)\n"
            "print(index.matched_blocks(keys, ['w', 'v']))\n"
            "from pdserve.v1 import router_pb2\n"
            "from pdserve.services.router import placement, registry\n"
            "assert placement.decide is placement.py_decide\n"
            "assert registry.Worker is registry.PyWorker\n"
            "reg = registry.WorkerRegistry(timeout=10)\n"
            "for w in ('v', 'w'):\n"
            "    reg.register(router_pb2.WorkerInfo(worker_id=w, role=2, model='m',\n"
            "                                       address=w, serving=True))\n"
            "req = router_pb2.RouteRequest(model='m', prompt_token_ids=list(range(1, 11)))\n"
            "decision, _, _ = placement.place(reg, req, placement.Policy(), index)\n"
            "print(decision.decode.worker_id, decision.cached_tokens)\n")
    env = {**os.environ, "PDSERVE_NATIVE": "auto" if hidden else "python"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True, env=env).stdout
    assert out.split("\n")[:2] == ["{'w': 2, 'v': 0}", "w 8"]
