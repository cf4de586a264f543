"""The token source of `pdserve bench edge`: one process, two faces, one clock.

`pdserve.bench.synthetic.SyntheticEngine` answers vLLM's engine gRPC protocol
(what the router and the edge dial); beside it, in the same process and event
loop, an aiohttp server answers `POST /v1/completions` with `stream: true` as an
OpenAI server would: `max_tokens` completion chunks at `--rate` per second per
stream, each chunk's text the same stamp (" <send time in µs on
CLOCK_MONOTONIC>") the gRPC face spells in token ids, then a last chunk with
`finish_reason` and `data: [DONE]`. Direct clients and nginx use the HTTP face,
the edge the gRPC one, so every path in the benchmark starts at the same source.

    python -m pdserve.bench.edge_source --model models/tiny-llama --grpc-port 50071 \
        --http-port 50072 --rate 20
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid

from aiohttp import web

from pdserve.services.edge.detokenizer import byte_level_alphabet
from pdserve.bench.synthetic import SERVICE_NAMES, SyntheticEngine, add_to_server, stamp_text

log = logging.getLogger("pdserve.bench.edge_source")


class StampEngine(SyntheticEngine):
    """`SyntheticEngine` spelling its stamps with the Rust tokenizer directly: the
    same ids, a third of the CPU (the source should cost the paths little). For a
    byte-level BPE it asks the model for the stamp's one word (a quarter of `encode`'s
    CPU again, ~1.6 against 5.9 us: the HTTP face spells nothing), once it has given
    `encode`'s ids for a sample of stamps."""

    def __init__(self, tokenizer, served_model_name: str, rate: float):
        super().__init__(tokenizer, served_model_name, rate)
        self._rust = tokenizer._tokenizer
        self._spell = self._word_spelling() or self._encode
        self.http_streams = 0                   # SSE streams running on the HTTP face

    def _ids(self) -> list[int]:
        return self._spell(stamp_text())

    def _encode(self, text: str) -> list[int]:
        return self._rust.encode(text, add_special_tokens=False).ids

    def _word_spelling(self):
        """The BPE model's ids for a stamp (one pre-tokenized word: a space and
        digits, in the byte-level alphabet), if they are `encode`'s; else None."""
        rust = self._rust
        if type(rust.model).__name__ != "BPE" or type(rust.pre_tokenizer).__name__ != "ByteLevel":
            return None
        alphabet = {b: c for b, c in enumerate(byte_level_alphabet())}
        tokenize = rust.model.tokenize

        def spell(text: str) -> list[int]:
            return [t.id for t in tokenize(text.translate(alphabet))]    # stamps are ASCII
        now = time.monotonic_ns()
        sample = [stamp_text(now + k * 7_919_000) for k in range(200)] + [" 0", " 9" * 7]
        return spell if all(spell(t) == self._encode(t) for t in sample) else None


ENGINE = web.AppKey("engine", StampEngine)


async def completions(request: web.Request) -> web.StreamResponse:
    """A streamed text completion paced like `Generate`: chunk k leaves at start + k·period."""
    engine = request.app[ENGINE]
    body = await request.json()
    if not body.get("stream"):
        raise web.HTTPBadRequest(text="only stream: true is served")
    n = int(body.get("max_tokens") or 16)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    # The chunk's JSON around its text is the same every time: built once.
    envelope = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": body.get("model", engine.name),
                "choices": [{"index": 0, "text": "\0", "logprobs": None,
                             "finish_reason": None}]}
    head, tail = json.dumps(envelope, separators=(",", ":")).split("\\u0000")
    head, tail = b"data: " + head.encode(), tail.encode() + b"\n\n"
    last = dict(envelope, choices=[dict(envelope["choices"][0], text="",
                                        finish_reason="length")])
    engine.http_streams += 1
    start = time.monotonic()
    try:
        for k in range(n):
            delay = start + (k + 1) * engine.period - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await resp.write(head + stamp_text().encode() + tail)
        await resp.write(b"data: " + json.dumps(last, separators=(",", ":")).encode()
                         + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
    finally:
        engine.http_streams -= 1
    return resp


async def health(request: web.Request) -> web.Response:
    e = request.app[ENGINE]
    return web.json_response({"status": "ok", "grpc_streams": len(e.running),
                              "http_streams": e.http_streams, "chunks_sent": e.generated})


async def serve(model: str, served_model_name: str, host: str, grpc_port: int, http_port: int,
                rate: float) -> None:
    from transformers import AutoTokenizer

    from pdserve.lifecycle import freeze_startup_heap, until_signalled
    from pdserve.rpc import Server

    engine = StampEngine(AutoTokenizer.from_pretrained(model), served_model_name or model, rate)
    grpc_server = Server(host, grpc_port, lambda s: add_to_server(engine, s), SERVICE_NAMES)
    await grpc_server.start()
    app = web.Application()
    app[ENGINE] = engine
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, http_port, backlog=4096).start()
    # As every pdserve service does: a full collection over the tokenizer's and the
    # imports' objects stalled this loop ~140 ms while the edge's 1,000 streams started.
    freeze_startup_heap()
    log.info("source: gRPC %s:%d, HTTP %s:%d (%s, %.1f chunks/s per stream)", host,
             grpc_server.port, host, http_port, engine.name, rate)
    try:
        await until_signalled()
    finally:
        await runner.cleanup()
        await grpc_server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.edge_source", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model dir: its tokenizer spells the stamps")
    p.add_argument("--served-model-name", default="", help="default: --model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--rate", type=float, default=20.0, help="chunks per second per stream")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import uvloop
    uvloop.run(serve(a.model, a.served_model_name, a.host, a.grpc_port, a.http_port, a.rate))


if __name__ == "__main__":
    main()
