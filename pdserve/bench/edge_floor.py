"""The `floor` path of `pdserve bench edge`: the least a Python relay can do between
the decode interface and an SSE client, so the edge's figures have a floor beside
nginx's.

One aiohttp process (uvloop, as the edge) answers `POST /v1/completions` with
`stream: true`: it encodes the prompt, starts the generation on the source's worker
through the edge's own shared `BatchedGenerate` call (`pdserve.services.edge.batched`, every
stream on it), turns each output's ids into text with the edge's detokenizer, and
writes each piece as an HTTP chunk holding one SSE `data:` event, from the shared
call's reader (the leg's sink), as the edge's pushed writer does. Nothing else: no
router, admission, stream log, event ids, metrics or OpenAI envelope beyond the
chunk's text. Whatever the edge adds over this is its features' cost; what this adds
over direct is the decode interface's (the worker's batched transport, gRPC both
ways) and one Python process's socket I/O, which no Python edge goes below.

    python -m pdserve.bench.edge_floor --model models/tiny-llama --port 50073 \
        --decode-worker 127.0.0.1:50071
"""
from __future__ import annotations

import argparse
import json
import logging
import uuid

import grpc
from aiohttp import web

from pdserve.v1 import common_pb2
from pdserve.services.edge.batched import BatchedCalls
from pdserve.services.edge.detokenizer import StopRule, TextStream
from pdserve.services.edge.engine_requests import decode_request
from pdserve.services.edge.prompts import load_tokenizer

log = logging.getLogger("pdserve.bench.edge_floor")

HEAD = b'data: {"choices":[{"index":0,"text":'
TAIL = b'}]}\n\n'
_text = json.JSONEncoder().encode             # a str as a JSON string, in C


class Floor:
    def __init__(self, model: str, decode_worker: str):
        self.tokenizer = load_tokenizer(model)
        self.calls = BatchedCalls(grpc.aio.insecure_channel(decode_worker))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not isinstance(body, dict) or not body.get("stream"):
            raise web.HTTPBadRequest(text="only stream: true is served")
        prompt = self.tokenizer._tokenizer.encode(str(body.get("prompt", ""))).ids
        sampling = common_pb2.SamplingParams(max_tokens=int(body.get("max_tokens") or 16))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        transport = request.transport
        text = TextStream(self.tokenizer, prompt, StopRule())

        def write(out) -> bool:                 # an output, to the socket, as it comes
            piece = text.add(out.chunk.token_ids) if out.HasField("chunk") else ""
            if piece and transport is not None and not transport.is_closing():
                event = b"%b%b%b" % (HEAD, _text(piece).encode(), TAIL)
                transport.write(b"%x\r\n%b\r\n" % (len(event), event))
            return True

        leg = self.calls.Generate(decode_request(uuid.uuid4().hex, prompt, sampling, None))
        if hasattr(leg, "sink"):
            leg.sink = write
        try:
            async for out in leg:               # what came while the sink was off
                write(out)
        except grpc.aio.AioRpcError as e:
            await resp.write(b"data: %b\n\n" % json.dumps(
                {"error": {"message": e.details(), "code": e.code().name}}).encode())
        finally:
            leg.cancel()                        # the client left: stop it on the worker
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def serve(model: str, host: str, port: int, decode_worker: str) -> None:
    from pdserve.lifecycle import freeze_startup_heap, until_signalled
    floor = Floor(model, decode_worker)
    app = web.Application()
    app.router.add_post("/v1/completions", floor.completions)
    app.router.add_get("/health", lambda _: web.json_response({"status": "ok"}))
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=4096).start()
    freeze_startup_heap()
    log.info("floor relay on %s:%d, decode worker %s", host, port, decode_worker)
    try:
        await until_signalled()
    finally:
        await runner.cleanup()
        await floor.calls.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.edge_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model dir: its tokenizer")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, required=True, help="HTTP port")
    p.add_argument("--decode-worker", required=True, help="HOST:PORT of a worker's gRPC server")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import uvloop
    uvloop.run(serve(a.model, a.host, a.port, a.decode_worker))


if __name__ == "__main__":
    main()
