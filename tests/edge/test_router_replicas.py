"""Two router replicas, each holding the whole pool: one stops under a steady load of
streams and nothing fails. The edge dials both as one list (`--router IP:A,IP:B`),
keeps to the first, and moves to the other when it goes; its /health answers from
its last view of the pool and stays 200 throughout."""
from __future__ import annotations

import asyncio
import json

import aiohttp

from synthetic_stack import edge_stack

STREAM_TOKENS = 40              # 0.2 s each at the engine's 200 tokens/s
CLIENTS = 6


async def _stream(http: aiohttp.ClientSession, stack) -> tuple[int, int, str]:
    """(HTTP status, tokens, the first error event's text or "") of one streamed request."""
    async with http.post(f"{stack.url}/v1/completions",
                         json=stack.body(STREAM_TOKENS, ignore_eos=True)) as r:
        if r.status != 200:
            return r.status, 0, await r.text()
        tokens, error = 0, ""
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            error = error or json.dumps(event["error"]) if "error" in event else error
            tokens += sum(1 for c in event.get("choices", []) if c.get("text"))
        return r.status, tokens, error


def _decisions(router) -> float:
    """Every Route answer `router` placed, whatever its reason."""
    return sum(s.value for m in router.service.metrics.registry.collect()
               for s in m.samples if s.name == "pdserve:router_decisions_total")


async def test_a_router_replica_stops_under_load_and_no_stream_fails(model_dir):
    async with edge_stack(model_dir, engines=2, routers=2) as stack:
        first, second = stack.routers
        results, health, stopped = [], [], asyncio.Event()
        after_stop = []

        async def client(http):
            while not (stopped.is_set() and len(after_stop) >= 3 * CLIENTS):
                results.append(outcome := await _stream(http, stack))
                if stopped.is_set():
                    after_stop.append(outcome)

        async def probe(http):
            while not (stopped.is_set() and len(after_stop) >= 3 * CLIENTS):
                async with http.get(f"{stack.url}/health") as r:
                    health.append(r.status)
                await asyncio.sleep(0.05)

        async with aiohttp.ClientSession() as http:
            for _ in range(40):                         # the edge's view catches up (1 s)
                async with http.get(f"{stack.url}/health") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)
            load = [asyncio.create_task(client(http)) for _ in range(CLIENTS)]
            probes = asyncio.create_task(probe(http))
            await asyncio.sleep(1.0)                    # streams in flight on every client
            served_before = _decisions(first)
            await first.stop(grace=0)                   # the replica the edge dialled first
            stopped.set()
            await asyncio.wait_for(asyncio.gather(*load, probes), timeout=30)
        failed = [r for r in results if r[0] != 200 or r[2] or r[1] != STREAM_TOKENS]
        assert not failed, failed[:3]
        assert len(after_stop) >= 3 * CLIENTS           # new requests kept being admitted
        assert served_before, "the first replica placed nothing before it stopped"
        # ... and after the stop the second replica placed them.
        assert _decisions(second) > 0
        assert health and set(health) == {200}, [i for i, h in enumerate(health) if h != 200]
