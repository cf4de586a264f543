"""The synthetic engine: a decode worker's interface with no model behind it, the one every
benchmark and test that needs an engine without a model uses.

It serves what a pdserve worker serves (vLLM's engine protocol and the batched Generate of
services/worker/batched.py) and answers `Generate` with `max_tokens` chunks at a fixed rate
per stream (`--rate` chunks/s), so the edge can be measured and faulted without an engine
setting the pace. Each chunk's token ids spell, in the model's own tokenizer,
" <microseconds on CLOCK_MONOTONIC>" at the moment it was sent: whoever reads the text at
the far end knows how long the token took to arrive (every process on one machine shares
that clock). `Abort` and cancellation stop a stream at once; `GetLoads` reports the streams
running (and waiting), so "the engine's running count dropped to 0" is observable just as on
a real worker. With `--capacity N` it runs at most N streams at once and the rest wait, as
vLLM's scheduler does (`pdserve bench admission`). With `--http-port` it also answers
`POST /v1/completions` (`stream: true`) as an OpenAI server would, paced and stamped the
same, so that direct clients and nginx start from the same source as the edge
(`pdserve bench edge`). For fault tests it can be frozen (its streams stop sending, as under
SIGSTOP) and it remembers what each request asked (`requests`: id -> prompt ids, max_tokens).

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
from pdserve.services.edge.detokenizer import byte_level_alphabet
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


def stamp_speller(tokenizer):
    """The cheapest way to spell a stamp in `tokenizer`'s ids that gives `encode`'s ids:
    the Rust tokenizer directly (a third of the CPU), and for a byte-level BPE the model's
    ids for the stamp's one word (a quarter of that again, ~1.6 against 5.9 us), once it
    has given `encode`'s ids for a sample of stamps. The source should cost the paths
    under measurement little."""
    rust = getattr(tokenizer, "_tokenizer", None)
    if rust is None:
        return lambda text: tokenizer.encode(text, add_special_tokens=False)

    def encode(text: str) -> list[int]:
        return rust.encode(text, add_special_tokens=False).ids
    if type(rust.model).__name__ != "BPE" or type(rust.pre_tokenizer).__name__ != "ByteLevel":
        return encode
    alphabet = {b: c for b, c in enumerate(byte_level_alphabet())}
    tokenize = rust.model.tokenize

    def spell(text: str) -> list[int]:
        return [t.id for t in tokenize(text.translate(alphabet))]    # stamps are ASCII
    now = time.monotonic_ns()
    sample = [stamp_text(now + k * 7_919_000) for k in range(200)] + [" 0", " 9" * 7]
    return spell if all(spell(t) == encode(t) for t in sample) else encode


class SyntheticEngine(vllm_engine_pb2_grpc.VllmEngineServicer):
    """`VllmEngine` over a clock instead of a model. `capacity`: the max_running_requests
    it reports (0: unknown); with `hold`, also the streams it runs at once (the rest wait,
    reported as waiting)."""

    def __init__(self, tokenizer, served_model_name: str, rate: float, max_model_len: int = 2048,
                 capacity: int = 0, hold: bool = False):
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.name = served_model_name
        self.period = 1.0 / rate
        self.max_model_len = max_model_len
        self.running: dict[str, asyncio.Task] = {}
        self.waiting = 0                        # streams held back by `capacity`
        self.generated = 0                      # chunks sent, all streams
        self.http_streams = 0                   # SSE streams running on the HTTP face
        self.requests: dict[str, tuple[list[int], int]] = {}
        self.salts: dict[str, str] = {}         # request id -> the cache salt it came with
        self.batched = None                     # its BatchedGenerate servicer, once served
        self._slots = asyncio.Semaphore(capacity) if hold and capacity else None
        self._spell = stamp_speller(tokenizer)
        self._thawed = asyncio.Event()
        self._thawed.set()

    def freeze(self) -> None:
        """Stop every stream sending (calls stay open), as a stopped process would."""
        self._thawed.clear()

    def thaw(self) -> None:
        self._thawed.set()

    def _ids(self) -> list[int]:
        return self._spell(stamp_text())

    async def Generate(self, request, context):
        if self._slots is None:
            async for out in self._generate(request, context):
                yield out
            return
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        try:
            async for out in self._generate(request, context):
                yield out
        finally:
            self._slots.release()

    async def _generate(self, request, context):
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
                                          num_waiting_reqs=self.waiting,
                                          max_running_requests=self.capacity)])


async def serve(a: argparse.Namespace) -> None:
    """The engine on gRPC port `a.port`, and its HTTP face on `a.http_port` unless 0, until
    SIGTERM or SIGINT."""
    from pdserve.lifecycle import freeze_startup_heap, until_signalled
    from pdserve.services.edge.prompts import load_tokenizer   # as the edge: without torch
    engine = SyntheticEngine(load_tokenizer(a.model),
                             a.served_model_name or a.model, a.rate, capacity=a.capacity,
                             hold=True)
    server = Server(a.host, a.port, lambda s: add_to_server(engine, s), SERVICE_NAMES)
    await server.start()
    runner = None
    if a.http_port:
        from pdserve.bench.synthetic_http import start_http_face
        runner = await start_http_face(engine, a.host, a.http_port)
    # As every pdserve service does: a full collection over the tokenizer's and the
    # imports' objects stalled this loop ~140 ms while the edge's 1,000 streams started.
    freeze_startup_heap()
    log.info("synthetic engine listening on %s%s (%s, %.1f chunks/s per stream)",
             hostport(a.host, server.port), f", HTTP :{a.http_port}" if runner else "",
             engine.name, a.rate)
    try:
        await until_signalled()
    finally:
        if runner is not None:
            await runner.cleanup()
        await server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.synthetic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model dir: its tokenizer spells the stamps")
    p.add_argument("--served-model-name", default="", help="default: --model")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=50071, help="the engine protocol's (gRPC)")
    p.add_argument("--http-port", type=int, default=0,
                   help="serve streamed /v1/completions here too (0: off)")
    p.add_argument("--rate", type=float, default=20.0, help="chunks per second per stream")
    p.add_argument("--capacity", type=int, default=0,
                   help="streams run at once, the rest waiting (0: no bound)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import uvloop
    uvloop.run(serve(a))


if __name__ == "__main__":
    main()
