"""The decode side of a lease: claim it before the engine pulls.

NIXL's READ is one-sided: a decoder that pulls blocks whose lease ended (it
expired, was aborted, or never existed) reads whatever the prefill engine has
put there since, and nothing tells it. So before a decode request with
`do_remote_prefill` reaches the engine, the worker asks the prefill worker's
`KVTransfer.Claim` whether the lease still holds its blocks (which also extends
it for the pull). If it does not, or the prefill worker cannot be reached, the
request goes to the engine without `kv_transfer_params`: the decode engine
computes the prompt itself, with exact tokens, within the claim's timeout
instead of a transfer timeout. Each such fallback is counted by reason in
`pdserve:kv_transfer_failures_total`.

The edge names the prefill worker's gRPC address in the params it hands over
(`PREFILL_ADDRESS`). Params without it come from a caller that knows nothing of
leases (another gateway over stock engines): they go to the engine unchanged,
as vLLM would take them.

No claim is made for params marked `FRESH_LEASE`: the edge marks a prefill's
params so when it forwards them for the first time, less than the lease minus
a second after the prefill answered (the prefill worker puts its lease length
in them, `LEASE_SECONDS`), and while its own connection to the prefill worker
stands (a worker killed after answering drops it at once; its lease is then
claimed, and refused within milliseconds, where a pull from the dead worker
would wait out NIXL's timeout: services/edge/generation.py, `fresh_lease`).
Nothing can have ended such a lease: it expires a lease after the answer, and
only a pull or an Abort ends it sooner, neither of which can have happened
before its first use. The prefill worker's own fast
path answers the same claim the same way without asking its engine, so the
check saved the request a round trip between the workers (~1 ms of TTFT on
this machine) and nothing else. A retry, a moved generation or a late decode
carries params without the mark, and is claimed.
"""
from __future__ import annotations

import grpc

from pdserve.rpc import channel
from pdserve.v1 import transfer_pb2, transfer_pb2_grpc

from .metrics import FAILURES
from .params import FRESH_LEASE, PREFILL_ADDRESS, lease_id, pulls_blocks



class LeaseClaims:
    """Claims leases on prefill workers, one channel per address."""

    def __init__(self, timeout: float = 0.5):
        self.timeout = timeout
        self._stubs: dict[str, transfer_pb2_grpc.KVTransferStub] = {}
        self._no_leases: set[str] = set()              # prefill workers without the service

    def _stub(self, address: str) -> transfer_pb2_grpc.KVTransferStub:
        if address not in self._stubs:
            self._stubs[address] = transfer_pb2_grpc.KVTransferStub(channel(address))
        return self._stubs[address]

    async def refusal(self, params: dict) -> str | None:
        """Why the blocks these params name must not be pulled, or None to pull them."""
        address, lease = params.get(PREFILL_ADDRESS), lease_id(params)
        if (not pulls_blocks(params) or not address or not lease
                or address in self._no_leases or params.get(FRESH_LEASE) is True):
            return None
        try:
            resp = await self._stub(address).Claim(
                transfer_pb2.LeaseRequest(lease_id=lease), timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._no_leases.add(address)   # a prefill engine without leases: vLLM's rules
                return None
            reason = ("prefill_unreachable" if e.code() in (
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                else "claim_failed")
        else:
            reason = None if resp.found else "lease_gone"
        if reason:
            FAILURES.labels(reason).inc()
        return reason
