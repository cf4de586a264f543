"""Leases on the prefill worker (`pdserve.v1.KVTransfer`): every prefill's blocks end
exactly once (released, aborted or expired), an abort frees them at once, and a
decode whose lease is gone, or whose prefill worker cannot be reached, prefills
locally with exact tokens within a second instead of reading freed blocks."""
from __future__ import annotations

import json
import time

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from cases import CASES
from engine_client import flush_prefix_cache, generate
from pdserve.v1 import transfer_pb2, transfer_pb2_grpc
from support import free_port, metric_sum
from pdserve.transfer.params import request_params_for_decode, request_params_for_prefill

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def workers(stack):
    with grpc.insecure_channel(stack.prefill) as p, grpc.insecure_channel(stack.decode) as d:
        yield (pb_grpc.VllmEngineStub(p), pb_grpc.VllmEngineStub(d),
               transfer_pb2_grpc.KVTransferStub(p))


@pytest.fixture(scope="module")
def prompt(model_dir) -> list[int]:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir).encode(CASES[0].payload["prompt"])


def _stats(leases) -> transfer_pb2.LeaseStats:
    return leases.Stats(transfer_pb2.LeaseStatsRequest(), timeout=10)


def _lease(prefill, rid: str, ids: list[int]) -> dict:
    """Prefill `ids` for a decoder; the params that name its blocks (and lease)."""
    _, done = generate(prefill, rid, ids, 1, kv=request_params_for_prefill())
    return json.loads(done.kv_transfer_params_json)


def _usage(stack) -> float:
    return metric_sum(stack.prefill_metrics, "vllm:kv_cache_usage_perc")


def _until(check, seconds: float) -> float:
    """Seconds until check() held; fails after `seconds`."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < seconds, "not within the deadline"
        time.sleep(0.02)
    return time.monotonic() - started


def _end(leases, op: str, lease: str) -> bool:
    return getattr(leases, op)(transfer_pb2.LeaseRequest(lease_id=lease), timeout=10).found


def test_abort_frees_the_blocks_at_once_and_ends_the_lease_once(stack, workers, prompt):
    prefill, decode, leases = workers
    flush_prefix_cache(prefill, decode)
    idle = _usage(stack)
    before = _stats(leases)
    lease = _lease(prefill, "lease-abort", prompt)["remote_request_id"]
    assert _usage(stack) > idle                        # the blocks wait for a decoder
    assert _end(leases, "Claim", lease)
    assert _end(leases, "Abort", lease)
    assert _until(lambda: _usage(stack) <= idle, 1.0) < 1.0
    assert not _end(leases, "Abort", lease)            # idempotent: ended once
    assert not _end(leases, "Release", lease)
    assert not _end(leases, "Claim", lease)
    after = _stats(leases)
    assert (after.opened - before.opened, after.aborted - before.aborted) == (1, 1)
    assert after.open == 0 and after.released == before.released


def test_a_pulled_lease_is_released(stack, workers, prompt):
    prefill, decode, leases = workers
    flush_prefix_cache(prefill, decode)
    before = _stats(leases)
    params = _lease(prefill, "lease-pull", prompt)
    out, done = generate(decode, "lease-pull-d", prompt, MAX_TOKENS,
                         kv=request_params_for_decode(params, stack.prefill))
    assert done.cached_tokens >= len(prompt) - 1      # the KV travelled
    _until(lambda: _stats(leases).released == before.released + 1, 2.0)
    after = _stats(leases)
    assert after.open == 0 and after.aborted == before.aborted
    # ... and the prefill worker exports the outcome (refreshed every second).
    _until(lambda: metric_sum(stack.prefill_metrics, "pdserve:kv_leases_total",
                              'outcome="released"') == after.released, 3.0)


def _local(decode, prompt) -> list[int]:
    out, done = generate(decode, f"lease-local-{time.monotonic_ns()}", prompt, MAX_TOKENS)
    return out


def _refused(stack, reason: str) -> float:
    return metric_sum(stack.decode_metrics, "pdserve:kv_transfer_failures_total",
                      f'reason="{reason}"')


@pytest.mark.parametrize("how", ["forged", "unreachable"])
def test_a_pull_that_cannot_succeed_is_a_local_prefill_within_a_second(stack, workers, prompt,
                                                                        how):
    prefill, decode, leases = workers
    flush_prefix_cache(prefill, decode)
    want = _local(decode, prompt)
    flush_prefix_cache(decode)
    params = _lease(prefill, f"lease-{how}", prompt)
    reason = "lease_gone" if how == "forged" else "prefill_unreachable"
    forged = dict(params, remote_request_id="no-such-lease") if how == "forged" else params
    address = stack.prefill if how == "forged" else f"127.0.0.1:{free_port()}"
    before = _refused(stack, reason)
    started = time.monotonic()
    out, done = generate(decode, f"lease-{how}-d", prompt, MAX_TOKENS,
                         kv=request_params_for_decode(forged, address))
    elapsed = time.monotonic() - started
    assert out == want                                 # exact tokens, computed locally
    assert done.cached_tokens < len(prompt) - 1        # nothing was pulled
    assert _refused(stack, reason) == before + 1
    assert elapsed < 1.0 + 0.5, elapsed                # the claim answers at once
    print(f"{how} lease: {MAX_TOKENS} tokens recomputed locally in {elapsed * 1000:.0f} ms")
    assert _end(leases, "Abort", params["remote_request_id"])   # the real one, unpulled


def test_an_expired_lease_is_counted_and_never_pulled(stack, workers, prompt):
    prefill, decode, leases = workers
    flush_prefix_cache(prefill, decode)
    want = _local(decode, prompt)
    flush_prefix_cache(decode)
    before = _stats(leases)
    params = _lease(prefill, "lease-expire", prompt)
    _until(lambda: _stats(leases).expired == before.expired + 1, 10.0)   # 6 s lease
    assert not _end(leases, "Claim", params["remote_request_id"])
    out, done = generate(decode, "lease-expire-d", prompt, MAX_TOKENS,
                         kv=request_params_for_decode(params, stack.prefill))
    assert out == want and done.cached_tokens < len(prompt) - 1
    after = _stats(leases)
    assert after.open == 0
    assert after.opened - before.opened == (after.released + after.aborted + after.expired) - (
        before.released + before.aborted + before.expired)
