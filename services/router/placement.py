"""Where one request runs: a decode worker, and a prefill worker or local prefill.

First policy: session affinity by rendezvous hashing (a session keeps its
decode worker while that worker lives; losing one moves only its sessions),
least-loaded otherwise (the engine's running + waiting requests as last read
with GetLoads, then requests placed here); remote prefill unless the prompt is
too short to be worth a transfer or no prefill worker serves.
"""
from __future__ import annotations

import hashlib

from pdserve.v1 import common_pb2, router_pb2

from .registry import WorkerEntry, WorkerRegistry


class NoWorkerError(Exception):
    """No decode worker can take the request."""


def _score(session_id: str, worker_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session_id}/{worker_id}".encode(),
                                          digest_size=8).digest(), "big")


def _pick(candidates: list[WorkerEntry], session_id: str) -> WorkerEntry:
    if session_id:
        return max(candidates, key=lambda e: _score(session_id, e.info.worker_id))
    return min(candidates, key=lambda e: (e.load, e.routed, e.info.worker_id))


def place(registry: WorkerRegistry, req: router_pb2.RouteRequest,
          local_below_tokens: int) -> tuple[router_pb2.RouteDecision, WorkerEntry, WorkerEntry | None]:
    """Decide placement; raises NoWorkerError when no decode worker serves."""
    exclude = set(req.exclude_workers)
    decoders = registry.serving(common_pb2.WORKER_ROLE_DECODE, req.model, exclude)
    if not decoders:
        raise NoWorkerError(f"no decode worker serves model {req.model!r}")
    decode = _pick(decoders, req.session_id)
    prefill = None
    if req.prompt_tokens < local_below_tokens:
        reason = f"local: prompt {req.prompt_tokens} tokens < {local_below_tokens}"
    else:
        prefillers = registry.serving(common_pb2.WORKER_ROLE_PREFILL, req.model, exclude)
        if prefillers:
            prefill = _pick(prefillers, "")
            reason = "disaggregated"
        else:
            reason = "local: no prefill worker serves"
    decision = router_pb2.RouteDecision(decode=decode.info, local_prefill=prefill is None,
                                        reason=reason)
    if prefill is not None:
        decision.prefill.CopyFrom(prefill.info)
    return decision, decode, prefill
