"""A synthetic decode worker: vLLM's engine protocol with no model behind it.

It answers `Generate` with `max_tokens` chunks at a fixed rate per stream
(`--rate` chunks/s), so the edge can be measured and faulted without an engine
setting the pace. Each chunk's token ids spell, in the model's own tokenizer,
" <microseconds on CLOCK_MONOTONIC>" at the moment it was sent: whoever reads
the text at the far end knows how long the token took to arrive (every
process on one machine shares that clock). `Abort` and cancellation stop a
stream at once; `GetLoads` reports the streams running, so "the engine's
running count dropped to 0" is observable just as on a real worker. For fault
tests it can be frozen (its streams stop sending, as under SIGSTOP) and it
remembers what each request asked (`requests`: id -> prompt ids, max_tokens).

    python -m pdserve.bench.synthetic --model models/tiny-llama --port 50071 --rate 20
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import time

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from pdserve.cache_salt import METADATA_KEY
from pdserve.netaddr import hostport
from pdserve.rpc import Server

from pdserve.services.worker.batched import SERVICE_NAME as BATCHED_SERVICE
from pdserve.services.worker.batched import add_to_server as add_batched_generate

log = logging.getLogger("pdserve.synthetic")

SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
# What a synthetic worker serves, as a pdserve worker does: the engine protocol, and
# the same Generate batched (services/worker/batched.py).
SERVICE_NAMES = [SERVICE_NAME, BATCHED_SERVICE]


def stamp_text(now_ns: int | None = None) -> str:
    """The text a chunk carries: a space and the send time in microseconds."""
    return f" {(now_ns if now_ns is not None else time.monotonic_ns()) // 1000}"


def read_stamps(text: str) -> list[int]:
    """The send times (µs, CLOCK_MONOTONIC) a synthetic stream's text spells."""
    return [int(w) for w in text.split() if w.isdigit()]


def add_to_server(engine: SyntheticEngine, server) -> None:
    """Serve `engine` as `SERVICE_NAMES`."""
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(engine, server)
    engine.batched = add_batched_generate(engine, server)


class SyntheticEngine(vllm_engine_pb2_grpc.VllmEngineServicer):
    """`VllmEngine` over a clock instead of a model."""

    def __init__(self, tokenizer, served_model_name: str, rate: float, max_model_len: int = 2048,
                 capacity: int = 0):
        self.tokenizer = tokenizer
        self.capacity = capacity                # reported max_running_requests; 0 unknown
        self.name = served_model_name
        self.period = 1.0 / rate
        self.max_model_len = max_model_len
        self.running: dict[str, asyncio.Task] = {}
        self.generated = 0                      # chunks sent, all streams
        self.requests: dict[str, tuple[list[int], int]] = {}
        self.salts: dict[str, str] = {}         # request id -> the cache salt it came with
        self.batched = None                     # its BatchedGenerate servicer, once served
        self._thawed = asyncio.Event()
        self._thawed.set()

    def freeze(self) -> None:
        """Stop every stream sending (calls stay open), as a stopped process would."""
        self._thawed.clear()

    def thaw(self) -> None:
        self._thawed.set()

    def _ids(self) -> list[int]:
        return self.tokenizer.encode(stamp_text(), add_special_tokens=False)

    async def Generate(self, request, context):
        rid = request.request_id
        n = request.sampling_params.max_tokens if request.sampling_params.HasField(
            "max_tokens") else 16
        prompt = len(request.tokenized.input_ids)
        self.requests[rid] = (list(request.tokenized.input_ids), n)
        self.salts[rid] = dict(context.invocation_metadata() or ()).get(METADATA_KEY, "")
        self.running[rid] = asyncio.current_task()
        start, out = time.monotonic(), []
        try:
            for k in range(n):
                delay = start + (k + 1) * self.period - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await self._thawed.wait()
                ids = self._ids()
                out.extend(ids)
                self.generated += 1
                yield vllm_engine_pb2.GenerateResponse(chunk=vllm_engine_pb2.GenerateStreamChunk(
                    token_ids=ids, prompt_tokens=prompt, completion_tokens=len(out)))
            yield vllm_engine_pb2.GenerateResponse(complete=vllm_engine_pb2.GenerateComplete(
                output_ids=out, finish_reason="length", prompt_tokens=prompt,
                completion_tokens=len(out)))
        finally:
            self.running.pop(rid, None)

    async def Abort(self, request, context):
        for rid in request.request_ids:
            task = self.running.pop(rid, None)
            if task is not None:
                task.cancel()
        return vllm_engine_pb2.AbortResponse()

    async def HealthCheck(self, request, context):
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="synthetic")

    async def GetModelInfo(self, request, context):
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=self.name, served_model_name=self.name, is_generation=True,
            max_context_length=self.max_model_len, vocab_size=len(self.tokenizer))

    async def SubscribeKvEvents(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a synthetic engine caches nothing")

    async def GetLoads(self, request, context):
        return vllm_engine_pb2.GetLoadsResponse(dp_rank_count=1, loads=[
            vllm_engine_pb2.SchedulerLoad(num_running_reqs=len(self.running),
                                          max_running_requests=self.capacity)])


async def serve(model: str, served_model_name: str, host: str, port: int, rate: float) -> None:
    from transformers import AutoTokenizer

    from pdserve.lifecycle import until_signalled
    engine = SyntheticEngine(AutoTokenizer.from_pretrained(model), served_model_name or model, rate)
    server = Server(host, port, lambda s: add_to_server(engine, s), SERVICE_NAMES)
    await server.start()
    log.info("synthetic engine listening on %s (%s, %.1f chunks/s per stream)",
             hostport(host, server.port), engine.name, rate)
    try:
        await until_signalled()
    finally:
        await server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.synthetic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model dir: its tokenizer spells the stamps")
    p.add_argument("--served-model-name", default="", help="default: --model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50071)
    p.add_argument("--rate", type=float, default=20.0, help="chunks per second per stream")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import uvloop
    uvloop.run(serve(a.model, a.served_model_name, a.host, a.port, a.rate))


if __name__ == "__main__":
    main()
