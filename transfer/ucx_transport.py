"""Which UCX transport a worker's KV plane can use here, said once at start.

NIXL moves KV blocks over UCX, which picks the best transport it can open: RDMA (`rc`,
`dc`, `ud` over InfiniBand or RoCE; with GPUDirect, straight from GPU memory) when the
pod has an RDMA device and may pin (register) memory, TCP otherwise. It falls back
silently: a pod without the device, or with the container runtime's default
RLIMIT_MEMLOCK (64 KiB to 8 MiB) instead of an unlimited one, moves KV over TCP, at
10-40x the transfer time. `ucx_transport` reads what decides it (UCX_TLS, the RDMA
devices under /sys/class/infiniband, RLIMIT_MEMLOCK) and says which one UCX will use,
and why; the worker logs it (and warns when RDMA was asked for and is not there).
"""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

_RDMA_TLS = ("rc", "dc", "ud", "ib", "rc_x", "dc_x", "ud_x", "rc_v", "ud_v", "rc_mlx5",
             "dc_mlx5", "ud_mlx5")
# Less than this much lockable memory cannot register a KV cache's blocks.
MEMLOCK_NEEDED = 1 << 30
RDMA_DEVICES = Path("/sys/class/infiniband")


@dataclass(frozen=True, slots=True)
class Transport:
    """What UCX will move KV over, and why."""

    name: str            # "rdma" | "tcp" | "shared memory" (loopback on one machine)
    why: str
    rdma_wanted: bool    # UCX_TLS asks for an RDMA transport (or leaves UCX to choose)

    @property
    def degraded(self) -> bool:
        """RDMA was asked for and is not what UCX will use."""
        return self.rdma_wanted and self.name != "rdma"


def ucx_transport(env: dict[str, str], devices: list[str], memlock: int) -> Transport:
    """The transport UCX picks given its environment `env`, the RDMA `devices` present and
    the soft RLIMIT_MEMLOCK `memlock` in bytes (resource.RLIM_INFINITY: unlimited)."""
    tls = [t.strip().lstrip("^") for t in env.get("UCX_TLS", "all").split(",") if t.strip()]
    wanted = "all" in tls or any(t in _RDMA_TLS for t in tls)
    if env.get("UCX_NET_DEVICES") == "lo":
        return Transport("tcp", "UCX_NET_DEVICES=lo (one machine: loopback)", False)
    if not wanted:
        return Transport("tcp", f"UCX_TLS={env.get('UCX_TLS')} names no RDMA transport", False)
    if not devices:
        return Transport("tcp", f"no RDMA device in {RDMA_DEVICES} (the pod needs the "
                                "RDMA device plugin's resource, e.g. rdma/rdma_shared_device_a)",
                         True)
    unlimited = memlock == resource.RLIM_INFINITY or memlock < 0
    if not unlimited and memlock < MEMLOCK_NEEDED:
        return Transport("tcp", f"RLIMIT_MEMLOCK is {_size(memlock)}: RDMA cannot register "
                                "memory (set LimitMEMLOCK=infinity for the container runtime, "
                                "docs/operations.md)", True)
    return Transport("rdma", f"devices {','.join(devices)}, memlock "
                             f"{'unlimited' if unlimited else _size(memlock)}", True)


def detect(env: dict[str, str] | None = None) -> Transport:
    """`ucx_transport` for this process."""
    devices = sorted(p.name for p in RDMA_DEVICES.iterdir()) if RDMA_DEVICES.is_dir() else []
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return ucx_transport(dict(os.environ) if env is None else env, devices, soft)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
