"""Where a cold request's time goes, from the services' own spans: one `pdserve up`
(1 prefill + 1 decode, every prompt prefilled remotely, tracing on into an
in-process OTLP collector), `--requests` random 1,024-token chat prompts at
`--rate`, none cached; prints the clients' TTFT and each span's median duration
per service.

    pdserve bench spans --requests 20 --rate 1
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import time

from pdserve.bench.deployments import Hardware, PdserveStack
from pdserve.bench.load import run, warm_up
from pdserve.bench.otlp_collector import Collector
from pdserve.bench.workloads import random_1024


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench spans", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20, help="1,024-token chat prompts")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--model", default="models/tiny-llama", help="model dir")
    p.add_argument("--router-in-edge", action="store_true",
                   help="`pdserve up --router-in-edge`: no router process, placement in the edge")
    p.add_argument("--slowest", type=int, default=3,
                   help="print the spans of this many slowest requests, beside the median one")
    a = p.parse_args(argv)
    model = os.path.abspath(a.model)
    collector = Collector()
    # The stack's processes inherit this environment: the standard OTEL_* variables.
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": collector.http_endpoint,
                       "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                       "OTEL_BSP_SCHEDULE_DELAY": "200"})
    stack = PdserveStack("ttft-spans", model, 0, Hardware(units=tuple(sorted(
        os.sched_getaffinity(0)))), placement=("--prefill-saturated", "0")
        + (("--router-in-edge",) if a.router_in_edge else ()))
    try:
        urls = stack.start()
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model)

        async def measured():
            await warm_up(urls, model, chat=True)
            return await run(random_1024(tokenizer, a.requests, 777), urls, model, a.rate, 0,
                             chat=True)
        result = asyncio.run(measured())
        time.sleep(2)                               # the exporters' last batches
    finally:
        stack.stop()
        collector.stop()
    ttfts = sorted(1000 * o.ttft for o in result.outputs if o.success)
    print(f"TTFT p50 {statistics.median(ttfts):.1f} ms over {len(ttfts)} requests")
    _slowest(collector.spans, result.outputs, a.slowest)
    durations, starts = collections.defaultdict(list), collections.defaultdict(list)
    first = {}
    for s in collector.spans:
        first[s.trace_id] = min(first.get(s.trace_id, s.start_ns), s.start_ns)
    for s in collector.spans:
        durations[(s.service, s.name)].append((s.end_ns - s.start_ns) / 1e6)
        starts[(s.service, s.name)].append((s.start_ns - first[s.trace_id]) / 1e6)
    print("each span: its median duration, and its median start after its trace's first span")
    for (service, name), ms in sorted(durations.items()):
        print(f"{service:>16}  {name:<45} n={len(ms):3}  p50 {statistics.median(ms):9.2f} ms"
              f"  starts +{statistics.median(starts[(service, name)]):8.2f} ms")
    return 0


def _slowest(spans, outputs, k: int) -> None:
    """The span timeline of the `k` slowest requests and the median one. Requests go
    one by one, so the n-th trace (by its first span's start) is the n-th request."""
    traces = collections.defaultdict(list)
    for s in spans:
        traces[s.trace_id].append(s)
    ordered = sorted((t for t in traces.values() if any(s.name.startswith("POST ") for s in t)),
                     key=lambda t: min(s.start_ns for s in t))
    if len(ordered) != len(outputs) + 1:                 # + the warm-up request
        print(f"{len(ordered)} traces for {len(outputs)} requests: not matched")
        return
    by_ttft = sorted(range(len(outputs)), key=lambda i: outputs[i].ttft)
    for i in by_ttft[::-1][:k] + [by_ttft[len(by_ttft) // 2]]:
        trace = sorted(ordered[i + 1], key=lambda s: s.start_ns)
        t0 = trace[0].start_ns
        print(f"request {i}: TTFT {1000 * outputs[i].ttft:.1f} ms")
        for s in trace:
            print(f"  {s.service:>16}  {s.name:<45} +{(s.start_ns - t0) / 1e6:8.2f} "
                  f"{(s.end_ns - s.start_ns) / 1e6:8.2f} ms")

