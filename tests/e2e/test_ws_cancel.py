"""A WebSocket `cancel` on the real stack: the decode engine stops the request and
frees its KV blocks (its own vllm:* gauges say so), measured from the cancel frame."""
from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import websockets


async def _gauges(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    async with http.get(url) as r:
        body = await r.text()

    def one(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", body, re.M))
    return one("vllm:num_requests_running"), one("vllm:kv_cache_usage_perc")


async def test_ws_cancel_frees_the_decode_engine_at_once(stack):
    ws_url = stack.url.replace("http://", "ws://") + "/v1/ws"
    async with aiohttp.ClientSession() as http:
        _, idle_usage = await _gauges(http, stack.decode_metrics)
        async with websockets.connect(ws_url) as ws:
            await ws.send(json.dumps({"model": stack.model, "prompt": "the dog " * 120,
                                      "max_tokens": 1500, "ignore_eos": True}))
            head = json.loads(await ws.recv())
            assert head["type"] == "stream"
            for _ in range(5):
                assert json.loads(await ws.recv())["type"] == "chunk"
            running, usage = await _gauges(http, stack.decode_metrics)
            assert running == 1 and usage > idle_usage
            sent = time.perf_counter()
            await ws.send(json.dumps({"type": "cancel"}))
            while (await _gauges(http, stack.decode_metrics)) != (0, idle_usage):
                assert time.perf_counter() - sent < 5, "the decode engine never went idle"
                await asyncio.sleep(0.002)
            took_ms = (time.perf_counter() - sent) * 1000
            frames = [json.loads(f) async for f in ws]
            assert ws.close_code == 1000
    print(f"\ndecode engine: running 0 and KV usage back to {idle_usage} "
          f"{took_ms:.1f} ms after the cancel frame")
    assert frames[-1]["type"] == "done"
    assert frames[-2]["error"]["code"] == "stream_cancelled"
    # The bar is 100 ms; on a loaded 2-core CI box allow a margin.
    assert took_ms < 500, took_ms
