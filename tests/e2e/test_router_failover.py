"""A router replica of `pdserve up --routers 2` stops under a steady load of streams, on
real processes: no stream fails, new requests keep being admitted, the edge's /health
stays 200, `up` restarts the replica, the workers register with it again and its
prefix view fills from the traffic that follows. First the replica the edge uses is
SIGKILLed (the edge moves to the other), then that one is SIGTERMed (the edge moves
back): the stack ends as it began, for the session's later tests."""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal

import aiohttp
import grpc
import psutil
from prometheus_client.parser import text_string_to_metric_families

from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

CLIENTS = 4
TOKENS = 24                      # a stream of well under a second here
AFTER = 3 * CLIENTS              # streams to see admitted after the stop


def _replica_pid(stack, address: str) -> int:
    port = address.rsplit(":", 1)[1]
    for c in psutil.Process(stack.proc.popen.pid).children():
        args = c.cmdline()
        if "router" in args and args[args.index("--port") + 1] == port:
            return c.pid
    raise AssertionError(f"no router process on {address}")


async def _stream(http: aiohttp.ClientSession, stack, prompt: str = "the dog") -> str:
    """'' for a stream that ran to its end, else what went wrong."""
    body = {"model": stack.model, "prompt": prompt, "max_tokens": TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{stack.url}/v1/completions", json=body) as r:
        if r.status != 200:
            return f"{r.status}: {await r.text()}"
        tokens, last = 0, b""
        async for line in r.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    return json.dumps(event["error"])
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
            last = line.strip() or last
        return "" if last == b"data: [DONE]" and tokens == TOKENS else f"{tokens}, {last!r}"


async def _placed(http, url: str) -> float:
    """The Route answers a replica placed (its /metrics at `url`)."""
    async with http.get(url) as r:
        text = await r.text()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pdserve:router_decisions_total")


async def _serving(address: str) -> set[int]:
    """The roles `address`'s replica offers requests to ({} while it is away)."""
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            resp = await router_pb2_grpc.RouterStub(ch).ListWorkers(
                router_pb2.ListWorkersRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return set()
    return {w.role for w in resp.workers if w.serving}


async def _stop_under_load(stack, http, address: str, sig: int) -> None:
    """Streams and /health probes run while `address`'s replica gets `sig`."""
    outcomes, after, health, stopped = [], [], [], asyncio.Event()

    def done() -> bool:
        return stopped.is_set() and len(after) >= AFTER

    async def client():
        while not done():
            late = stopped.is_set()                     # admitted after the stop
            outcomes.append(failure := await _stream(http, stack))
            if late:
                after.append(failure)

    async def probe():
        while not done():
            async with http.get(f"{stack.url}/health") as r:
                health.append(r.status)
            await asyncio.sleep(0.05)

    async def stop():
        while len(outcomes) < CLIENTS:                  # a steady load first
            await asyncio.sleep(0.05)
        os.kill(_replica_pid(stack, address), sig)
        stopped.set()

    await asyncio.wait_for(asyncio.gather(*[client() for _ in range(CLIENTS)], probe(),
                                          stop()), timeout=60)
    failed = [o for o in outcomes if o]
    assert not failed, f"{len(failed)} of {len(outcomes)} streams failed: {failed[:3]}"
    assert len(after) >= AFTER and set(health) == {200}, (len(after), sorted(set(health)))


async def _back(stack, address: str, name: str) -> None:
    """`up` restarts the replica and both workers register with it again."""
    await asyncio.to_thread(stack.proc.wait_for, f"{name} exited", 20)
    for _ in range(200):
        if await _serving(address) == {common_pb2.WORKER_ROLE_PREFILL,
                                       common_pb2.WORKER_ROLE_DECODE}:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} never held the pool again after its restart")


async def _cached_tokens(stack, http, address: str, prompt: str) -> int:
    """What `address`'s replica knows the decode worker holds of `prompt`."""
    async with http.post(f"{stack.url}/tokenize",
                         json={"model": stack.model, "prompt": prompt}) as r:
        ids = (await r.json())["tokens"]
    async with grpc.aio.insecure_channel(address) as ch:
        answer = await router_pb2_grpc.RouterStub(ch).Route(
            router_pb2.RouteRequest(request_id=secrets.token_hex(4), model=stack.model,
                                    prompt_tokens=len(ids), prompt_token_ids=ids), timeout=5)
    return answer.cached_tokens


async def test_a_router_replica_stops_under_load_and_comes_back(stack):
    first, second = stack.routers
    first_metrics, second_metrics = stack.routers_metrics
    async with aiohttp.ClientSession() as http:
        before = await _placed(http, second_metrics)
        await _stop_under_load(stack, http, first, signal.SIGKILL)   # the one the edge uses
        # The streams admitted after the stop were placed by the other replica.
        assert await _placed(http, second_metrics) - before >= AFTER
        await _back(stack, first, "router-0")
        # Its prefix view was lost with it; the traffic that follows fills it again.
        prompt = f"Ledger {secrets.token_hex(8)}: " + "an account moved some units. " * 12
        assert await _cached_tokens(stack, http, first, prompt) == 0
        assert await _stream(http, stack, prompt) == ""
        for _ in range(50):
            if (cached := await _cached_tokens(stack, http, first, prompt)) > 0:
                break
            await asyncio.sleep(0.1)
        assert cached > 0, "the restarted replica never saw the decode worker's new blocks"
        before = await _placed(http, first_metrics)
        await _stop_under_load(stack, http, second, signal.SIGTERM)  # the edge moved to it
        assert await _placed(http, first_metrics) - before >= AFTER   # and moved back
        await _back(stack, second, "router-1")
