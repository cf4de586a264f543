"""The router in another service's process: the calls of `RouterStub`, answered
by a `RouterService` on the caller's own event loop.

An edge started with `--router embedded` places its requests here instead of
over gRPC: no process hop, no serialising a prompt's token ids twice, one
process fewer to wake up for every heartbeat and probe. The edge still serves
the Router service on the router's port (`--router-port`, on 127.0.0.1 unless
`--router-host` says otherwise), so workers register with it, and other edges
may route through it, as with a router process.
"""
from __future__ import annotations

import grpc

from pdserve.rpc import call_error
from pdserve.v1 import router_pb2

from .server import RouterService


class _Context:
    """What a servicer method may ask of its gRPC context, for an in-process call."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        # The error a stub would raise, so that callers handle both paths alike.
        raise call_error(code, details)


class LocalRouter:
    """The two calls the edge makes of the router, without the network."""

    def __init__(self, service: RouterService):
        self.service = service

    async def Route(self, request: router_pb2.RouteRequest, timeout: float | None = None
                    ) -> router_pb2.RouteDecision:
        return await self.service.Route(request, _Context())

    async def ListWorkers(self, request: router_pb2.ListWorkersRequest,
                          timeout: float | None = None) -> router_pb2.ListWorkersResponse:
        return await self.service.ListWorkers(request, _Context())
