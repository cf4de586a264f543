"""A generation moved off a failing decode worker mid-stream ends with the same text
as an uninterrupted run (temperature 0), on real engines.

The failing worker is a proxy in front of the stack's real decode worker that
speaks the same engine protocol and, after a few chunks, fails the call (as a
dying process does) or stops sending (as a stopped one does). The edge's
orchestrator then moves the generation: the real prefill worker prefills the
prompt plus the tokens already sent, the real decode worker pulls that KV and
continues. Placement goes through a router of this test's own.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2_grpc
from transformers import AutoTokenizer

from cases import CASES, MAX_TOKENS
from pdserve.config import EdgeConfig, RouterConfig
from pdserve.rpc import Server, channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.services.edge.generation import Generation
from pdserve.services.edge.orchestrator import Orchestrator
from pdserve.services.router.server import RouterService


class FailingDecode(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Relays Generate to a real engine, then fails after `chunks` chunks: the call
    ends UNAVAILABLE ("die") or goes silent ("stall")."""

    def __init__(self, upstream: str, chunks: int, how: str):
        self.channel = channel(upstream)
        self.stub = vllm_engine_pb2_grpc.VllmEngineStub(self.channel)
        self.chunks, self.how = chunks, how

    async def Generate(self, request, context):
        sent = 0
        async for resp in self.stub.Generate(request):
            yield resp
            sent += resp.HasField("chunk")
            if sent == self.chunks:
                break                       # leaving the loop cancels the upstream call
        if self.how == "stall":
            await asyncio.sleep(3600)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker died")

    async def Abort(self, request, context):
        return await self.stub.Abort(request)


def _edge_config(model_dir, router: Server, **faults) -> EdgeConfig:
    """The edge's settings for an orchestrator of this test's own, on `router`
    (per-request decode calls, as a stock worker gets)."""
    return EdgeConfig(model=str(model_dir), router=f"127.0.0.1:{router.port}",
                      request_timeout_seconds=120, decode_calls="per-request", **faults)


class _Slot:
    """Admission's ticket, as a preempted stream uses it: `resume` is `readmit`."""

    def __init__(self, readmit):
        self.resume = readmit

    def running(self) -> None:
        pass


@pytest.mark.parametrize("how", ["die", "stall"])
async def test_a_moved_generation_keeps_its_text(stack, reference, model_dir, how):
    proxy = FailingDecode(stack.decode, chunks=5, how=how)
    proxy_server = Server("127.0.0.1", 0, lambda s: vllm_engine_pb2_grpc
                          .add_VllmEngineServicer_to_server(proxy, s), [])
    service = RouterService(RouterConfig(port=0))
    router = Server("127.0.0.1", 0, lambda s: router_pb2_grpc.add_RouterServicer_to_server(
        service, s), ["pdserve.v1.Router"])
    await proxy_server.start()
    await router.start()

    async def register(wid: str, role, address: str) -> None:
        await service.Register(router_pb2.RegisterRequest(worker=router_pb2.WorkerInfo(
            worker_id=wid, role=role, address=address, model=stack.model, serving=True)), None)

    await register("prefill", common_pb2.WORKER_ROLE_PREFILL, stack.prefill)
    await register("failing-decode", common_pb2.WORKER_ROLE_DECODE,
                   f"127.0.0.1:{proxy_server.port}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    orchestrator = Orchestrator(_edge_config(model_dir, router, decode_stall_seconds=1.0),
                                tokenizer)
    case = next(c for c in CASES if c.kind == "completion")
    try:
        stream = await orchestrator.start(Generation(
            request_id=f"moved-{how}", model=stack.model,
            prompt_token_ids=tokenizer.encode(case.payload["prompt"]),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                               ignore_eos=True)))
        assert stream.decode_worker == "failing-decode" and stream.path == "disaggregated"
        # Only now does the healthy decode worker join: the move must find it.
        await register("decode", common_pb2.WORKER_ROLE_DECODE, stack.decode)
        text = "".join([chunk.text async for chunk in stream.chunks()])
    finally:
        await orchestrator.close()
        await router.stop(0)
        await proxy_server.stop(0)
        await proxy.channel.close()
    assert stream.decode_worker == "decode" and len(stream.stats.migrations) == 1
    assert stream.leg.prefill_params is not None        # the rest was prefilled remotely
    assert stream.completion_tokens == MAX_TOKENS
    assert text == reference[case.name]["text"]


async def test_a_preempted_generation_keeps_its_text(stack, reference, model_dir):
    """Admission's preemption (services/edge/admission.py) pauses a generation on real
    engines: its leg is aborted, and once admitted again it goes on from the tokens
    sent with the same text as an uninterrupted run."""
    service = RouterService(RouterConfig(port=0))
    router = Server("127.0.0.1", 0, lambda s: router_pb2_grpc.add_RouterServicer_to_server(
        service, s), ["pdserve.v1.Router"])
    await router.start()
    for wid, role, address in [("prefill", common_pb2.WORKER_ROLE_PREFILL, stack.prefill),
                               ("decode", common_pb2.WORKER_ROLE_DECODE, stack.decode)]:
        await service.Register(router_pb2.RegisterRequest(worker=router_pb2.WorkerInfo(
            worker_id=wid, role=role, address=address, model=stack.model, serving=True)), None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    orchestrator = Orchestrator(_edge_config(model_dir, router), tokenizer)
    case = next(c for c in CASES if c.kind == "completion")
    readmitted = []

    async def readmit() -> None:                # as Ticket.resume: a slot frees later
        await asyncio.sleep(0.2)
        readmitted.append(len(stream.output.ids))
    try:
        stream = await orchestrator.start(Generation(
            request_id="preempted", model=stack.model,
            prompt_token_ids=tokenizer.encode(case.payload["prompt"]),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                               ignore_eos=True)))
        chunks, asked = [], False
        async for chunk in stream.chunks(_Slot(readmit)):
            chunks.append(chunk.text)
            if len(stream.output.ids) >= 5 and not asked:
                asked = True
                assert stream.preempt() and not stream.preempt()    # once: it is pausing
    finally:
        await orchestrator.close()
        await router.stop(0)
    assert len(readmitted) == 1 and 5 <= readmitted[0] < MAX_TOKENS
    assert len(stream.stats.preemptions) == 1 and not stream.stats.migrations
    assert stream.completion_tokens == MAX_TOKENS
    assert "".join(chunks) == reference[case.name]["text"]
