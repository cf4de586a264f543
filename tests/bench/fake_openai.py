"""An OpenAI-compatible completions endpoint that streams a fixed number of tokens
at a fixed pace: the bench client's timing is checked against a known schedule."""
from __future__ import annotations

import asyncio
import json

from aiohttp import web


class FakeCompletions:
    """Streams `max_tokens` one-character chunks, `gap_s` apart; records the prompts."""

    def __init__(self, gap_s: float, first_s: float):
        self.gap_s = gap_s
        self.first_s = first_s
        self.prompts: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.prompts.append(body["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.first_s)
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(self.gap_s)
            chunk = {"choices": [{"index": 0, "text": "ab"[i % 2]}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(body["prompt"].split()),
                 "completion_tokens": body["max_tokens"]}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        await self.runner.cleanup()
