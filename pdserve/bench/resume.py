"""`pdserve bench resume`: background responses resumed on another edge replica.

Starts redis-server, `pdserve up` (the tiny model, one prefill and one decode
worker) with its edge on `--stream-store redis://…`, and a second edge on the
same router and Redis. For each prompt it records the uninterrupted
temperature-0 answer (`POST /v1/responses` on edge A, not streamed); then per
trial it starts a streamed background response on edge A, drops the connection
after a random number of events, and resumes on edge B with
`GET /v1/responses/{id}?stream=true&starting_after=N`. A trial passes when the
sequence numbers seen before and after the drop run 0, 1, 2... with no gap or
repeat and the text equals the uninterrupted answer. Prints "N of N resumed on
the other edge equal the uninterrupted run" (or one JSON object with `--json`);
exits 1 when one does not.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import sys
import time

import aiohttp

from pdserve.bench.deployments import Hardware, PdserveStack, free_port, processes
from pdserve.launch import Group

PROMPTS = [f"Write a few sentences about {topic}." for topic in (
    "rivers", "bread", "trains", "winter", "clocks", "gardens", "the sea", "paper")]


def _wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")


def _events(raw: str) -> list[dict]:
    out = []
    for block in raw.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: ") and line[6:] != "[DONE]":
                out.append(json.loads(line[6:]))
    return out


def _text(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


async def _read_some(resp: aiohttp.ClientResponse, n: int) -> list[dict]:
    """The first `n` events of a response's stream (fewer if it ends first)."""
    got, buf = [], ""
    async for piece in resp.content.iter_any():
        buf += piece.decode()
        *done, buf = buf.split("\n\n")
        got += _events("\n\n".join(done))
        if len(got) >= n:
            break
    return got[:n]


async def _trial(http: aiohttp.ClientSession, a: str, b: str, body: dict, cut: int,
                 want: str) -> str:
    """One background response dropped on A after `cut` events, resumed on B: "" when
    it passes, else what went wrong."""
    async with http.post(f"{a}/v1/responses", json={**body, "stream": True,
                                                     "background": True}) as r:
        got = await _read_some(r, cut)
        r.close()
    rid, last = got[0]["response"]["id"], got[-1]["sequence_number"]
    async with http.get(f"{b}/v1/responses/{rid}",
                        params={"stream": "true", "starting_after": str(last)}) as r:
        if r.status != 200:
            return f"{rid}: resume on B answered {r.status}: {(await r.text())[:200]}"
        events = got + _events(await r.text())
    seqs = [e["sequence_number"] for e in events]
    if seqs != list(range(len(seqs))):
        return f"{rid}: sequence numbers {seqs[:5]}... have a gap or a repeat"
    if _text(events) != want:
        return f"{rid}: text differs from the uninterrupted run after event {last}"
    return ""


async def run_trials(a: str, b: str, model: str, trials: int, concurrency: int,
                     max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        bodies = [{"model": model, "input": p, "temperature": 0,
                   "max_output_tokens": max_tokens} for p in PROMPTS]
        wants = []
        for body in bodies:
            async with http.post(f"{a}/v1/responses", json=body) as r:
                wants.append(json.loads(await r.text())["output"][0]["content"][0]["text"])
        plan = [(rng.randrange(len(bodies)), rng.randint(3, max_tokens)) for _ in range(trials)]
        limit = asyncio.Semaphore(concurrency)

        async def one(i: int, cut: int) -> str:
            async with limit:
                return await _trial(http, a, b, bodies[i], cut, wants[i])
        started = time.monotonic()
        failures = [f for f in await asyncio.gather(*(one(i, c) for i, c in plan)) if f]
    return {"trials": trials, "equal": trials - len(failures), "failures": failures[:10],
            "seconds": round(time.monotonic() - started, 1)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench resume", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=100, help="background responses to resume")
    p.add_argument("--concurrency", type=int, default=4, help="trials at once")
    p.add_argument("--max-tokens", type=int, default=48, help="max_output_tokens per response")
    p.add_argument("--model", default="", help="model dir (default: the tiny model)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def _start(stack: PdserveStack, children: Group, redis: int) -> tuple[str, str]:
    """redis-server, `pdserve up` on it, and a second edge: the two edges' URLs."""
    children.start(["redis-server", "--port", str(redis), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no"], {})
    _wait_port(redis)
    (a,) = stack.start()
    port = free_port()
    children.start([sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "edge",
                    "--model", stack.model, "--router", f"127.0.0.1:{stack.ports['router']}",
                    "--port", str(port), "--grpc-port", str(free_port()),
                    "--stream-store", f"redis://127.0.0.1:{redis}",
                    "--max-model-len", str(stack.hw.max_model_len)], {})
    b = f"http://127.0.0.1:{port}"
    children.wait_healthy([f"{b}/health"])
    return a, b


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    if min(a.trials, a.concurrency, a.max_tokens) < 1:
        print("pdserve bench resume: --trials, --concurrency and --max-tokens must be >= 1",
              file=sys.stderr)
        return 2
    if shutil.which("redis-server") is None:
        print("pdserve bench resume: redis-server is not installed", file=sys.stderr)
        return 2
    from pdserve.cli import DEFAULT_MODEL_DIR
    from pdserve.tiny_model import ensure_tiny_model
    model = a.model or str(ensure_tiny_model(DEFAULT_MODEL_DIR).resolve())
    signal.signal(signal.SIGTERM, lambda sig, _: sys.exit(128 + sig))
    redis = free_port()
    hw = Hardware(device="cpu", units=tuple(sorted(os.sched_getaffinity(0))))
    stack = PdserveStack("resume", model, 0, hw,
                         placement=("--stream-store", f"redis://127.0.0.1:{redis}"))
    children = processes("resume-extra")
    try:
        edge_a, edge_b = _start(stack, children, redis)
        result = asyncio.run(run_trials(edge_a, edge_b, model, a.trials, a.concurrency,
                                        a.max_tokens, a.seed))
    finally:
        stack.stop()
        children.stop()
    if a.json:
        print(json.dumps(result))
    else:
        print(f"{result['equal']} of {result['trials']} resumed on the other edge equal the "
              f"uninterrupted run ({result['seconds']} s)")
        for failure in result["failures"]:
            print(f"  {failure}")
    return 0 if result["equal"] == result["trials"] else 1
