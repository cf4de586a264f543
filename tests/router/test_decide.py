"""The decision's two implementations (C `_placement.decide`, Python `py_decide`) agree:
the same workers chosen for the same reasons, and the same state left behind."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from pdserve.v1 import common_pb2, router_pb2
from pdserve.services.router import placement
from pdserve.cache_salt import salt_key
from pdserve.services.router.keystore import PyKeyStore, packed, salted_block_keys
from pdserve.services.router.placement import Policy, Query, py_decide
from pdserve.services.router.registry import PENDING_SECONDS, PyWorker, name_hash
from support import c_part

PREFILL, DECODE = common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE
BLOCK = 4
# Cache salts as keys take them (keystore.salt_points): none, block 0's, a shared
# prefix's (a second salt at block 2), a group's and a tenant's.
SALTS = [(0, 0, 0), (salt_key("a"), 0, 0), (0, 2, salt_key("b")),
         (salt_key("g"), 3, salt_key("t"))]


@pytest.fixture
def c(monkeypatch):
    """The C module, and placement's C decision wired to it, whichever implementation
    this process's router runs."""
    module = c_part("placement")
    monkeypatch.setattr(placement, "_C", module)
    return module


@pytest.fixture(params=["c", "python"])
def impl(request):
    """Each implementation in turn: (a worker entry class, KeyStore, decide)."""
    if request.param == "python":
        return _entry_class(PyWorker), PyKeyStore, py_decide
    module = request.getfixturevalue("c")
    return _entry_class(module.Worker), module.KeyStore, placement.c_decide


def _entry_class(worker):
    """A worker entry on `worker` (the C one or the reference), as WorkerEntry is."""
    return type(f"Entry{worker.__name__}", (worker,), {"__slots__": ("info",)})


def _entry(cls, info: router_pb2.WorkerInfo, last_seen: float):
    e = cls()
    e.info = info
    e.worker_id, e.role, e.model, e.serving = info.worker_id, info.role, info.model, info.serving
    e.last_seen = last_seen
    return e


def _twins(rng: random.Random, n: int, c_entry, py_entry):
    """The same workers twice: C-based entries and Python-reference ones."""
    out_c, out_py = [], []
    for i in range(n):
        info = router_pb2.WorkerInfo(worker_id=f"w{i}", role=rng.choice([PREFILL, DECODE]),
                                     model=rng.choice(["m", "m", "other"]), address=f"a{i}",
                                     serving=rng.random() < 0.9)
        seen = rng.uniform(0, 10)
        c, py = _entry(c_entry, info, seen), _entry(py_entry, info, seen)
        c.load = py.load = rng.randrange(0, 6)
        c.load_pushed = py.load_pushed = rng.random() < 0.5
        for _ in range(rng.randrange(0, 4)):
            at = rng.uniform(8, 10)
            c.placed(at)
            py.placed(at)
        out_c.append(c)
        out_py.append(py)
    return tuple(out_c), tuple(out_py)


def _prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    head = rng.choice(prefixes)[:rng.randrange(0, 40)]
    return head + [rng.randrange(0, 50) for _ in range(rng.randrange(0, 12))]


def test_the_c_and_python_decisions_agree_over_random_states(c):
    rng = random.Random(7)
    prefixes = [[rng.randrange(0, 50) for _ in range(40)] for _ in range(4)]
    c_entry, py_entry = _entry_class(c.Worker), _entry_class(PyWorker)
    for trial in range(300):
        workers_c, workers_py = _twins(rng, rng.randrange(0, 7), c_entry, py_entry)
        stores_c, stores_py = {}, {}
        for w in workers_c:                          # some of what each worker holds
            if rng.random() < 0.8:
                ids = packed(rng.choice(prefixes)[:rng.randrange(0, 40)])
                until = rng.choice([float("inf"), rng.uniform(0, 20)])
                sc, sp = c.KeyStore(), PyKeyStore()
                keys = salted_block_keys(placement.unpacked(ids), BLOCK, *rng.choice(SALTS))
                for store in (sc, sp):
                    if until == float("inf"):
                        for k in keys:
                            store.confirm(k)
                    else:
                        store.place(keys, 0, until)
                stores_c[w.worker_id], stores_py[w.worker_id] = sc, sp
        policy = Policy(balance=rng.choice([1.0, 1.25, 2.0]),
                        balance_slack=rng.randrange(0, 3),
                        local_below_tokens=rng.choice([0, 8, 30]),
                        local_cached_fraction=rng.choice([0.5, 0.9]),
                        prefill_saturated=rng.choice([0, 2, 4]))
        ids = _prompt(rng, prefixes)
        query = Query(policy=policy, model=rng.choice(["m", "", "other", "none"]),
                      exclude=rng.choice([None, frozenset({"w0", "w3"})]),
                      prompt_ids=packed(ids), prompt_tokens=rng.randrange(0, 30),
                      block=rng.choice([0, BLOCK]),
                      session=rng.choice(["", "s1", f"session-{trial}", "ünï"]), now=10.0,
                      timeout=rng.choice([1.0, 100.0]), horizon=PENDING_SECONDS,
                      index_now=5.0, ttl=10.0, salt=rng.choice(SALTS))
        got = placement.c_decide(workers_c, stores_c, query)
        placement_keystore = placement.KeyStore
        placement.KeyStore = PyKeyStore                  # stores the reference makes
        try:
            want = py_decide(workers_py, stores_py, query)
        finally:
            placement.KeyStore = placement_keystore
        name = lambda w: w and w.worker_id               # noqa: E731
        if want is None:
            assert got is None, trial
        else:
            assert (name(got[0]), name(got[1]), *got[2:]) == \
                   (name(want[0]), name(want[1]), *want[2:]), trial
        assert [w.pending for w in workers_c] == [w.pending for w in workers_py], trial
        assert sorted(stores_c) == sorted(stores_py), trial
        probe = salted_block_keys(ids, BLOCK, *query.salt)
        for w in stores_c:
            for t in (5.0, 14.0, 16.0):
                assert stores_c[w].match(probe, t) == stores_py[w].match(probe, t), trial


def test_a_worker_keeps_its_load_and_seed(impl):
    entry_class, _, _ = impl
    entry = _entry(entry_class, router_pb2.WorkerInfo(worker_id="d0", role=DECODE, model="m"),
                   1.0)
    assert entry.seed == name_hash("d0") and entry.pending == 0
    for t in (1.0, 1.5, 2.5):
        entry.placed(t)
    assert entry.routed == 3 and entry.pending == 3
    entry.decay(2.4, PENDING_SECONDS)                      # the one from t=1.0 aged out
    assert entry.pending == 2
    entry.load = 4
    entry.clear_pending()                                  # as a load report does
    assert entry.load == 4 and entry.pending == 0 and entry.routed == 3
    for i in range(200):                                   # the ring grows, oldest first
        entry.placed(10.0 + i / 100)
    entry.decay(11.995, PENDING_SECONDS)
    assert entry.pending == 100 and entry.routed == 203


def test_a_c_worker_takes_only_a_string_for_its_id(c):
    entry = c.Worker()
    with pytest.raises(TypeError):
        entry.worker_id = 5


def test_decide_refuses_a_broken_prompt_and_places_one_without_ids(impl):
    entry_class, _, decide = impl
    workers = (_entry(entry_class, router_pb2.WorkerInfo(worker_id="d0", role=DECODE, model="m",
                                                         serving=True), 0.0),)
    query = Query(policy=Policy(), model="m", block=BLOCK, timeout=1.0, horizon=1.0, ttl=1.0)
    with pytest.raises(ValueError, match="4 bytes each"):
        decide(workers, {}, replace(query, prompt_ids=b"\x01\x02\x03"))
    got = decide(workers, {}, replace(query, prompt_tokens=7))
    assert got[0] is workers[0] and got[1] is None and got[5] == 7


def test_the_c_decision_refuses_what_is_not_a_worker(c):
    query = Query(policy=Policy(), model="m", block=BLOCK, timeout=1.0, horizon=1.0, ttl=1.0)
    with pytest.raises(TypeError):
        placement.c_decide(({},), {}, query)
    with pytest.raises(TypeError):
        c.decide((), {}, placement._knobs(Policy()))
