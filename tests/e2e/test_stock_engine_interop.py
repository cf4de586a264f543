"""pdserve's router and edge in front of stock vLLM engines.

Two `python -m vllm.entrypoints.grpc_server` engines (vLLM's servicer, scheduler
and NixlConnector; pdserve's connector module is loaded only so that NIXL's
progress thread does not busy-poll a core each) are named on the router's command line;
the router finds them by probing vLLM's engine protocol, and pdserve's edge
runs prefill on one and decode on the other. The streamed text equals a single
engine's, and the decode engine computed only the last prompt token (prefix
caching is off on it, so every cached token came over NIXL).
"""
from __future__ import annotations

import json
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cases import CASES, MAX_TOKENS
from pdserve.config import KVTransferConfig
from support import (Proc, free_port, free_port_run, metric_sum, pdserve_cmd, stop_all,
                     wait_http)
from pdserve.transfer.connector import engine_kv_config


# vLLM's handshake listener thread dies on a taken side-channel port and the engine
# then waits for it for good: seen once in CI, the port taken between our check and
# the engine's bind. Such a start fails at once and is tried again on new ports.
PORT_TAKEN = "Address already in use"


def _stock_engine(model_dir, role: str, core: int, side_channel: int) -> tuple[Proc, str]:
    port = free_port()
    # The servicer would draw its KV-event publisher a random port of its own (it can
    # be the other engine's side channel, whose bind comes later): a socket file, as
    # pdserve's workers use (services/worker/engine.py).
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"ipc://{_events_path(port)}"}
    # vLLM's NixlConnector through pdserve's connector module (as the SMG runs
    # did): stock NIXL's progress thread busy-polls a core per engine, and two of them
    # held both cores of the CI box at 100 % system time (the edge could not start).
    kv = engine_kv_config("prefill" if role == "kv_producer" else "decode",
                          KVTransferConfig(side_channel_port=side_channel))
    proc = Proc([sys.executable, "-m", "vllm.entrypoints.grpc_server", "--model", str(model_dir),
                 "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
                 "--host", "127.0.0.1", "--port", str(port), "--no-enable-prefix-caching",
                 "--kv-transfer-config", json.dumps(kv),
                 "--kv-events-config", json.dumps(events)],
                # The servicer's planned warm-up (51 prefills up to 2,047 tokens) goes on
                # after "gRPC server started", beside the test's requests: on two cores
                # shared with the suite's stack one step took 135 s and a request 300 s.
                env={"SMG_VLLM_SERVICER_WARMUP": "off",
                     "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
                     "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel),
                     "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "UCX_NET_DEVICES": "lo"},
                name=f"stock-{role}")
    return proc, f"127.0.0.1:{port}"


def _events_path(port: int) -> str:
    return f"{tempfile.gettempdir()}/pdserve-test-kv-events-{port}"


def _logs(procs: list[Proc], last: int) -> str:
    return "\n".join(f"[{p.name}] {line}" for p in procs for line in p.lines[-last:])


def _stop(procs: list[Proc], addrs: list[str]) -> None:
    stop_all(procs, timeout=60)
    for addr in addrs:     # ZMQ leaves an ipc socket file behind
        Path(_events_path(int(addr.rsplit(":", 1)[1]))).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def stock_cluster(model_dir, reference):
    """Stock prefill + decode engines, pdserve's router (static workers) and edge.
    (After `reference`: three engines starting at once on two cores starve each other.)"""
    procs: list[Proc] = []
    addrs: list[str] = []
    try:
        for attempt in (1, 2):
            side = free_port_run(2)
            prefill, p_addr = _stock_engine(model_dir, "kv_producer", 0, side)
            decode, d_addr = _stock_engine(model_dir, "kv_consumer", 1, side + 1)
            procs, addrs = [prefill, decode], [p_addr, d_addr]
            try:
                for proc in procs:
                    proc.wait_for("gRPC server started", timeout=400, fatal=PORT_TAKEN)
                break
            except AssertionError as e:
                _stop(procs, addrs)
                if attempt == 2 or PORT_TAKEN not in str(e):
                    raise
        router_port, edge_port = free_port(), free_port()
        procs.append(Proc(pdserve_cmd("router", "--port", str(router_port),
                                      "--prefill-worker", p_addr, "--decode-worker", d_addr),
                          name="router"))
        procs.append(Proc(pdserve_cmd("edge", "--model", str(model_dir), "--port", str(edge_port),
                                      "--grpc-port", str(free_port()),
                                      "--router", f"127.0.0.1:{router_port}",
                                      # Stock workers offer no batched calls: per-request.
                                      "--decode-calls", "batched"), name="edge"))
        url = f"http://127.0.0.1:{edge_port}"
        wait_http(f"{url}/health", procs[-1], 300)     # a slow box imports slowly
        yield url, procs
    finally:
        _stop(procs, addrs)


def test_router_lists_the_stock_engines_it_probed(stock_cluster):
    url, _ = stock_cluster
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        workers = json.loads(r.read())["workers"]
    assert sorted(w["role"] for w in workers) == ["WORKER_ROLE_DECODE", "WORKER_ROLE_PREFILL"]
    assert all(w["serving"] and w["worker_id"].split("@")[0] in ("prefill", "decode")
               for w in workers)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_pdserve_edge_over_stock_engines_equals_single_engine(stock_cluster, model_dir,
                                                              reference, case):
    url, procs = stock_cluster
    before = metric_sum(f"{url}/metrics", "pdserve:kv_transferred_tokens_total")
    path = "chat/completions" if case.kind == "chat" else "completions"
    req = urllib.request.Request(f"{url}/v1/{path}",
                                 data=json.dumps(case.body(str(model_dir), False)).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        # Two stock engines spin their cores (and NIXL's progress threads) beside the
        # suite's own stack: a request can take a while on a 2-core box.
        r = urllib.request.urlopen(req, timeout=300)
    except TimeoutError:
        pytest.fail(f"no answer in 300 s; engines, router and edge log:\n{_logs(procs, 25)}")
    except urllib.error.HTTPError as e:
        pytest.fail(f"HTTP {e.code}: {e.read().decode(errors='replace')}\n"
                    f"engines, router and edge log:\n{_logs(procs, 40)}")
    with r:
        body = json.loads(r.read())
        if r.headers["x-pdserve-path"] != "disaggregated":
            pytest.fail(f"path {r.headers['x-pdserve-path']} "
                        f"({r.headers['x-pdserve-placement']}); router and edge log:\n"
                        f"{_logs(procs[2:], 30)}")
    choice = body["choices"][0]
    text = choice["message"]["content"] if case.kind == "chat" else choice["text"]
    assert text == reference[case.name]["text"]
    ref = reference[case.name]["usage"]
    assert body["usage"]["prompt_tokens"] == ref["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == ref["completion_tokens"] == MAX_TOKENS
    moved = metric_sum(f"{url}/metrics", "pdserve:kv_transferred_tokens_total") - before
    prompt = body["usage"]["prompt_tokens"]
    assert prompt - 1 <= moved <= prompt
    # Asked for batched decode calls, the edge found the stock worker has none.
    assert any("per-request decode calls" in line for line in procs[-1].lines)
