"""A worker that reports a load no engine can have: bounded, warned about once, and the
router goes on placing and answering ListWorkers."""
from __future__ import annotations

import logging
import math

import pytest

from pdserve.v1 import common_pb2, router_pb2
from pdserve.services.router.placement import Policy, place
from pdserve.services.router.registry import LOAD_LIMIT, WorkerRegistry

DECODE = common_pb2.WORKER_ROLE_DECODE


def _registry(*names: str) -> WorkerRegistry:
    reg = WorkerRegistry(timeout=60.0, clock=lambda: 0.0)
    for name in names:
        reg.register(router_pb2.WorkerInfo(worker_id=name, role=DECODE, address=name,
                                           model="m", serving=True))
    return reg


def _placed(reg: WorkerRegistry, n: int) -> list[str]:
    out = []
    for i in range(n):
        _, decode, _ = place(reg, router_pb2.RouteRequest(model="m", session_id=f"s{i}",
                                                          prompt_tokens=8), Policy())
        reg.placed(decode)
        out.append(decode.info.worker_id)
    return out


# GetLoads' counts are signed (int32) and its capacity too; the KV-event stream's are
# uint32, and running + waiting may pass what WorkerInfo.load (uint32) holds.
@pytest.mark.parametrize("load", [-5, -(2**31), 2 * (2**32 - 1), LOAD_LIMIT + 1])
def test_a_nonsense_load_counts_as_full_and_the_snapshot_still_fits(load, caplog):
    reg = _registry("sane", "broken")
    entries = {e.info.worker_id: e for e in reg.entries()}
    entries["sane"].reported(3)
    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        entries["broken"].reported(load)
        entries["broken"].reported(load)               # warned about once
    assert entries["broken"].load == LOAD_LIMIT
    assert [r.message for r in caplog.records].count(
        f"worker broken reports load {load}: taken as bounded (warned once)") == 1
    assert set(_placed(reg, 20)) == {"sane"}             # nothing to the broken one
    info = {w.worker_id: w for w in reg.snapshot()}      # WorkerInfo.load is uint32
    assert info["broken"].load == LOAD_LIMIT and info["sane"].load == 3 + 20
    router_pb2.ListWorkersResponse(workers=reg.snapshot()).SerializeToString()


def test_a_broken_worker_alone_still_serves():
    reg = _registry("broken")
    reg.entries()[0].reported(-1)
    assert _placed(reg, 3) == ["broken"] * 3             # the bound keeps every worker
                                                          # when none is under it


@pytest.mark.parametrize("capacity", [-1, -(2**31), LOAD_LIMIT + 1])
def test_a_nonsense_capacity_counts_as_unknown(capacity):
    e = _registry("w").entries()[0]
    e.reported(2, capacity=8)
    e.reported(2, capacity=capacity)
    assert e.capacity == 0                               # unknown: no bound from it
    assert router_pb2.WorkerInfo(capacity=e.capacity).capacity == 0


@pytest.mark.parametrize("usage, kept", [(math.nan, 0.5), (math.inf, 0.5), (-0.1, 0.5),
                                         (-math.inf, 0.5), (42.0, 1.0), (0.75, 0.75)])
def test_a_kv_usage_out_of_bounds_is_ignored_or_capped(usage, kept):
    e = _registry("w").entries()[0]
    e.reported(1, kv_usage=0.5)
    e.reported(1, kv_usage=usage)
    assert e.kv_usage == kept


def test_a_sane_report_is_taken_as_is_without_a_warning(caplog):
    e = _registry("w").entries()[0]
    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        e.reported(LOAD_LIMIT, capacity=LOAD_LIMIT, kv_usage=1.0)
        e.reported(0, capacity=0, kv_usage=0.0)
    assert (e.load, e.capacity, e.kv_usage) == (0, 0, 0.0)
    assert not caplog.records
