"""The local cluster's ports stay out of the range UCX listens in (UCX_TCP_PORT_RANGE):
the engines' UCX takes a port of it before the later pods bind theirs."""
from __future__ import annotations

import local_cluster
from support import free_port

from pdserve.bench.deployments import _below_ephemeral


def test_a_free_port_lies_outside_the_ranges_it_must_avoid():
    ports = _below_ephemeral()
    keep = range(ports.stop - 40, ports.stop)
    got = {free_port(avoid=(range(ports.start, keep.start),)) for _ in range(5)}
    assert got <= set(keep)


def test_the_local_clusters_ports_avoid_ucxs_range(tmp_path, monkeypatch):
    asked = []

    def recording(avoid=()):
        asked.append(avoid)
        return free_port(avoid)
    monkeypatch.setattr(local_cluster, "free_port", recording)
    cluster = local_cluster.LocalCluster(tmp_path)
    assert asked and all(range(20000, 21000) in avoid for avoid in asked)
    assert not [p for p in cluster.ports.values() if 20000 <= p <= 20999]
