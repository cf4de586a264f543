"""The one seam where a worker chooses how its engine moves KV blocks.

Workers ask for `engine_kv_config(role, cfg)` and hand the result to vLLM as
`kv_transfer_config`; they never name a connector themselves. Today the blocks
move with vLLM's NIXL connectors (UCX underneath; `kv_buffer_device: cpu` on CPU
boxes): `NixlConnector` pulls (the decode engine READs), `NixlPushConnector`
pushes (the prefill engine WRITEs); `KVTransferConfig.mode` picks one. pdserve's own NIXL transfer engine plugs in here later, through
`kv_connector_module_path`, without touching the services.
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
LEASE_EXTENSION = "transfer.leases.WorkerLeases"


def engine_kv_config(role: str, cfg: KVTransferConfig) -> dict[str, Any]:
    """vLLM `KVTransferConfig` fields for a worker of `role`."""
    if role not in _ROLES:
        raise ValueError(f"role must be one of {sorted(_ROLES)}, got {role!r}")
    return {
        # Both classes are pdserve's (transfer/vllm_nixl.py), named as vLLM names them.
        "kv_connector": "NixlPushConnector" if cfg.mode == "push" else "NixlConnector",
        "kv_connector_module_path": "transfer.vllm_nixl",
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


# The gRPC health name under which such a decode worker answers SERVING, for routers
# that probe workers (`pdserve router --decode-worker`) instead of taking their
# registration (`WorkerInfo.continues_prefill`).
CONTINUES_PREFILL = "pdserve.v1.ContinuesPrefill"


def continues_prefill(role: str, cfg: KVTransferConfig) -> bool:
    """Whether a worker of `role` with this config takes a decode request whose prompt
    goes on past the prefill's KV (the prefill's sampled token appended) and computes
    the rest itself: pdserve's pull connector does (transfer/vllm_nixl.py); the push
    connector writes into blocks sized for the prompt alone, so it does not."""
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


def request_params_for_prefill() -> dict[str, Any]:
    """`kv_transfer_params` for a prefill request: keep the blocks for a decoder."""
    return {"do_remote_decode": True, "do_remote_prefill": False,
            "remote_engine_id": None, "remote_block_ids": None,
            "remote_host": None, "remote_port": None}


# The prefill worker's gRPC address, in the params a decode request carries: the
# decode worker claims the lease there before its engine pulls (transfer/claim.py).
PREFILL_ADDRESS = "pdserve_prefill_address"
# How long the prefill worker holds the lease after it answers (its
# `kv lease_seconds`), in the params it returns ...
LEASE_SECONDS = "pdserve_lease_seconds"
# ... so that a gateway forwarding them at once can say so: the first use of a
# lease, within its first lease minus a second, needs no claim (transfer/claim.py).
FRESH_LEASE = "pdserve_lease_fresh"


def lease_young(age_seconds: float, lease_seconds: float) -> bool:
    """A lease handed out this long ago cannot have expired yet (a second to spare for
    the answer's way to whoever holds it). The prefill worker's fast claim and the
    edge's fresh mark both go by it."""
    return age_seconds < lease_seconds - 1


def lease_is_fresh(prefill_params: dict[str, Any], age_seconds: float) -> bool:
    """Whether params the prefill answered `age_seconds` ago are still certainly held
    (for their first use: a lease is ended only by its expiry, a pull, or an Abort)."""
    lease = prefill_params.get(LEASE_SECONDS)
    return isinstance(lease, (int, float)) and lease_young(age_seconds, lease)


def request_params_for_decode(prefill_params: dict[str, Any],
                              prefill_address: str = "", fresh: bool = False) -> dict[str, Any]:
    """`kv_transfer_params` for the decode request that pulls the prefill's blocks;
    `fresh`: their first use, and `lease_is_fresh`."""
    params = dict(prefill_params)
    if prefill_address:
        params[PREFILL_ADDRESS] = prefill_address
    if fresh:
        params[FRESH_LEASE] = True
    # The decode engine then reports the pulled tokens as its own cache hits,
    # which is how callers see that the KV travelled.
    params.pop("remote_prefill_cached_tokens", None)
    return params
