"""A worker's KV-transfer series, `pdserve:kv_*`, beside its engine's `vllm:*`.

- `pdserve:kv_transfer_seconds`: decode side, a P/D request's handover as the
  worker sees it: from its arrival to its first token (the lease claim, the NIXL
  pull, the first step). vLLM's `vllm:nixl_xfer_time_seconds` times the read alone.
- `pdserve:kv_transfer_bytes_total`, `pdserve:kv_transfers_total`: what the
  decode engine's NIXL reads moved, from the connector's own statistics.
- `pdserve:kv_transfer_failures_total{reason}`: every way a pull did not
  happen or failed: the claim's refusals (`lease_gone`, `prefill_unreachable`,
  `claim_failed`: the request was prefilled locally instead) and the
  connector's (`transfer_failed`, `handshake_failed`, `notification_failed`,
  `kv_expired`: blocks recomputed, or freed before they were read).
- `pdserve:kv_leases_total{outcome}`, `pdserve:kv_leases_open`: prefill side
  (service.py).

All live in the worker process's default registry, served with the engine's
series on `--metrics-port`.
"""
from __future__ import annotations

from prometheus_client import Counter, Histogram

HANDOVER_SECONDS = Histogram(
    "pdserve:kv_transfer_seconds", "Decode side: from a P/D request's arrival to its first "
    "token (lease claim, NIXL pull, first step)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
BYTES = Counter("pdserve:kv_transfer_bytes", "KV bytes read from prefill workers (NIXL)")
TRANSFERS = Counter("pdserve:kv_transfers", "NIXL reads completed")
FAILURES = Counter("pdserve:kv_transfer_failures", "KV pulls that did not happen or failed, "
                   "by reason", ["reason"])

# The claim's refusals (claim.py): the request reached the engine without its params.
CLAIM_REASONS = ("lease_gone", "prefill_unreachable", "claim_failed")
# The connector's statistics (vLLM's NixlKVConnectorStats keys) -> reason.
_CONNECTOR_REASONS = {"num_failed_transfers": "transfer_failed",
                      "num_failed_handshakes": "handshake_failed",
                      "num_failed_notifications": "notification_failed",
                      "num_kv_expired_reqs": "kv_expired"}
for _reason in (*CLAIM_REASONS, *_CONNECTOR_REASONS.values()):
    FAILURES.labels(_reason)                    # every series exists from the start


def record_connector_stats(data: dict) -> None:
    """One engine step's connector statistics (`SchedulerStats.kv_connector_stats`)."""
    moved = data.get("bytes_transferred") or ()
    if moved:
        BYTES.inc(sum(moved))
        TRANSFERS.inc(len(moved))
    for key, reason in _CONNECTOR_REASONS.items():
        failures = data.get(key)
        if failures:
            FAILURES.labels(reason).inc(sum(failures))
