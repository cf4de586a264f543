"""A prefill worker that cannot be reached is tried no more for that request: the
next prefill worker takes it (failover), and when none is left the decode worker
prefills locally (fallback). The client sees the same text either way."""
from __future__ import annotations

import contextlib

from transformers import AutoTokenizer

from cases import CASES, MAX_TOKENS
from pdserve.config import EdgeConfig, RouterConfig
from pdserve.rpc import Server
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.services.edge.generation import Generation
from pdserve.services.edge.orchestrator import Orchestrator
from pdserve.services.router.server import RouterService
from support import free_port


async def _router(stack, prefills: list[tuple[str, str]]):
    """A router of our own that knows the stack's real decode worker and `prefills`."""
    service = RouterService(RouterConfig(port=0))
    server = Server("127.0.0.1", 0, lambda s: router_pb2_grpc.add_RouterServicer_to_server(
        service, s), ["pdserve.v1.Router"])
    await server.start()
    for wid, role, address in (
            *((wid, common_pb2.WORKER_ROLE_PREFILL, address) for wid, address in prefills),
            ("real-decode", common_pb2.WORKER_ROLE_DECODE, stack.decode)):
        await service.Register(router_pb2.RegisterRequest(worker=router_pb2.WorkerInfo(
            worker_id=wid, role=role, address=address, model=stack.model, serving=True)), None)
    return server


@contextlib.asynccontextmanager
async def _orchestrator(stack, model_dir, prefills: list[tuple[str, str]]):
    """An edge orchestrator behind `_router(stack, prefills)`, and the completion case's
    prompt ids; both stopped on exit."""
    server = await _router(stack, prefills)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    orchestrator = Orchestrator(EdgeConfig(
        model=str(model_dir), router=f"127.0.0.1:{server.port}", request_timeout_seconds=120,
        decode_calls="per-request"), tokenizer)
    case = next(c for c in CASES if c.kind == "completion")
    try:
        yield orchestrator, case, tokenizer.encode(case.payload["prompt"])
    finally:
        await orchestrator.close()
        await server.stop(0)


def _greedy(stack, request_id: str, ids: list[int]) -> Generation:
    return Generation(request_id=request_id, model=stack.model, prompt_token_ids=ids,
                      sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                         ignore_eos=True))


async def test_unreachable_prefill_falls_back_to_local_prefill(stack, reference, model_dir):
    # Two prefill workers nothing listens on: both are tried, then local prefill.
    async with _orchestrator(stack, model_dir, [
            ("dead-prefill-0", f"127.0.0.1:{free_port()}"),
            ("dead-prefill-1", f"127.0.0.1:{free_port()}")]) as (orchestrator, case, ids):
        stream = await orchestrator.start(_greedy(stack, "fallback-1", ids))
        assert stream.path == "local" and stream.stats.placed.prefill_fallback
        assert orchestrator.prefill_fallbacks == 1 and orchestrator.prefill_failovers == 1
        text = "".join([chunk.text async for chunk in stream.chunks()])
    assert text == reference[case.name]["text"]
    assert stream.completion_tokens == MAX_TOKENS


async def test_a_dead_prefill_worker_fails_over_to_a_live_one(stack, reference, model_dir):
    async with _orchestrator(stack, model_dir, [
            ("dead-prefill", f"127.0.0.1:{free_port()}"),
            ("real-prefill", stack.prefill)]) as (orchestrator, case, ids):
        # Idle prefill workers take turns: within two requests the dead one is picked
        # first at least once, and that request moves on to the live one.
        for n in range(2):
            stream = await orchestrator.start(_greedy(stack, f"failover-{n}", ids))
            assert stream.path == "disaggregated"
            assert stream.stats.placed.prefill_worker == "real-prefill"
            text = "".join([chunk.text async for chunk in stream.chunks()])
            assert text == reference[case.name]["text"]
        assert orchestrator.prefill_failovers >= 1 and orchestrator.prefill_fallbacks == 0
