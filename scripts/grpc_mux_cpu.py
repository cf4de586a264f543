"""What batching many token streams onto one gRPC call would save, edge and worker side.

The edge reads every generation on its own streaming `Generate` call: one gRPC
message, and one wake-up on each side, per token per stream. This measures
that against one bidirectional call per worker carrying every stream's tokens,
each message holding whatever the worker produced in one event-loop turn (so
no token waits for a batch: a lone token goes out alone).

A server process (first core) runs `--streams` generations at `--rate` tokens/s
each, for `--duration` s, in both shapes; a client process (second core) reads
them, each stream in a task of its own that wakes for every token, as the
edge's do. It prints CPU seconds per 1,000 tokens on each side, and how late
tokens arrived (send to the stream task's wake-up, same clock).

    .venv/bin/python scripts/grpc_mux_cpu.py --streams 300 --rate 20 --duration 10
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import struct
import time

import grpc
import uvloop
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from pdserve.bench.deployments import free_port

MUX = "/pdserve.experiment.Mux/Streams"


def _now_us() -> int:
    """Microseconds on CLOCK_MONOTONIC, as a token id holds them (32 bits)."""
    return (time.monotonic_ns() // 1000) % (1 << 32)


def _late(stamp: int) -> int:
    return (_now_us() - stamp) % (1 << 32)


def _token(k: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
        token_ids=[k, _now_us()], completion_tokens=k))


class PerStream(pb_grpc.VllmEngineServicer):
    """A token per message, a call per stream."""

    def __init__(self, n: int, period: float):
        self.n, self.period = n, period

    async def Generate(self, request, context):
        start = time.monotonic()
        for k in range(self.n):
            await asyncio.sleep(max(0.0, start + (k + 1) * self.period - time.monotonic()))
            yield _token(k)
        yield pb.GenerateResponse(complete=pb.GenerateComplete(finish_reason="length"))


def _mux_handler(n: int, period: float):
    """One call; each request message starts a stream (its 4-byte id); each response
    message is every token ready in one loop turn, length-prefixed."""

    async def streams(requests, context):
        out: list[bytes] = []
        ready = asyncio.Event()

        async def one(sid: int) -> None:
            start = time.monotonic()
            for k in range(n + 1):
                await asyncio.sleep(max(0.0, start + (k + 1) * period - time.monotonic()))
                body = (_token(k) if k < n else pb.GenerateResponse(
                    complete=pb.GenerateComplete(finish_reason="length"))).SerializeToString()
                out.append(struct.pack("<II", sid, len(body)) + body)
                ready.set()

        tasks = []

        async def read() -> None:
            async for msg in requests:
                tasks.append(asyncio.create_task(one(struct.unpack("<I", msg)[0])))
        reader = asyncio.create_task(read())
        try:
            while True:
                await ready.wait()
                await asyncio.sleep(0)          # let this turn's other tokens join
                ready.clear()
                batch, out[:] = b"".join(out), []
                yield batch
        finally:
            reader.cancel()
            for t in tasks:
                t.cancel()

    return grpc.method_handlers_generic_handler("pdserve.experiment.Mux", {
        "Streams": grpc.stream_stream_rpc_method_handler(streams)})


def _serve(port: int, core: int, n: int, period: float, cpu) -> None:
    os.sched_setaffinity(0, {core})

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_VllmEngineServicer_to_server(PerStream(n, period), server)
        server.add_generic_rpc_handlers([_mux_handler(n, period)])
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        while True:
            cpu.value = time.process_time()
            await asyncio.sleep(0.05)
    uvloop.run(main())


async def _per_stream(ch, streams: int, ramp: float, late: list[float]) -> int:
    stub = pb_grpc.VllmEngineStub(ch)
    req = pb.GenerateRequest(request_id="x", stream=True,
                             tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]))

    async def one(i: int) -> int:
        await asyncio.sleep(ramp * i / streams)
        got = 0
        async for resp in stub.Generate(req):
            if resp.HasField("chunk"):
                late.append(_late(resp.chunk.token_ids[1]))
                got += 1
        return got
    return sum(await asyncio.gather(*(one(i) for i in range(streams))))


async def _mux(ch, streams: int, ramp: float, late: list[float]) -> int:
    call = ch.stream_stream(MUX)()
    queues = [asyncio.Queue() for _ in range(streams)]
    writing = asyncio.Lock()                    # one write in flight per call

    async def dispatch() -> None:
        parse = pb.GenerateResponse.FromString
        async for batch in call:
            at = 0
            while at < len(batch):
                sid, size = struct.unpack_from("<II", batch, at)
                queues[sid].put_nowait(parse(batch[at + 8:at + 8 + size]))
                at += 8 + size

    async def one(i: int) -> int:
        await asyncio.sleep(ramp * i / streams)
        async with writing:
            await call.write(struct.pack("<I", i))
        got = 0
        while True:
            resp = await queues[i].get()
            if not resp.HasField("chunk"):
                return got
            late.append(_late(resp.chunk.token_ids[1]))
            got += 1
    reader = asyncio.create_task(dispatch())
    try:
        return sum(await asyncio.gather(*(one(i) for i in range(streams))))
    finally:
        call.cancel()
        reader.cancel()


def _client(port: int, shape: str, streams: int, ramp: float) -> tuple[int, float, list[float]]:
    async def main():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await ch.channel_ready()
            late: list[float] = []
            started = time.process_time()
            got = await (_per_stream if shape == "per_stream" else _mux)(ch, streams, ramp, late)
            return got, time.process_time() - started, late
    return uvloop.run(main())


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] / 1000 if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=300)
    p.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream")
    p.add_argument("--duration", type=float, default=10.0, help="seconds each stream lasts")
    a = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    n = int(a.rate * a.duration)
    port, cpu = free_port(), mp.Value("d", 0.0)
    server = mp.Process(target=_serve, args=(port, cores[0], n, 1 / a.rate, cpu), daemon=True)
    server.start()
    try:
        time.sleep(1.5)
        os.sched_setaffinity(0, {cores[-1]})
        for shape in ("per_stream", "mux"):
            before = cpu.value
            got, client_cpu, late = _client(port, shape, a.streams, 1.0)
            time.sleep(0.2)
            server_cpu = cpu.value - before
            print(f"{shape:>10}: {got} tokens; CPU s per 1k tokens: client "
                  f"{1000 * client_cpu / got:.4f}, server {1000 * server_cpu / got:.4f}; "
                  f"late p50 {_pct(late, 0.5):.2f} ms, p99 {_pct(late, 0.99):.2f} ms")
    finally:
        server.terminate()
        server.join()


if __name__ == "__main__":
    main()
