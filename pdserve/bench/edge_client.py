"""The load generator of `pdserve bench edge`, run in its own processes
(`python -m pdserve.bench.edge_client SPEC`): uvloop, raw asyncio streams, a minimal
HTTP/1.1 + SSE reader; a token's latency is its arrival time minus the stamp it carries
(pdserve.bench.synthetic)."""
from __future__ import annotations

import asyncio
import json
import re
import resource
import sys
import time
from array import array
from collections import Counter
from pathlib import Path

PROMPT = "hello"
_TEXT = re.compile(rb'"text":\s*"([^"]*)"')   # a completion chunk's text


def raise_nofile() -> int:
    """Open-file limit up as far as allowed (root: 131072, else the hard limit); children
    inherit it. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in ((1 << 17, max(hard, 1 << 17)), (hard, hard)):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, want)
            return want[0]
        except (ValueError, OSError):
            continue
    return soft


class _Stream(asyncio.Protocol):
    """One streamed completion over one connection: HTTP/1.1 response head, chunked or
    close-delimited body, SSE `data:` lines; records each stamp's latency and the stamp
    itself (µs)."""

    def __init__(self, request: bytes, lat: array, sent: array, done: asyncio.Future):
        self.request, self.lat, self.sent, self.done = request, lat, sent, done
        self.transport = None
        self.buf = bytearray()          # bytes not yet de-chunked
        self.body = bytearray()         # SSE text not yet split into lines
        self.head = True
        self.chunked = False
        self.eof = False
        self.status = 0
        self.tokens = 0
        self.finished = False           # [DONE] seen
        self.error = ""
        self.first = self.last = 0      # µs of the first and last token

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic_ns() // 1000
        self.buf += data
        if self.head:
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                return
            lines = bytes(self.buf[:i]).decode("latin-1").split("\r\n")
            del self.buf[:i + 4]
            self.head = False
            try:
                self.status = int(lines[0].split()[1])
            except (IndexError, ValueError):
                return self._end("bad_response")
            if self.status != 200:
                return self._end(f"status_{self.status}")
            self.chunked = any(ln.lower().startswith("transfer-encoding:") and "chunked" in
                               ln.lower() for ln in lines[1:])
        if self.chunked:
            self._dechunk()
        else:
            self.body += self.buf
            self.buf.clear()
        self._events(now)
        if self.eof:
            self._end()

    def _dechunk(self) -> None:
        buf = self.buf
        while True:
            i = buf.find(b"\r\n")
            if i < 0:
                return
            size = int(bytes(buf[:i]).split(b";")[0], 16)
            if size == 0:
                self.eof = True
                buf.clear()
                return
            if len(buf) < i + 2 + size + 2:
                return
            self.body += buf[i + 2:i + 2 + size]
            del buf[:i + 2 + size + 2]

    def _events(self, now: int) -> None:
        body, start = self.body, 0
        while (j := body.find(b"\n", start)) >= 0:
            line, start = bytes(body[start:j]), j + 1
            if not line.startswith(b"data:"):
                continue                        # id:, retry:, event:, comments, blank lines
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.finished = True
                continue
            if b'"error"' in payload:
                self.error = self.error or "error_event"
            m = _TEXT.search(payload)           # the stamps are digits and spaces: no JSON
            if m is None:                       # escapes to decode, so no json.loads
                continue
            for word in m.group(1).split():
                if not word.isdigit():
                    continue
                d = now - int(word)
                if not 0 <= d < 600_000_000:
                    self.error = self.error or "bad_stamp"
                    continue
                self.lat.append(d)
                self.sent.append(int(word))
                self.tokens += 1
                self.first = self.first or now
                self.last = now
        del body[:start]

    def connection_lost(self, exc) -> None:
        self._end("" if exc is None else "connection_lost")

    def _end(self, error: str = "") -> None:
        if self.done.done():
            return
        self.error = self.error or error
        self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()


async def _drive(spec: dict) -> dict:
    """This client's share of the streams; a summary, latencies and spans."""
    loop = asyncio.get_running_loop()
    body = json.dumps({"model": spec["model"], "prompt": PROMPT, "max_tokens": spec["max_tokens"],
                       "stream": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {spec['host']}\r\n"
               f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
               f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    ports = spec["ports"]
    lat, sent, spans, first = ([array("q") for _ in ports] for _ in range(4))
    errors, held = [Counter() for _ in ports], [0] * len(ports)

    async def one(j: int) -> None:
        k = (j // spec["of"]) % len(ports)      # this client's streams alternate over ports
        start = spec["start_at"] + j * spec["ramp"] / spec["streams"]
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        done = loop.create_future()
        s = _Stream(request, lat[k], sent[k], done)
        opened = time.monotonic_ns() // 1000
        try:
            async with asyncio.timeout(start + spec["timeout"] - time.monotonic()):
                await loop.create_connection(lambda: s, spec["host"], ports[k])
                await done
        except TimeoutError:
            s.error = s.error or "timeout"
        except OSError as e:
            s.error = s.error or f"connect_{type(e).__name__}"
        finally:
            if s.transport is not None:
                s.transport.close()
        if not s.error and not s.finished:
            s.error = "no_done"
        if not s.error and s.tokens != spec["max_tokens"]:
            s.error = "short_stream" if s.tokens < spec["max_tokens"] else "extra_tokens"
        if s.error:
            errors[k][s.error] += 1
        else:
            held[k] += 1
        if s.first:
            spans[k].extend((s.first, s.last))
            first[k].append(s.first - opened)

    await asyncio.gather(*(one(j) for j in range(spec["index"], spec["streams"], spec["of"])))
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"held": held, "errors": [dict(e) for e in errors],
            "cpu_s": ru.ru_utime + ru.ru_stime, "lat": lat, "sent": sent, "spans": spans,
            "first": first}


def client_main(spec: dict) -> None:
    """Entry of one load-generator process: results into spec["out"] (.json, .lat, .sent,
    .spans, .first)."""
    import uvloop
    raise_nofile()
    res = uvloop.run(_drive(spec))
    out = Path(spec["out"])
    for key in ("lat", "sent", "spans", "first"):
        for k, values in enumerate(res.pop(key)):
            out.with_suffix(f".{key}{k}").write_bytes(values.tobytes())
    out.with_suffix(".json").write_text(json.dumps(res))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m pdserve.bench.edge_client SPEC (see `pdserve bench edge`)")
    client_main(json.loads(sys.argv[1]))
