"""`--router embedded`: the edge places requests with the router's own service in its
process. Over two synthetic decode engines a session keeps its worker, requests
without one spread, and the router's decisions show on the edge's /metrics."""
from __future__ import annotations

import asyncio

import aiohttp

from pdserve.bench.deployments import metric_sum
from synthetic_stack import edge_stack


async def test_the_embedded_router_places_keeps_sessions_and_counts(model_dir):
    async with edge_stack(model_dir, engines=2, embedded_router=True) as stack:
        # (edge_stack yields once the router found both engines serving)
        async with aiohttp.ClientSession() as http:
            async def send(**extra) -> str:
                async with http.post(f"{stack.url}/v1/completions",
                                     json=stack.body(8, stream=False, **extra)) as r:
                    assert r.status == 200, await r.text()
                    choice = (await r.json())["choices"][0]
                    assert choice["finish_reason"] == "length" and choice["text"]
                    return r.headers["x-pdserve-worker"]

            async def settled() -> None:
                # Placements count as load until the engine's next report (placement.py's
                # bounded load): several sessions hashed to one engine would otherwise push
                # a later turn over the cap and off its home.
                await stack.until(lambda: all(w.load == 0 for w in stack.registry.snapshot()))

            homes = {}
            for s in ("alice", "bob", "carol", "dave"):
                homes[s] = await send(session_id=s)
                await settled()
            for s, home in homes.items():                   # later turns: the same worker
                assert await send(session_id=s) == home
                await settled()
            spread = await asyncio.gather(*(send() for _ in range(6)))
        assert len(set(spread)) == 2                         # both engines took some
        decisions = await asyncio.to_thread(metric_sum, f"{stack.url}/metrics",
                                            "pdserve:router_decisions_total")
        assert decisions == 14
