"""A prefill worker that cannot be reached degrades the request to local prefill."""
from __future__ import annotations

from transformers import AutoTokenizer

from cases import CASES, MAX_TOKENS
from pdserve.config import RouterConfig
from pdserve.rpc import Server
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.edge.orchestrator import Generation, Orchestrator
from services.router.server import RouterService
from support import free_port


async def test_unreachable_prefill_falls_back_to_local_prefill(stack, reference, model_dir):
    # A router of our own that knows the stack's real decode worker and a
    # prefill worker whose address nothing listens on.
    service = RouterService(RouterConfig(port=0))
    server = Server("127.0.0.1", 0, lambda s: router_pb2_grpc.add_RouterServicer_to_server(
        service, s), ["pdserve.v1.Router"])
    await server.start()
    for wid, role, address in (
            ("dead-prefill", common_pb2.WORKER_ROLE_PREFILL, f"127.0.0.1:{free_port()}"),
            ("real-decode", common_pb2.WORKER_ROLE_DECODE, stack.decode)):
        await service.Register(router_pb2.RegisterRequest(worker=router_pb2.WorkerInfo(
            worker_id=wid, role=role, address=address, model=stack.model, serving=True)), None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    orchestrator = Orchestrator(f"127.0.0.1:{server.port}", request_timeout=120,
                                tokenizer=tokenizer)
    case = next(c for c in CASES if c.kind == "completion")
    ids = tokenizer.encode(case.payload["prompt"])
    try:
        stream = await orchestrator.start(Generation(
            request_id="fallback-1", model=stack.model, prompt_token_ids=ids,
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                               ignore_eos=True)))
        assert stream.path == "local" and stream.stats["prefill_fallback"]
        assert orchestrator.prefill_fallbacks == 1
        text = "".join([chunk.text async for chunk in stream.chunks()])
    finally:
        await orchestrator.close()
        await server.stop(0)
    assert text == reference[case.name]["text"]
    assert stream.completion_tokens == MAX_TOKENS
