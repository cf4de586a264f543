"""N greedy SSE streams through the edge, first one by one, then all at once.

Checks that every concurrent stream equals its sequential answer and prints
wall time and median time-to-first-token for both runs.

    .venv/bin/python scripts/concurrent_streams.py --url http://127.0.0.1:8000 \\
        --model $PWD/models/tiny-llama --streams 8
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import aiohttp

from pdserve.tiny_model import synthetic_corpus


async def _one(session, url: str, body: dict) -> tuple[str, str, float, float]:
    """(path, text, ttft s, total s) of one streamed completion."""
    start, first, text = time.perf_counter(), None, []
    async with session.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                piece = json.loads(line[6:])["choices"][0]["text"]
                if piece and first is None:
                    first = time.perf_counter() - start
                text.append(piece)
        return r.headers["x-pdserve-path"], "".join(text), first or 0.0, time.perf_counter() - start


async def _run(a: argparse.Namespace) -> None:
    bodies = [{"model": a.model, "prompt": " ".join(synthetic_corpus(500 + i, 25 + 3 * i)),
               "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
              for i in range(a.streams)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        seq = [await _one(s, a.url, b) for b in bodies]
        start = time.perf_counter()
        conc = await asyncio.gather(*(_one(s, a.url, b) for b in bodies))
        wall = time.perf_counter() - start
    same = sum(x[1] == y[1] for x, y in zip(seq, conc))
    print(f"paths {sorted({c[0] for c in conc})}; concurrent == sequential: {same}/{len(bodies)}")
    print(f"wall: sequential {sum(x[3] for x in seq):.2f} s, concurrent {wall:.2f} s "
          f"({sum(x[3] for x in seq) / wall:.1f}x)")
    print(f"median TTFT: sequential {statistics.median(x[2] for x in seq) * 1e3:.0f} ms, "
          f"concurrent {statistics.median(x[2] for x in conc) * 1e3:.0f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    asyncio.run(_run(p.parse_args()))


if __name__ == "__main__":
    main()
