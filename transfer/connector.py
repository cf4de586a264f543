"""The one seam where a worker chooses how its engine moves KV blocks.

Workers ask for `engine_kv_config(role, cfg)` and hand the result to vLLM as
`kv_transfer_config`; they never name a connector themselves. Today the blocks
move with vLLM's NIXL connectors (UCX underneath; `kv_buffer_device: cpu` on CPU
boxes): `NixlConnector` pulls (the decode engine READs), `NixlPushConnector`
pushes (the prefill engine WRITEs); `KVTransferConfig.mode` picks one. pdserve's own
NIXL transfer engine plugs in here later, through `kv_connector_module_path`, without
touching the services. What requests carry to the connector (`kv_transfer_params`) is
a contract of its own, params.py.
"""
from __future__ import annotations

import errno
import socket
from typing import Any

from pdserve.config import KVTransferConfig
from pdserve.netaddr import hostport, is_ipv6

# vLLM roles: the prefill engine produces blocks, the decode engine consumes
# them. The decode worker still serves requests without a KV handle (local
# prefill) because a consumer only pulls when a request asks it to.
_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# vLLM worker extension through which a worker reaches its engine's leases.
LEASE_EXTENSION = "pdserve.transfer.leases.WorkerLeases"


def engine_kv_config(role: str, cfg: KVTransferConfig) -> dict[str, Any]:
    """vLLM `KVTransferConfig` fields for a worker of `role`."""
    if role not in _ROLES:
        raise ValueError(f"role must be one of {sorted(_ROLES)}, got {role!r}")
    return {
        # Both classes are pdserve's (transfer/vllm_nixl.py), named as vLLM names them.
        "kv_connector": "NixlPushConnector" if cfg.mode == "push" else "NixlConnector",
        "kv_connector_module_path": "pdserve.transfer.vllm_nixl",
        "kv_role": _ROLES[role],
        "kv_buffer_device": cfg.buffer_device,
        # A transfer that fails is recomputed on the decode worker, not failed.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "kv_lease_duration": cfg.lease_seconds,
            # NIXL's progress thread otherwise busy-polls a core per engine.
            # It wakes at once on UCX events either way; the timeout only bounds
            # idle wake-ups (1 ms cost ~0.5 ms per token on a shared core; 10 ms
            # and 100 ms measured the same transfer latency as 1 ms).
            "progress_poll_us": 100_000,
            "idle_spin_ms": 20,
        },
    }


def continues_prefill(role: str, cfg: KVTransferConfig) -> bool:
    """Whether a worker of `role` with this config takes a decode request whose prompt
    goes on past the prefill's KV (the prefill's sampled token appended) and computes
    the rest itself: pdserve's pull connector does (transfer/vllm_nixl.py); the push
    connector writes into blocks sized for the prompt alone, so it does not. Such a worker
    says so by gRPC health too (`params.CONTINUES_PREFILL`)."""
    return role == "decode" and cfg.mode == "pull"


def engine_kv_env(cfg: KVTransferConfig) -> dict[str, str]:
    """Process environment the connector reads (vLLM reads these, not flags)."""
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": cfg.side_channel_host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(cfg.side_channel_port),
        # Keep UCX on loopback on a dev box; GPU deployments override.
        "UCX_NET_DEVICES": "lo" if cfg.buffer_device == "cpu" else "all",
        # UCX's TCP transport takes a device's IPv4 address before its IPv6 one; a worker
        # advertising IPv6 moves its blocks over IPv6 too (IPv4 on a device without one).
        "UCX_TCP_AF_PRIO": "inet6,inet" if is_ipv6(cfg.side_channel_host) else "inet,inet6",
    }


def check_side_channel(cfg: KVTransferConfig) -> None:
    """Raise if another process listens on the NIXL side-channel port already.

    vLLM's handshake listener binds that port in a thread the engine then waits on:
    when the bind fails the thread dies and the engine's start hangs for good, with
    the error only in the engine's log. A worker checks first and exits naming the
    port (the bind is done the way ZMQ binds, `SO_REUSEADDR` set)."""
    family = socket.AF_INET6 if is_ipv6(cfg.side_channel_host) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.side_channel_host, cfg.side_channel_port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return      # not ours to judge (an advertised, non-local host): vLLM will
            where = hostport(cfg.side_channel_host, cfg.side_channel_port)
            raise RuntimeError(f"KV side-channel port {where} is in use by another process; "
                               "give this worker another --kv-port") from e
