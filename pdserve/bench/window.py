"""How long one streamed message takes through the edge's fixed receive window.

`pdserve edge --decode-window-bytes` fixes the HTTP/2 receive window of the edge's
calls to workers (pdserve/rpc.py, `channel(receive_window=...)`). A message larger than
the window waits for the reader to open it. This serves a `BatchedGenerate` call in
process that answers each request with one message of about `--sizes` bytes (80-byte
outputs, as a decode step's), reads it through a channel with each window, and prints
the time from the message's making to its read, p50 and p90, per size and window.

    pdserve bench window --sizes 4000,30000,120000 --windows 8192,65536,0
"""
from __future__ import annotations

import argparse
import asyncio
import time

import grpc

from pdserve.rpc import channel
from pdserve.v1 import batched_pb2, batched_pb2_grpc

OUTPUT_BYTES = 80


class OneMessageEach(batched_pb2_grpc.BatchedGenerateServicer):
    """Answers a request whose id is a size with one message that large, its first
    output's id the time it was made (ns, CLOCK_MONOTONIC)."""

    async def Generate(self, requests, context):
        async for req in requests:
            made = str(time.monotonic_ns())
            yield batched_pb2.BatchedOutputs(outputs=[
                batched_pb2.BatchedOutput(request_id=made, response=b"x" * OUTPUT_BYTES)
                for _ in range(_outputs(int(req.request_id)))])


def _outputs(size: int) -> int:
    """Outputs in a message of about `size` bytes."""
    return max(1, size // (OUTPUT_BYTES + 10))


async def measure(address: str, window: int, size: int, messages: int) -> list[float]:
    """Microseconds from making to reading, per message (the first tenth left out)."""
    ch = channel(address, window)
    asks: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (r := await asks.get()) is not None:
            yield r
    call = batched_pb2_grpc.BatchedGenerateStub(ch).Generate(requests())
    took = []
    try:
        for _ in range(messages):
            asks.put_nowait(batched_pb2.BatchedRequest(request_id=str(size)))
            msg = await call.read()
            if len(msg.outputs) != _outputs(size):
                raise AssertionError(f"a {size} B message came with {len(msg.outputs)} outputs")
            took.append((time.monotonic_ns() - int(msg.outputs[0].request_id)) / 1000)
            await asyncio.sleep(0.005)              # a reader that keeps up, between steps
    finally:
        asks.put_nowait(None)
        call.cancel()
        await ch.close()
    return sorted(took[messages // 10:])


async def run(sizes: list[int], windows: list[int], messages: int) -> None:
    server = grpc.aio.server()
    batched_pb2_grpc.add_BatchedGenerateServicer_to_server(OneMessageEach(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        for size in sizes:
            for window in windows:
                took = await measure(f"127.0.0.1:{port}", window, size, messages)
                print(f"message {size:>7} B, window {window or 'gRPC':>6}: "
                      f"p50 {took[len(took) // 2]:.0f} us, p90 {took[int(len(took) * 0.9)]:.0f} us")
    finally:
        await server.stop(0)


def main(argv: list[str]) -> int:
    """`pdserve bench window ...`."""
    p = argparse.ArgumentParser(prog="pdserve bench window", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4000,30000,120000", help="message sizes, bytes")
    p.add_argument("--windows", default="8192,65536,0", help="receive windows, bytes (0: gRPC's)")
    p.add_argument("--messages", type=int, default=200, help="messages per size and window")
    a = p.parse_args(argv)
    asyncio.run(run([int(x) for x in a.sizes.split(",")], [int(x) for x in a.windows.split(",")],
                    a.messages))
    return 0
