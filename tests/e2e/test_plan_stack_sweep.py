"""`pdserve plan profile`'s serving part on the session's stack: the connector's own transfer
time and the overheads, read off real engines."""
from __future__ import annotations

import random

from pdserve.bench.plan.stack_sweep import StackSpec, measure_overheads, transfer_points


def test_the_profile_reads_transfer_and_overheads_off_a_running_stack(stack):
    spec = StackSpec(transfer_tokens=(300,), transfer_requests=1, overhead_reps=2,
                     overhead_prompt=64, overhead_output=8)
    rng, lines = random.Random(7), []
    [point] = transfer_points(stack.url, stack.model, stack.decode_metrics, spec, rng,
                              log=lines.append)
    assert point["tokens"] == 300 and point["transfers"] >= 1 and 0 < point["ms"] < 5000
    pages = {"prefill": stack.prefill_metrics, "decode": stack.decode_metrics}
    over, legs = measure_overheads(stack.url, stack.model, stack.router, pages, spec, rng,
                                   log=lines.append)
    # The client's first token waits for the prefill engine, its last for the decode one.
    assert legs["edge_ttft_ms"] >= legs["prefill_engine_ms"] > 0
    assert legs["edge_last_token_ms"] > legs["edge_ttft_ms"]
    assert legs["decode_engine_ms"] > 0 and legs["decode_engine_itl_ms"] > 0
    assert over["router_request_ms"] > 0
    assert min(over.values()) >= 0 and len(lines) == 2
