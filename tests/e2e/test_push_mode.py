"""`pdserve up --kv-transfer-mode push`: the prefill engine WRITEs the prompt's
blocks into the decode engine's (vLLM's NixlPushConnector, with pdserve's tuning
and leases), and the tokens equal a single engine's, as on the pull path.

This stack also runs on IPv6 (`--host ::`): the edge on every address, IPv4 too, the
router and workers on ::1, registered as [::1]:PORT, the KV on an IPv6 side channel."""
from __future__ import annotations

import json
import time
import urllib.request

import psutil
import pytest

from cases import CASES, MAX_TOKENS
from pdserve.tiny_model import long_context_copy
from support import (Proc, free_port, free_port_run, ipv6_loopback, metric_sum, parse_sse,
                     up_cmd)
from pdserve.bench.pull_vs_push import make_prompts, measure


@pytest.fixture(scope="module")
def push(model_dir, reference):
    ports = {k: free_port() for k in ("edge", "grpc", "router", "prefill", "decode")}
    metrics, kv = free_port_run(2), free_port_run(2)
    host, loop = ("::", "[::1]") if ipv6_loopback() else ("127.0.0.1", "127.0.0.1")
    proc = Proc(up_cmd(ports, model_dir, kv, metrics, "--host", host,
                       "--kv-transfer-mode", "push",
                       # Every case on the P/D path (as the pull stack's equality tests).
                       "--local-cached-fraction", "1", "--prefill-saturated", "0"),
                name="pdserve-push")
    try:
        proc.wait_for("pdserve ready", timeout=400)
        yield {"url": f"http://{loop}:{ports['edge']}", "model": str(model_dir),
               "prefill_metrics": f"http://{loop}:{metrics}/metrics",
               "decode_metrics": f"http://{loop}:{metrics + 1}/metrics",
               "proc": proc, "ports": ports, "kv": kv, "metrics": metrics}
    finally:
        assert proc.stop(timeout=90) == 0


def _complete(push, case) -> tuple[dict, dict]:
    path = "chat/completions" if case.kind == "chat" else "completions"
    req = urllib.request.Request(f"{push['url']}/v1/{path}",
                                 data=json.dumps(case.body(push["model"], False)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return dict(r.headers), json.loads(r.read())


def test_pushed_kv_gives_the_single_engine_tokens(push, reference):
    leases = 'pdserve:kv_leases_total'
    released0 = metric_sum(push["prefill_metrics"], leases, 'outcome="released"')
    all0 = metric_sum(push["prefill_metrics"], leases)
    for case in CASES:
        external0 = metric_sum(push["decode_metrics"], "vllm:external_prefix_cache_hits_total")
        headers, body = _complete(push, case)
        ref = reference[case.name]
        choice = body["choices"][0]
        text = choice["message"]["content"] if case.kind == "chat" else choice["text"]
        assert headers["x-pdserve-path"] == "disaggregated", case.name
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        assert text == ref["text"], case.name
        # The prompt's KV arrived from the prefill engine (push counts every prompt
        # token as arrived; pull all but the last, which the decode engine recomputes).
        external = metric_sum(push["decode_metrics"],
                              "vllm:external_prefix_cache_hits_total") - external0
        prompt = ref["usage"]["prompt_tokens"]
        assert prompt - 1 <= external <= prompt, case.name
    # Each prefill's lease ended once, released by the completed WRITE (the worker
    # hears of the last one at a later engine step, and publishes its counts then).
    deadline = time.monotonic() + 10
    while True:
        released = metric_sum(push["prefill_metrics"], leases, 'outcome="released"') - released0
        open_now = metric_sum(push["prefill_metrics"], "pdserve:kv_leases_open")
        if (released, open_now) == (len(CASES), 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (released, open_now) == (len(CASES), 0)
    # ... and none ended any other way (aborted, expired).
    assert metric_sum(push["prefill_metrics"], leases) - all0 == len(CASES)


def _listening(proc: Proc) -> dict[int, set[str]]:
    """port -> the addresses of the TCP listeners on it in the stack's process tree."""
    out: dict[int, set[str]] = {}
    for pid in proc.descendants():
        try:
            for c in psutil.Process(pid).net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    out.setdefault(c.laddr.port, set()).add(c.laddr.ip)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback (::1) here")
def test_the_stack_on_ipv6_streams_over_ipv6_and_ipv4(push):
    ports, kv, metrics = push["ports"], push["kv"], push["metrics"]
    with urllib.request.urlopen(f"{push['url']}/health", timeout=10) as r:
        workers = json.loads(r.read())["workers"]
    assert {w["address"] for w in workers} == {
        f"[::1]:{ports['prefill']}", f"[::1]:{ports['decode']}"}
    listening = _listening(push["proc"])
    inside = [ports[k] for k in ("router", "prefill", "decode")] + [kv, kv + 1, metrics,
                                                                    metrics + 1]
    assert {p: listening.get(p) for p in inside} == {p: {"::1"} for p in inside}
    assert "::" in listening[ports["edge"]]
    for url in (push["url"], f"http://127.0.0.1:{ports['edge']}"):
        body = CASES[0].body(push["model"], True)
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200 and r.headers["x-pdserve-path"] == "disaggregated"
            events = parse_sse(r.read().decode())
        assert events[-1][1] == "[DONE]"
        assert "".join(json.loads(data)["choices"][0]["text"] for _, data in events[:-1])


def test_pull_vs_push_measures_both_stacks(push, stack):
    # The benchmark's measurement, on this module's push stack and the session's pull
    # stack (`python -m pdserve.bench.pull_vs_push` starts stacks of its own, at 1k and 8k).
    batches = make_prompts([300], requests=2, seed=7)
    for port, metrics in ((int(push["url"].rsplit(":", 1)[1]),
                           {"prefill": push["prefill_metrics"], "decode": push["decode_metrics"]}),
                          (int(stack.url.rsplit(":", 1)[1]),
                           {"prefill": stack.prefill_metrics, "decode": stack.decode_metrics})):
        r = measure(port, push["model"], metrics, batches, max_tokens=4)[300]
        assert len(r["ttft_ms"]) == 2 and all(0 < t < 30_000 for t in r["ttft_ms"])
        assert r["transfers"] >= 2 and r["xfer_ms_mean"] > 0


def test_a_long_context_copy_shares_the_weights_and_says_its_length(model_dir, tmp_path):
    copy = long_context_copy(model_dir, tmp_path / "long", 9000)
    assert json.loads((copy / "config.json").read_text())["max_position_embeddings"] == 9000
    assert json.loads((copy / "tokenizer_config.json").read_text())["model_max_length"] == 9000
    weights = copy / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (model_dir / "model.safetensors").resolve()
