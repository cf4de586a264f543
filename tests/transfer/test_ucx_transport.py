"""The worker's start-up line says which transport UCX will move KV over, and why."""
from __future__ import annotations

import resource

from pdserve.transfer.ucx_transport import detect, ucx_transport

H100 = {"UCX_TLS": "rc,cuda_copy,cuda_ipc,tcp"}


def test_rdma_needs_a_device_and_unlimited_memlock():
    t = ucx_transport(H100, ["mlx5_0", "mlx5_1"], resource.RLIM_INFINITY)
    assert (t.name, t.degraded) == ("rdma", False)
    assert "mlx5_0,mlx5_1" in t.why and "unlimited" in t.why


def test_the_runtimes_default_memlock_means_tcp_and_says_so():
    t = ucx_transport(H100, ["mlx5_0"], 8 << 20)
    assert (t.name, t.degraded) == ("tcp", True)
    assert "RLIMIT_MEMLOCK is 8 MiB" in t.why and "LimitMEMLOCK=infinity" in t.why


def test_no_rdma_device_means_tcp():
    t = ucx_transport(H100, [], resource.RLIM_INFINITY)
    assert (t.name, t.degraded) == ("tcp", True) and "rdma/" in t.why


def test_loopback_and_tcp_only_are_no_degradation():
    assert not ucx_transport({"UCX_NET_DEVICES": "lo"}, [], 0).degraded
    t = ucx_transport({"UCX_TLS": "tcp"}, ["mlx5_0"], resource.RLIM_INFINITY)
    assert (t.name, t.degraded) == ("tcp", False)


def test_this_machine_gets_an_answer():
    assert detect({"UCX_NET_DEVICES": "lo"}).name == "tcp"
