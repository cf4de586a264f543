"""The router sees each worker's real load: its engine's running + waiting requests,
its capacity (max_num_seqs) and KV usage, as the worker's load records report them
(ListWorkers carries them; placement and the edge's admission use them)."""
from __future__ import annotations

import json
import time
import urllib.request

import grpc

from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc


def _decode(stack) -> router_pb2.WorkerInfo:
    with grpc.insecure_channel(stack.router) as ch:
        workers = router_pb2_grpc.RouterStub(ch).ListWorkers(router_pb2.ListWorkersRequest(),
                                                             timeout=5).workers
    return next(w for w in workers if w.role == common_pb2.WORKER_ROLE_DECODE)


def test_list_workers_reports_the_engines_load_capacity_and_kv(stack):
    assert _decode(stack).capacity == 64                       # pdserve up's --max-num-seqs
    body = json.dumps({"model": stack.model, "prompt": "the dog " * 100, "max_tokens": 1500,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"{stack.url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.readline()
        deadline, seen = time.monotonic() + 10, None
        while time.monotonic() < deadline:
            seen = _decode(stack)
            if seen.load >= 1 and seen.kv_usage > 0:
                break
            time.sleep(0.1)
        assert seen.load >= 1 and seen.kv_usage > 0, seen
        sid = r.headers["x-pdserve-stream-id"]
    urllib.request.urlopen(urllib.request.Request(f"{stack.url}/v1/streams/{sid}",
                                                  method="DELETE"), timeout=10).read()
    deadline = time.monotonic() + 10
    while (seen := _decode(stack)).load and time.monotonic() < deadline:
        time.sleep(0.1)
    assert seen.load == 0 and seen.kv_usage == 0, seen
