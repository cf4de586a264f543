"""`pdserve.v1.KVTransfer` on a prefill worker: leases ended and checked by id.

The leases live beside the connector in vLLM's model worker (`leases.py`); this
servicer reaches them through vLLM's `collective_rpc`, which runs between engine
steps. With tensor parallelism every rank holds its share of a lease's blocks: an
operation is sent to all, and the first rank's answer stands for them (every rank
sees every lease). The outcome counts are exported as
`pdserve:kv_leases_total{outcome}` and `pdserve:kv_leases_open`.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY

from pdserve.v1 import transfer_pb2, transfer_pb2_grpc

from .leases import OUTCOMES, request_of
from .params import lease_young

log = logging.getLogger(__name__)

SERVICE_NAME = transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
_RPC = "pdserve_leases"          # WorkerLeases' method, run in every engine worker


class KVTransferService(transfer_pb2_grpc.KVTransferServicer):
    """Lease control over one engine (an `AsyncLLM`)."""

    def __init__(self, llm, worker_id: str, lease_seconds: float):
        self.llm = llm
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.last = {"open": 0, "opened": 0, **dict.fromkeys(OUTCOMES, 0)}
        # lease id -> when the prefill answered; removed when ended or claimed here.
        self._issued: dict[str, float] = {}
        self._changed = True                          # leases came or went since the refresh

    def issued(self, lease_id: str) -> None:
        """The engine-protocol servicer handed this lease to a caller (in its prefill's
        kv_transfer_params): a claim may reach the engine's workers before the lease."""
        now = time.monotonic()
        self._issued[lease_id] = now
        self._changed = True
        while len(self._issued) > 1000:
            oldest = next(iter(self._issued))
            if now - self._issued[oldest] < self.lease_seconds:
                break
            del self._issued[oldest]

    async def leases(self, op: str, lease_ids: list[str]) -> list:
        """Run one lease operation on every rank; per id, the first rank's answer
        (every rank holds its share of every lease)."""
        ranks = await self.llm.collective_rpc(_RPC, timeout=10.0, args=(op, lease_ids))
        stats = [r["stats"] for r in ranks if r["stats"] is not None]
        if stats:
            self.last = stats[0]
        return ranks[0]["found"] if ranks else [False] * len(lease_ids)

    async def _end(self, op: str, request, context) -> transfer_pb2.LeaseResponse:
        if not request.lease_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lease_id is required")
        for lease in [i for i in self._issued
                      if i == request.lease_id or request_of(i) == request.lease_id]:
            del self._issued[lease]
        found = (await self.leases(op, [request.lease_id]))[0]
        self._changed = True
        log.info("%s lease %s on %s: %s%s", op, request.lease_id, self.worker_id,
                 "ended" if found else "not held",
                 f" ({request.reason})" if request.reason else "")
        return transfer_pb2.LeaseResponse(found=found)

    async def Release(self, request, context):
        return await self._end("release", request, context)

    async def Abort(self, request, context):
        return await self._end("abort", request, context)

    async def Claim(self, request, context):
        if not request.lease_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lease_id is required")
        # The first claim of a lease this worker handed out less than a lease minus a
        # second ago is answered here: nothing can have ended it (its expiry is a lease
        # after the prefill answered, and an Abort or Release through this service
        # forgets it), and asking the engine's workers would wait for the engine's
        # current step, up to a whole prefill. Any other claim asks them.
        issued = self._issued.pop(request.lease_id, None)
        fresh = issued is not None and lease_young(time.monotonic() - issued, self.lease_seconds)
        if fresh:
            return transfer_pb2.LeaseResponse(found=True)
        state = (await self.leases("claim", [request.lease_id]))[0]
        return transfer_pb2.LeaseResponse(found=state == "held")

    async def Stats(self, request, context):
        await self.leases("stats", [])
        return transfer_pb2.LeaseStats(**self.last)

    async def refresh(self, every: float = 1.0) -> None:
        """Keep the exported counts current (a scrape must not wait on the engine).
        Only while leases come and go: an idle engine is not woken every second."""
        while True:
            if self._changed or self.last["open"]:
                self._changed = False
                try:
                    await self.leases("stats", [])
                except Exception as e:       # an engine that is stopping: try again later
                    log.debug("lease stats unavailable: %s", e)
                    self._changed = True
            await asyncio.sleep(every)

    def collect(self):
        """prometheus_client collector: the counts as of the last refresh."""
        total = CounterMetricFamily("pdserve:kv_leases", "KV leases ended, by outcome",
                                    labels=["outcome"])
        for outcome in OUTCOMES:
            total.add_metric([outcome], self.last[outcome])
        yield total
        yield GaugeMetricFamily("pdserve:kv_leases_open", "KV leases holding blocks now",
                                value=self.last["open"])


def add_to_server(service: KVTransferService, server: grpc.aio.Server) -> None:
    transfer_pb2_grpc.add_KVTransferServicer_to_server(service, server)
    REGISTRY.register(service)
