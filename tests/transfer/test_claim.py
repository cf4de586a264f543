"""The decode side's lease claim: which params are claimed before a pull, and which a
gateway vouches for (its first use of a lease, well within the lease)."""
from __future__ import annotations

from support import free_port
from pdserve.transfer.claim import LeaseClaims
from pdserve.transfer.params import (FRESH_LEASE, LEASE_SECONDS, PREFILL_ADDRESS, lease_is_fresh,
                            request_params_for_decode)


def test_a_lease_is_fresh_until_a_second_before_it_runs_out():
    params = {"remote_request_id": "r-1", LEASE_SECONDS: 6}
    assert lease_is_fresh(params, 0.0) and lease_is_fresh(params, 4.9)
    assert not lease_is_fresh(params, 5.0)
    assert not lease_is_fresh({"remote_request_id": "r-1"}, 0.0)   # no length: unknown
    assert not lease_is_fresh({LEASE_SECONDS: "6"}, 0.0)


def test_the_decode_params_carry_the_mark_only_when_asked():
    prefill = {"do_remote_decode": True, "remote_request_id": "r-1", "remote_block_ids": [1],
               LEASE_SECONDS: 6}
    address = "127.0.0.1:50061"
    marked = request_params_for_decode(dict(prefill, do_remote_prefill=True), address,
                                       fresh=True)
    plain = request_params_for_decode(dict(prefill, do_remote_prefill=True), address)
    assert marked[FRESH_LEASE] is True and marked[PREFILL_ADDRESS] == address
    assert FRESH_LEASE not in plain


async def test_the_claim_is_made_unless_the_params_are_marked_fresh():
    address = f"127.0.0.1:{free_port()}"
    params = {"do_remote_prefill": True, "remote_request_id": "r-1", PREFILL_ADDRESS: address}
    claims = LeaseClaims(timeout=2.0)
    assert await claims.refusal(dict(params, **{FRESH_LEASE: True})) is None
    assert await claims.refusal(params) == "prefill_unreachable"
    assert await claims.refusal(dict(params, **{FRESH_LEASE: "yes"})) == "prefill_unreachable"


class _Channel:
    def __init__(self, state):
        self.state = state

    def get_state(self, try_to_connect: bool = False):
        return self.state


def test_the_edge_vouches_for_a_young_lease_only_while_its_prefill_worker_is_connected():
    import grpc

    from pdserve.services.edge.leg import DecodeLeg, fresh_lease
    params = {"do_remote_decode": True, "remote_request_id": "r-1", LEASE_SECONDS: 6}
    ready = _Channel(grpc.ChannelConnectivity.READY)
    leg = DecodeLeg("r", "decode-0", None, params, "127.0.0.1:1", None, 100.0, ready)
    assert fresh_lease(leg, 100.5)
    assert not fresh_lease(leg, 105.5)                        # too old: claimed
    for state in (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.TRANSIENT_FAILURE):
        leg.prefill_channel = _Channel(state)                 # the prefill worker went away
        assert not fresh_lease(leg, 100.5)
    assert not fresh_lease(DecodeLeg("r", "decode-0", None), 100.5)     # a local prefill
