"""The edge's two legs on the wire: the bytes of `kv_transfer_params_json` it sends the
prefill engine and then the decode engine, and a prefill answer that hands no KV over
(transfer/params.py refuses it) costing a local prefill, not the request. Fake engines
on real gRPC servers; the real path, on vLLM engines and NIXL:
tests/e2e/test_disaggregated_path.py."""
from __future__ import annotations

import contextlib
import json

import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc

from pdserve.config import EdgeConfig, RouterConfig
from pdserve.rpc import Server
from pdserve.v1 import common_pb2, router_pb2
from pdserve.services.edge.generation import Generation
from pdserve.services.edge.orchestrator import Orchestrator
from pdserve.services.edge.prompts import PromptEncoder
from pdserve.services.router.local import LocalRouter
from pdserve.services.router.server import RouterService

PROMPT = list(range(100, 140))
PREFILL_BYTES = ('{"do_remote_decode": true, "do_remote_prefill": false, '
                 '"remote_engine_id": null, "remote_block_ids": null, "remote_host": null, '
                 '"remote_port": null}')


class _Engine(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Answers each Generate with `tokens` (a prefill: its one token and `answer` as
    its kv_transfer_params_json); keeps the requests."""

    def __init__(self, tokens: list[int], answer: str | None = None):
        self.tokens, self.answer = tokens, answer
        self.requests: list[pb.GenerateRequest] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        if self.answer is not None:
            yield pb.GenerateResponse(complete=pb.GenerateComplete(
                output_ids=self.tokens, finish_reason="length",
                kv_transfer_params_json=self.answer))
            return
        for token in self.tokens:
            yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[token]))
        yield pb.GenerateResponse(complete=pb.GenerateComplete(finish_reason="length"))

    async def Abort(self, request, context):
        return pb.AbortResponse()


@contextlib.asynccontextmanager
async def _cluster(model_dir, prefill: _Engine, decode: _Engine):
    """Both engines on loopback, registered with an embedded router that disaggregates
    every prompt; yields an orchestrator over them and the prefill's address."""
    servers = {}
    for role, engine in ((common_pb2.WORKER_ROLE_PREFILL, prefill),
                         (common_pb2.WORKER_ROLE_DECODE, decode)):
        servers[role] = Server("127.0.0.1", 0, lambda s, e=engine: vllm_engine_pb2_grpc.
                               add_VllmEngineServicer_to_server(e, s), [])
        await servers[role].start()
    service = RouterService(RouterConfig(port=0, local_prefill_below_tokens=0))
    for role, server in servers.items():
        await service.Register(router_pb2.RegisterRequest(worker=router_pb2.WorkerInfo(
            worker_id=f"{role}-0", role=role, address=f"127.0.0.1:{server.port}", model="m",
            serving=True)), None)
    cfg = EdgeConfig(model=str(model_dir), router="127.0.0.1:1", decode_calls="per-request")
    orchestrator = Orchestrator(cfg, PromptEncoder(str(model_dir)).tokenizer,
                                router=LocalRouter(service))
    try:
        yield orchestrator, f"127.0.0.1:{servers[common_pb2.WORKER_ROLE_PREFILL].port}"
    finally:
        await orchestrator.close()
        for server in servers.values():
            await server.stop(0)


def _greedy(request_id: str) -> Generation:
    return Generation(request_id, "m", list(PROMPT),
                      common_pb2.SamplingParams(temperature=0, max_tokens=2))


async def test_the_decode_leg_carries_the_prefills_answer_with_the_address_and_the_mark(
        model_dir):
    answer = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_block_ids": [[1, 2, 3]], "remote_request_id": "pd-1-0a1b2c3d",
              "remote_num_tokens": len(PROMPT), "remote_prefill_cached_tokens": 0,
              "pdserve_lease_seconds": 6.0}
    prefill, decode = _Engine([7], json.dumps(answer)), _Engine([8, 9])
    async with _cluster(model_dir, prefill, decode) as (orchestrator, address):
        stream = await orchestrator.start(_greedy("pd-1"))
        assert stream.path == "disaggregated"
        assert [c.token_ids async for c in stream.chunks() if c.token_ids] == [[8], [9]]
    [asked] = prefill.requests
    assert asked.kv_transfer_params_json == PREFILL_BYTES
    [pulled] = decode.requests
    assert pulled.kv_transfer_params_json == (
        '{"do_remote_prefill": true, "do_remote_decode": false, '
        '"remote_block_ids": [[1, 2, 3]], "remote_request_id": "pd-1-0a1b2c3d", '
        f'"remote_num_tokens": {len(PROMPT)}, "pdserve_lease_seconds": 6.0, '
        f'"pdserve_prefill_address": "{address}", "pdserve_lease_fresh": true}}')


@pytest.mark.parametrize("answer", [
    "{}",
    '{"remote_block_ids": []}',
    "not json",
    '["remote_block_ids"]',
    '{"remote_block_ids": [[1]], "remote_request_id": 5}',
], ids=["empty", "no-blocks", "not-json", "not-an-object", "bad-lease-id"])
async def test_a_prefill_answer_that_hands_no_kv_over_is_a_local_prefill(model_dir, answer):
    prefill, decode = _Engine([7], answer), _Engine([8, 9])
    async with _cluster(model_dir, prefill, decode) as (orchestrator, _):
        stream = await orchestrator.start(_greedy("bad-1"))
        assert stream.path == "local" and stream.stats.placed.prefill_fallback
        assert orchestrator.prefill_fallbacks == 1
        assert [c.token_ids async for c in stream.chunks() if c.token_ids] == [[8], [9]]
    assert len(prefill.requests) == 1
    [local] = decode.requests
    assert not local.HasField("kv_transfer_params_json")
