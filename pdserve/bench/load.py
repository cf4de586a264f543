"""Send a workload to OpenAI-compatible endpoints and time every streamed token.

Arrivals come from vLLM's `get_request` (Poisson at the given rate), each
request is vLLM's own streaming completions client, and the figures are vLLM's
`calculate_metrics` (TTFT to the first streamed chunk, TPOT over the rest, ITL
between chunks): the same definitions as `vllm bench serve`. Several endpoints
are served round-robin by the client itself (no proxy in the timed path).
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import sys
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
from vllm.benchmarks.datasets import SampleRequest
from vllm.benchmarks.lib.endpoint_request_func import (
    RequestFuncInput,
    RequestFuncOutput,
    async_request_openai_chat_completions,
    async_request_openai_completions,
)
from vllm.benchmarks.serve import calculate_metrics, get_request

from .workloads import Session, Workload


@dataclass(slots=True)
class RunResult:
    """Every request's timings of one run, in the order they were sent."""

    requests: list[SampleRequest]
    outputs: list[RequestFuncOutput]
    duration_s: float


class Client:
    """Streams completions (or chat completions, one user turn) to `base_urls` in turn."""

    def __init__(self, base_urls: list[str], model: str, session: aiohttp.ClientSession,
                 chat: bool = False):
        path = "/v1/chat/completions" if chat else "/v1/completions"
        self.urls = [u.rstrip("/") + path for u in base_urls]
        self.request = (async_request_openai_chat_completions if chat
                        else async_request_openai_completions)
        self.model = model
        self.session = session
        self.sent = 0

    async def complete(self, prompt: str, prompt_len: int, output_len: int) -> RequestFuncOutput:
        url = self.urls[self.sent % len(self.urls)]
        self.sent += 1
        # ignore_eos: the tiny model has random weights; every request must
        # decode exactly output_len tokens for runs to be comparable.
        req = RequestFuncInput(prompt=prompt, api_url=url, prompt_len=prompt_len,
                               output_len=output_len, model=self.model, ignore_eos=True,
                               extra_body={"temperature": 0})
        return await self.request(req, self.session)


async def _run_requests(client: Client, reqs: list[SampleRequest], rate: float,
                        burstiness: float = 1.0) -> list:
    tasks = []
    async for req, _ in get_request(reqs, rate, burstiness):
        tasks.append(asyncio.create_task(
            client.complete(req.prompt, req.prompt_len, req.expected_output_len)))
    return list(await asyncio.gather(*tasks))


async def _run_session(client: Client, session: Session, sent: list, got: list) -> None:
    history = ""
    for turn in session.turns:
        prompt = history + turn.prompt
        out = await client.complete(prompt, 0, turn.expected_output_len)
        sent.append(SampleRequest(prompt=prompt, prompt_len=out.prompt_len,
                                  expected_output_len=turn.expected_output_len))
        got.append(out)
        if not out.success:
            return  # a conversation cannot go on without its answer
        history = prompt + out.generated_text


async def _run_sessions(client: Client, sessions: list[Session], rate: float,
                        sent: list, got: list) -> None:
    tasks = []
    # Session starts are Poisson at `rate`; vLLM's generator paces them.
    starts = [SampleRequest(prompt="", prompt_len=0, expected_output_len=0) for _ in sessions]
    i = 0
    async for _, _ in get_request(starts, rate):
        tasks.append(asyncio.create_task(_run_session(client, sessions[i], sent, got)))
        i += 1
    await asyncio.gather(*tasks)


async def run(workload: Workload, base_urls: list[str], model: str, rate: float,
              seed: int = 0, chat: bool = False, burstiness: float = 1.0) -> RunResult:
    """Send `workload` at `rate` (requests/s; sessions/s for sessions). `burstiness`:
    vLLM's gamma shape of the gaps between requests (1: Poisson; larger: more even)."""
    np.random.seed(seed)  # vLLM's arrival generator draws from numpy's global RNG
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        client = Client(base_urls, model, http, chat=chat)
        start = time.perf_counter()
        if workload.sessions:
            sent: list = []
            got: list = []
            await _run_sessions(client, workload.sessions, rate, sent, got)
        else:
            sent = workload.requests
            got = await _run_requests(client, sent, rate, burstiness)
        return RunResult(sent, got, time.perf_counter() - start)


def metrics(result: RunResult, tokenizer, percentiles=(50, 90, 99)):
    """vLLM's `BenchmarkMetrics` for a run (its print-outs go nowhere)."""
    with contextlib.redirect_stdout(io.StringIO()):
        m, _ = calculate_metrics(result.requests, result.outputs, result.duration_s,
                                 tokenizer, list(percentiles), {})
    return m


def latency_figures(m) -> dict:
    """The p50/p99 TTFT, TPOT and ITL of vLLM's `BenchmarkMetrics`, in ms."""
    out = {}
    for name, pairs in (("ttft", m.percentiles_ttft_ms), ("tpot", m.percentiles_tpot_ms),
                        ("itl", m.percentiles_itl_ms)):
        for p in (50, 99):
            out[f"{name}_p{p}_ms"] = round(float(dict(pairs)[p]), 2)
    return out


def progress(msg: str) -> None:
    """A timestamped progress line on stderr (stdout carries results)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def warm_up(base_urls: list[str], model: str, chat: bool = False) -> None:
    """One short request per endpoint, so that first-call costs (NIXL handshake,
    lazy allocations) stay out of the timed runs."""
    async with aiohttp.ClientSession() as http:
        client = Client(base_urls, model, http, chat=chat)
        for _ in base_urls:
            out = await client.complete("warm up " * 200, 0, 4)
            if not out.success:
                raise RuntimeError(f"warm-up request failed: {out.error[-500:]}")
