"""The serving part of `pdserve plan profile`: KV transfer by prompt length and what the
edge and the router add, measured through a real `pdserve up` (1 prefill + 1 decode
worker, each on its own core; every prompt prefilled remotely).

- transfer: requests of N random prompt tokens through the edge, disaggregated; the
  decode engine's connector's own `vllm:nixl_xfer_time_seconds` (sum / count), read
  before and after each length: the pull alone, not the handshake or the lease claim;
- overheads: the same short prompt and output, alternately straight to the workers
  over vLLM's engine protocol (the prefill leg, then the decode leg with the pulled KV,
  as `pdserve bench legs` does) and through the edge (HTTP, SSE). The edge adds, per
  request, its TTFT minus the prefill leg's, and per token, the difference of the
  inter-token times; the router's part is one `Route` round trip (gRPC, unary, timed
  from here), taken out of the edge's per-request figure so the two add up.
"""
from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request
import uuid
from dataclasses import dataclass

from pdserve.bench.engine_run import XFER_SECONDS, complete_disaggregated, nixl_series, series_total


@dataclass(frozen=True)
class StackSpec:
    """The points of the serving part."""

    transfer_tokens: tuple[int, ...]
    transfer_requests: int = 4          # per length
    overhead_reps: int = 8              # pairs of (direct, through the edge)
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
        count = series_total(after, f"{XFER_SECONDS}_count") - series_total(before, f"{XFER_SECONDS}_count")
        if count <= 0:
            raise RuntimeError(f"no NIXL transfer reported for {tokens}-token prompts")
        seconds = series_total(after, f"{XFER_SECONDS}_sum") - series_total(before, f"{XFER_SECONDS}_sum")
        points.append({"tokens": tokens, "ms": round(1000 * seconds / count, 3),
                       "transfers": int(count)})
        log(f"transfer {tokens:>6} tokens: {points[-1]['ms']:.2f} ms ({int(count)} pulls)")
    return points


def _ids(rng: random.Random, n: int) -> list[int]:
    """Random ids past the tiny model's special tokens (0..4): no prefix cache hits."""
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


def direct_legs(prefill, decode, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(ms to the first token, ms to the last) straight to the workers (engine-protocol
    stubs): the prefill leg (its token is the first), then the decode leg with the
    prefill's KV."""
    from pdserve.bench.legs import decode_leg
    from pdserve.services.edge.engine_requests import prefill_request
    from pdserve.v1 import common_pb2

    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens - 1,
                                         ignore_eos=True)
    rid = f"profile-{uuid.uuid4().hex}"
    t0 = time.perf_counter()
    done = list(prefill.Generate(prefill_request(rid, ids, sampling), timeout=120))[-1].complete
    first = (time.perf_counter() - t0) * 1000
    _, rest = decode_leg(decode, rid, ids, sampling, json.loads(done.kv_transfer_params_json))
    return first, first + rest


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


def overheads(med: dict[str, tuple[float, float]], route: float) -> dict:
    """The profile's `overheads` from the median (TTFT, inter-token) ms of each path
    ({"direct": ..., "edge": ...}) and the router's round trip `route` ms; never
    below 0 (the edge adds work; a negative difference is noise)."""
    request = med["edge"][0] - med["direct"][0]
    return {"edge_request_ms": round(max(0.0, request - route), 3),
            "edge_token_ms": round(max(0.0, med["edge"][1] - med["direct"][1]), 4),
            "router_request_ms": round(route, 3)}


def measure_overheads(url: str, model: str, stack, spec: StackSpec, rng: random.Random,
                      log=print) -> tuple[dict, dict]:
    """Paired direct and edge runs of one prompt length, then the router's round trip:
    the overheads, and the medians they came from."""
    import grpc
    from smg_grpc_proto import vllm_engine_pb2_grpc

    legs: dict[str, list] = {"direct": [], "edge": []}
    with grpc.insecure_channel(stack.worker_addresses("prefill")[0]) as p, \
            grpc.insecure_channel(stack.worker_addresses("decode")[0]) as d:
        prefill, decode = (vllm_engine_pb2_grpc.VllmEngineStub(c) for c in (p, d))
        for i in range(spec.overhead_reps + 1):        # the first opens the channels
            direct = direct_legs(prefill, decode, _ids(rng, spec.overhead_prompt),
                                 spec.overhead_output)
            edge = edge_stream(url, model, _ids(rng, spec.overhead_prompt),
                               spec.overhead_output)
            if i:
                legs["direct"].append(direct)
                legs["edge"].append(edge)
    route = route_ms(f"127.0.0.1:{stack.ports['router']}", model,
                     _ids(rng, spec.overhead_prompt), spec.overhead_reps)
    med = {k: medians(v, spec.overhead_output) for k, v in legs.items()}
    out = overheads(med, route)
    raw = {f"{k}_{part}_ms": v for k in med for part, v in zip(("ttft", "itl"), med[k])}
    log(f"overheads: {out} (medians of {spec.overhead_reps}: {raw})")
    return out, {"overhead_prompt_tokens": spec.overhead_prompt,
                 "overhead_output_tokens": spec.overhead_output, **raw}


def medians(runs: list[tuple[float, float]], output: int) -> tuple[float, float]:
    """Median TTFT and inter-token ms of `runs` ((first, last) ms each) of `output`
    tokens each."""
    return (round(statistics.median(f for f, _ in runs), 3),
            round(statistics.median((last - f) / (output - 1) for f, last in runs), 3))


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
        over, legs = measure_overheads(url, model, stack, spec, rng, log)
        return {"transfer": transfer, "overheads": over, "legs": legs}
    finally:
        stack.stop()
