"""The serving part of `pdserve plan profile`: KV transfer by prompt length and what the
edge and the router add, measured through a real `pdserve up` (1 prefill + 1 decode
worker, each on its own core; every prompt prefilled remotely).

- transfer: requests of N random prompt tokens through the edge, disaggregated; the
  decode engine's connector's own `vllm:nixl_xfer_time_seconds` (sum / count), read
  before and after each length: the pull alone, not the handshake or the lease claim;
- overheads: short prompts streamed through the edge (HTTP, SSE), one at a time, beside
  the time their two legs spent inside the engines (vLLM's own
  `vllm:e2e_request_latency_seconds` on each worker). Per request, the client's TTFT
  minus the prefill engine's time; per token, the rest of the stream minus the decode
  engine's time, over the tokens. The router's part is one `Route` round trip (gRPC,
  unary, timed from here), taken out of the per-request figure so the two add up.
  What remains is the edge's and the workers' servicers' (gRPC, the HTTP hop, the
  edge's own work): everything between the client and the engines.
"""
from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request
from dataclasses import dataclass

from pdserve.bench.engine_run import XFER_SECONDS, complete_disaggregated, nixl_series, series_total


@dataclass(frozen=True)
class StackSpec:
    """The points of the serving part."""

    transfer_tokens: tuple[int, ...]
    transfer_requests: int = 4          # per length
    overhead_reps: int = 8              # requests streamed through the edge
    overhead_prompt: int = 256          # tokens of the overheads' prompt
    overhead_output: int = 32           # tokens of its output
    seed: int = 0


def transfer_points(url: str, model: str, metrics: str, spec: StackSpec,
                    rng: random.Random, log=print) -> list[dict]:
    """Mean connector transfer ms per request, by prompt tokens."""
    points = []
    for tokens in spec.transfer_tokens:
        before = nixl_series(metrics)
        for _ in range(spec.transfer_requests):
            complete_disaggregated(url, model, _ids(rng, tokens))
        after = nixl_series(metrics)
        count, seconds = (series_total(after, f"{XFER_SECONDS}_{part}")
                          - series_total(before, f"{XFER_SECONDS}_{part}")
                          for part in ("count", "sum"))
        if count <= 0:
            raise RuntimeError(f"no NIXL transfer reported for {tokens}-token prompts")
        points.append({"tokens": tokens, "ms": round(1000 * seconds / count, 3),
                       "transfers": int(count)})
        log(f"transfer {tokens:>6} tokens: {points[-1]['ms']:.2f} ms ({int(count)} pulls)")
    return points


def _ids(rng: random.Random, n: int) -> list[int]:
    """Random ids, distinct prompts (no prefix cache hits): past the tiny model's special
    tokens (0..4) and within any vocabulary of 4,000 or more."""
    return [rng.randrange(16, 4000) for _ in range(n)]


def edge_stream(url: str, model: str, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(ms to the first token, ms to the last) of one streamed completion via the edge."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start, first, last = time.perf_counter(), None, None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"text"' in line:
                last = time.perf_counter()
                first = first or last
    if first is None:
        raise RuntimeError("the edge streamed no token")
    return (first - start) * 1000, (last - start) * 1000


def route_ms(router: str, model: str, ids: list[int], reps: int) -> float:
    """Median round trip of a unary `Route` (what placing one request costs)."""
    import grpc

    from pdserve.v1 import router_pb2, router_pb2_grpc

    times = []
    with grpc.insecure_channel(router) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        for i in range(reps + 1):
            t0 = time.perf_counter()
            stub.Route(router_pb2.RouteRequest(request_id=f"profile-route-{i}", model=model,
                                               prompt_tokens=len(ids), prompt_token_ids=ids),
                       timeout=10)
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times[1:])                 # the first opens the channel


E2E_SECONDS = "vllm:e2e_request_latency_seconds"
ITL_SECONDS = "vllm:inter_token_latency_seconds"


def engine_ms(before: str, after: str, name: str = E2E_SECONDS) -> float:
    """Mean ms of histogram `name` between two reads of an engine's metrics page: by
    default what a request spent in the engine (arrival to finish, vLLM's own)."""
    from pdserve.bench.deployments import samples_sum
    count = samples_sum(after, f"{name}_count") - samples_sum(before, f"{name}_count")
    if count <= 0:
        raise RuntimeError(f"the engine reported no {name} sample")
    return 1000 * (samples_sum(after, f"{name}_sum") - samples_sum(before, f"{name}_sum")) / count


def overheads(edge: list[tuple[float, float]], prefill_ms: float, decode_ms: float,
              route: float, output: int) -> dict:
    """The profile's `overheads` from the edge's (first, last) token ms of each request
    of `output` tokens, the mean ms its prefill and decode legs spent in their engines,
    and the router's round trip `route` ms; never below 0 (a negative difference is
    noise)."""
    ttft = statistics.fmean(f for f, _ in edge)
    span = statistics.fmean(last - f for f, last in edge)
    return {"edge_request_ms": round(max(0.0, ttft - prefill_ms - route), 3),
            "edge_token_ms": round(max(0.0, (span - decode_ms) / (output - 1)), 4),
            "router_request_ms": round(route, 3)}


def measure_overheads(url: str, model: str, router: str, pages: dict[str, str],
                      spec: StackSpec, rng: random.Random, log=print) -> tuple[dict, dict]:
    """Streamed requests through the edge at `url`, one at a time, beside their legs'
    own times in the engines (`pages`: the prefill and the decode worker's metrics
    URLs); then the round trip of the `router` (host:port). The overheads, and what
    they came from."""
    from pdserve.bench.deployments import metrics_page
    before = {role: metrics_page(u) for role, u in pages.items()}
    edge = [edge_stream(url, model, _ids(rng, spec.overhead_prompt), spec.overhead_output)
            for _ in range(spec.overhead_reps)]
    after = {role: metrics_page(u) for role, u in pages.items()}
    legs = {f"{role}_engine_ms": round(engine_ms(before[role], after[role]), 3)
            for role in pages}
    # The decode engine's own gap between tokens, serving (AsyncLLM in a worker): beside
    # the profile's bare engine steps, what a worker adds to each.
    legs["decode_engine_itl_ms"] = round(engine_ms(before["decode"], after["decode"],
                                                   ITL_SECONDS), 3)
    route = route_ms(router, model, _ids(rng, spec.overhead_prompt), spec.overhead_reps)
    out = overheads(edge, legs["prefill_engine_ms"], legs["decode_engine_ms"], route,
                    spec.overhead_output)
    raw = {"overhead_prompt_tokens": spec.overhead_prompt,
           "overhead_output_tokens": spec.overhead_output, **legs,
           "edge_ttft_ms": round(statistics.fmean(f for f, _ in edge), 3),
           "edge_last_token_ms": round(statistics.fmean(last for _, last in edge), 3)}
    log(f"overheads: {out} (means of {spec.overhead_reps}: {raw})")
    return out, raw


def sweep(model: str, hw, spec: StackSpec, log=print) -> dict:
    """Start `pdserve up` for `model` on `hw`, measure transfer and overheads, stop it."""
    from pdserve.bench.deployments import PdserveStack

    stack = PdserveStack("plan-profile", model, local_prefill_below=0, hw=hw,
                         placement=("--prefill-saturated", "0"))
    rng = random.Random(spec.seed)
    try:
        url = stack.start()[0]
        complete_disaggregated(url, model, _ids(rng, 256))     # handshake, first pull
        transfer = transfer_points(url, model, stack.decode_metrics[0], spec, rng, log)
        over, legs = measure_overheads(url, model, f"127.0.0.1:{stack.ports['router']}",
                                       stack.worker_metrics(), spec, rng, log)
        return {"transfer": transfer, "overheads": over, "legs": legs}
    finally:
        stack.stop()
