"""`python -m pdserve.bench.leak_check`: no lease outlives its request, whatever the client does.

Streams `--requests` chat completions through the edge (every one disaggregated,
distinct prompts), a `--cancel` share of them cut off by the client at a random
moment of its life: before the prefill, between prefill and decode, during the
pull or during decode. Then the prefill worker's leases must all have ended,
each with one outcome (`released + aborted + expired == opened`), and both
engines' KV usage must be back at its idle value. Prints the figures; exits 1
when anything leaked.

Against a running stack (`--url`, `--prefill`, `--prefill-metrics`,
`--decode-metrics`), or one it starts itself (`pdserve up`, tiny model).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

import aiohttp
import grpc

from pdserve.bench.deployments import metric_sum
from pdserve.v1 import transfer_pb2, transfer_pb2_grpc

from .engine_run import prompt_text, stdout_for_the_result

_USAGE = "vllm:kv_cache_usage_perc"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.leak_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--cancel", type=float, default=1 / 3, help="share cut off by the client")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24,
                   help="long enough that some cuts land during decode")
    p.add_argument("--words", type=int, default=120, help="prompt length, in words")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--model", default="models/tiny-llama", help="model dir")
    p.add_argument("--url", default="", help="a running edge (else start pdserve up)")
    p.add_argument("--prefill", default="", help="its prefill worker's gRPC address")
    p.add_argument("--prefill-metrics", default="")
    p.add_argument("--decode-metrics", default="")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


async def _one(http: aiohttp.ClientSession, url: str, model: str, prompt: str,
               max_tokens: int, cut_after: float | None) -> tuple[str, float]:
    """('completed' | 'cut before the response' | 'cut while streaming', seconds)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    started = time.perf_counter()
    state = {"phase": "cut before the response"}

    async def stream() -> None:
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            state["phase"] = "cut while streaming"
            async for _ in r.content:
                pass
        state["phase"] = "completed"

    if cut_after is None:
        await stream()
    else:
        try:
            await asyncio.wait_for(stream(), cut_after)   # closes the connection
        except asyncio.TimeoutError:
            pass
    return state["phase"], time.perf_counter() - started


async def _drive(args, url: str) -> dict:
    rng = random.Random(args.seed)
    prompts = [prompt_text(rng, args.words) for _ in range(args.requests + 4)]
    limit = asyncio.Semaphore(args.concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        # A few whole requests first: how long one lives, to cut the others inside it.
        warm = [await _one(http, url, args.model, p, args.max_tokens, None)
                for p in prompts[:4]]
        life = statistics.median(s for _, s in warm)

        async def request(prompt: str) -> str:
            cut = rng.uniform(0, 1.2 * life) if rng.random() < args.cancel else None
            async with limit:
                return (await _one(http, url, args.model, prompt, args.max_tokens, cut))[0]
        phases = await asyncio.gather(*(request(p) for p in prompts[4:]))
    return {"request_seconds_median": round(life, 4),
            **{k: phases.count(k) for k in ("completed", "cut before the response",
                                            "cut while streaming")}}


def _stats(prefill: str) -> dict:
    with grpc.insecure_channel(prefill) as ch:
        s = transfer_pb2_grpc.KVTransferStub(ch).Stats(transfer_pb2.LeaseStatsRequest(),
                                                        timeout=10)
    return {k: getattr(s, k) for k in ("open", "opened", "released", "aborted", "expired")}


def check(args, url: str, prefill: str, prefill_metrics: str, decode_metrics: str) -> dict:
    idle = {"prefill": metric_sum(prefill_metrics, _USAGE),
            "decode": metric_sum(decode_metrics, _USAGE)}
    before = _stats(prefill)
    load = asyncio.run(_drive(args, url))
    # Leases still open end within one lease (their decode is done or gone).
    deadline = time.monotonic() + 15
    while (after := _stats(prefill))["open"] and time.monotonic() < deadline:
        time.sleep(0.1)
    usage = {}
    while time.monotonic() < deadline:
        usage = {"prefill": metric_sum(prefill_metrics, _USAGE),
                 "decode": metric_sum(decode_metrics, _USAGE)}
        if all(usage[k] <= idle[k] + 1e-9 for k in usage):
            break
        time.sleep(0.2)
    leases = {k: after[k] - before[k] for k in ("opened", "released", "aborted", "expired")}
    ended = leases["released"] + leases["aborted"] + leases["expired"]
    return {"requests": args.requests, **load, "leases": leases, "leases_open": after["open"],
            "leases_ended_once": ended == leases["opened"] and after["open"] == 0,
            "kv_usage_idle": idle, "kv_usage_after": usage,
            "kv_usage_back_to_idle": all(usage[k] <= idle[k] + 1e-9 for k in idle),
            }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result = stdout_for_the_result()
    if args.url:
        out = check(args, args.url, args.prefill, args.prefill_metrics, args.decode_metrics)
    else:
        from pdserve.bench.deployments import Hardware, PdserveStack
        stack = PdserveStack("leak-check", args.model, local_prefill_below=0,
                             hw=Hardware(units=tuple(sorted(os.sched_getaffinity(0)))),
                             placement=("--prefill-saturated", "0",
                                        "--local-cached-fraction", "1"))
        try:
            url = stack.start()[0]
            out = check(args, url, stack.worker_addresses("prefill")[0], stack.prefill_metrics,
                        stack.decode_metrics[0])
        finally:
            stack.stop()
    ok = out["leases_ended_once"] and out["kv_usage_back_to_idle"]
    with result:
        if args.json:
            print(json.dumps(out | {"ok": ok}), file=result)
        else:
            for k, v in out.items():
                print(f"{k}: {v}", file=result)
            print("no leaks" if ok else "LEAKED", file=result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
