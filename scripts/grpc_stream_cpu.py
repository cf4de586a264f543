"""CPU a Python gRPC client spends receiving one token stream, without any engine.

A server process (pinned to the first core) streams `--messages` vLLM
engine-protocol chunks `--interval-ms` apart, as a decode worker does; a
`grpc.aio` client on uvloop (pinned to the second core) reads N streams, one at
a time and then `--concurrency` at once, and prints its CPU per stream. This
is the floor under the edge's CPU per request: what `grpc.aio` costs per
wake-up, before any of pdserve's own work.

    .venv/bin/python scripts/grpc_stream_cpu.py --streams 20 --concurrency 4
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time

import grpc
import uvloop
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from pdserve.bench.deployments import free_port


class TokenStreamer(pb_grpc.VllmEngineServicer):
    def __init__(self, messages: int, interval: float):
        self.messages, self.interval = messages, interval

    async def Generate(self, request, context):
        for i in range(self.messages):
            yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[i]))
            await asyncio.sleep(self.interval)
        yield pb.GenerateResponse(complete=pb.GenerateComplete(finish_reason="length"))


def _serve(port: int, core: int, messages: int, interval: float) -> None:
    os.sched_setaffinity(0, {core})

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_VllmEngineServicer_to_server(TokenStreamer(messages, interval), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()
    uvloop.run(main())


async def _client(port: int, streams: int, concurrency: int) -> float:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.VllmEngineStub(ch)
        req = pb.GenerateRequest(request_id="cpu", stream=True,
                                 tokenized=pb.TokenizedInput(input_ids=list(range(1024))))

        async def one() -> None:
            async for _ in stub.Generate(req):
                pass
        await one()                                   # channel set-up stays out of the figure
        started = time.process_time()
        for _ in range(streams // concurrency):
            await asyncio.gather(*(one() for _ in range(concurrency)))
        return 1000 * (time.process_time() - started) / (streams // concurrency * concurrency)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=20)
    p.add_argument("--messages", type=int, default=64)
    p.add_argument("--interval-ms", type=float, default=8.0)
    p.add_argument("--concurrency", type=int, default=4)
    a = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    port = free_port()
    server = mp.Process(target=_serve, args=(port, cores[0], a.messages, a.interval_ms / 1000),
                        daemon=True)
    server.start()
    try:
        time.sleep(1.5)
        os.sched_setaffinity(0, {cores[-1]})
        for conc in (1, a.concurrency):
            ms = uvloop.run(_client(port, a.streams, conc))
            print(f"{conc} stream(s) at once: {ms:.2f} ms client CPU per "
                  f"{a.messages + 1}-message stream")
    finally:
        server.terminate()
        server.join()


if __name__ == "__main__":
    main()
