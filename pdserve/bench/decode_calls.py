"""Per-request against batched decode calls at a low rate, paired: two edges, one with
each `--decode-calls`, on one router and one pair of real workers; the same chat
workload goes through each in turn, `--reps` times in alternating order, and each
edge process's own CPU per request is read (the router and workers are shared, so
only the edges can differ). Prints one JSON object.

    pdserve bench decode-calls --reps 4 --requests 30 --rate 1

`--stack-edge` says which mode the `pdserve up` edge runs (the other edge is
started beside it), to tell the mode from which edge came first.

`--beside-tree PATH` pairs two versions of the code instead: the edge beside runs
the same mode from another checkout (e.g. `git worktree add /tmp/base <commit>`),
and the result's edges are `this_tree` and `beside_tree`.

    pdserve bench decode-calls --reps 4 --beside-tree /tmp/base

`--beside-env NAME=VALUE` (repeatable) pairs two environments of this checkout: the
edge beside runs the same mode with these variables set, and the result's edges are
`up_edge` and `beside_env`. For example, gRPC's EventEngine I/O threads (the default
before the edge turned them off) against the edge's own setting:

    pdserve bench decode-calls --reps 4 --beside-env GRPC_EXPERIMENTS=
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import psutil

from pdserve.bench.deployments import Hardware, PdserveStack, processes, free_port, gateway_pids
from pdserve.bench.gateways import _runs

MODES = ("per-request", "batched")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench decode-calls", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=4, help="runs per edge, in alternating order")
    p.add_argument("--requests", type=int, default=30, help="per rep and edge")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--stack-edge", choices=MODES, default="per-request",
                   help="the `pdserve up` edge's --decode-calls (the edge beside: the other)")
    p.add_argument("--model", default="models/tiny-llama", help="model dir")
    p.add_argument("--beside-tree", help="run the edge beside from this checkout, same mode")
    p.add_argument("--beside-env", action="append", default=[], metavar="NAME=VALUE",
                   help="run the edge beside with this variable set, same mode")
    a = p.parse_args(argv)
    env = dict(v.split("=", 1) for v in a.beside_env)
    model = os.path.abspath(a.model)
    paired = a.beside_tree or env
    other = a.stack_edge if paired else MODES[1 - MODES.index(a.stack_edge)]
    names = (("this_tree", "beside_tree") if a.beside_tree else
             ("up_edge", "beside_env") if env else (a.stack_edge, other))
    tree = os.path.abspath(a.beside_tree) if a.beside_tree else None
    hw = Hardware(units=tuple(sorted(os.sched_getaffinity(0))))
    # Every prompt prefilled remotely, as in `pdserve bench gateways`.
    stack = PdserveStack("decode-calls", model, 0, hw,
                         placement=("--prefill-saturated", "0", "--decode-calls", a.stack_edge))
    beside = processes("edge-beside")
    try:
        first = stack.start()[0]
        edge = [pid for pid in gateway_pids(stack.up_pid)
                if "edge" in psutil.Process(pid).cmdline()]
        port = free_port()
        beside.start([sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "edge",
                      "--port", str(port), "--grpc-port", str(free_port()),
                      "--router", f"127.0.0.1:{stack.ports['router']}", "--model", model,
                      "--max-model-len", str(hw.max_model_len), "--decode-calls", other],
                     {**env, **({"PYTHONPATH": tree} if tree else {})}, cwd=tree)
        second = f"http://127.0.0.1:{port}"
        beside.wait_healthy([second + "/health"])
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model)
        edges = {names[0]: ([first], edge), names[1]: ([second], beside.pids())}
        res = asyncio.run(_runs(edges, model, tokenizer, a.requests, a.rate, a.reps, 0))
    finally:
        beside.stop()
        stack.stop()
    cpu = {m: res[m]["gateway_cpu_ms_per_request"] for m in names}
    out = {"stack_edge": a.stack_edge, "rate": a.rate, "requests": a.requests, "reps": a.reps,
           "edges": res}
    if tree:
        out |= {"beside_tree": tree, "edge_cpu_this_over_beside":
                round(cpu["this_tree"] / cpu["beside_tree"], 3)}
    elif env:
        out |= {"beside_env": env, "edge_cpu_up_over_beside":
                round(cpu["up_edge"] / cpu["beside_env"], 3)}
    else:
        out["edge_cpu_batched_over_per_request"] = round(cpu["batched"] / cpu["per-request"], 3)
    print(json.dumps(out))
    return 0

