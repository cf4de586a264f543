"""What the edge asks the cluster to generate, and how a worker's failure reads to
its client.

A `Generation` is one choice of one request, already tokenized and validated.
The pieces that generate it: the orchestrator places it (orchestrator.py), a
`GenerationStream` reads it from one decode leg at a time (generation_stream.py;
each leg's call: leg.py), moving it when a worker fails or pausing it when
admission takes its slot back (moves.py); what it sent so far is its `Output`
(output.py), what its record says its `GenerationStats` (stats.py), and its life
from admission to its end an `AdmittedGeneration` (admitted.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc

from pdserve.v1 import common_pb2

from .openai_protocol import APIError

log = logging.getLogger("pdserve.edge")


@dataclass(slots=True)
class Generation:
    """What the edge asks the cluster to generate (already tokenized and validated)."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    session_id: str = ""
    deadline: float = 0.0               # time.monotonic() it must end by; 0 = the edge's default
    kind: str = "completion"            # "chat" | "completion": the GenAI operation
    client_salt: str = ""               # the request's own `cache_salt`
    # What every engine and the router see (tenant_salt.py; set when it is admitted).
    cache_salt: str = ""

    def remaining(self) -> float:
        """Seconds left of the request's budget; raises the deadline error at 0."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise deadline_passed()
        return left


def deadline_passed() -> APIError:
    """The error a request gets when its budget runs out (one wording, one status)."""
    return APIError(504, "the request's deadline passed before it finished",
                    type="timeout", code="deadline_exceeded")


def api_error(e: grpc.aio.AioRpcError, who: str) -> APIError:
    """A worker's gRPC status as the error the client sees (mapped once, here)."""
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, e.details() or "invalid request")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return APIError(429, "the server is overloaded; retry later", type="server_overloaded")
    log.warning("%s failed: %s %s", who, code.name, e.details())
    return APIError(503, f"{who} is unavailable ({code.name})", type="service_unavailable")
