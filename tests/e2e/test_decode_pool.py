"""A pool of two decode workers behind the router: sessions stay with their KV, and
the pool rides out its workers' crashes and SIGTERMs.

`pdserve up --decode-workers 2` (both decode engines share one core here). Turn 2
of a conversation lands on the decode worker that served turn 1, which still
holds turn 1's blocks: a short new message is prefilled right there (nothing
travels) and the first token comes sooner; a long one is prefilled remotely from
the prefill engine's cache, and the decode worker pulls only the blocks it lacks. Different
sessions spread over both workers. Chains of /v1/responses turns (previous_response_id) do alike.

The last tests break workers: a SIGKILLed decode worker's sessions move to the
other; a SIGKILLed prefill worker costs no request (the decode worker prefills
locally meanwhile) and is restarted by the supervisor, as the decode worker is;
`pdserve chaos` in short (streaming load while workers are SIGKILLed and
SIGSTOPped) loses no stream; a decode worker whose engine core process dies goes
NOT_SERVING, leaves the router and exits within 5 s, its stream moving on; a SIGTERMed decode worker leaves the router at once
but finishes the stream it is running before it exits (then it is restarted too).
Stopped by SIGTERM, that worker and then the whole stack log nothing an operator must read
past: no asyncio task error left unread, no line of gRPC's C core.
The stack runs with chaos's fault deadlines (a silent decode moves after 1.5 s), and
with its router inside the edge (`--router-in-edge`): the workers register with the
edge, which places in-process (the suite's main stack runs a router process).
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from cases import CASES
from pdserve.bench import chaos
from pdserve.bench.chat_turn import chat_turn
from support import Proc, free_port, free_port_run, metric_sum, up_cmd

C_CORE_LINE = re.compile(r"(^|\s)[IWE]\d{4} .*\.cc:\d+\]")   # gRPC C core's form, maybe prefixed


@pytest.fixture(scope="module")
def pool(model_dir, reference):
    ports = {k: free_port() for k in ("edge", "grpc", "router", "prefill")}
    ports["decode"] = free_port_run(2)
    metrics = free_port_run(3)
    proc = Proc(up_cmd(ports, model_dir, free_port_run(3), metrics, "--decode-workers", "2",
                       "--router-in-edge", *chaos.EDGE_FLAGS),
                # gRPC's C core at pdserve's own default, as an operator starts it (the
                # suite sets it for its own process): the SIGTERM test reads the logs.
                env={"GRPC_VERBOSITY": None}, name="pdserve-pool")
    try:
        proc.wait_for("pdserve ready", timeout=400)
        yield {"url": f"http://127.0.0.1:{ports['edge']}", "model": str(model_dir),
               "prefill": f"127.0.0.1:{ports['prefill']}",
               "decode-0": f"127.0.0.1:{ports['decode']}",
               "decode_grpc": {f"decode-{i}": f"127.0.0.1:{ports['decode'] + i}"
                               for i in range(2)},
               "prefill_metrics": f"http://127.0.0.1:{metrics}/metrics", "proc": proc,
               "decode_metrics": {f"decode-{i}": f"http://127.0.0.1:{metrics + 1 + i}/metrics"
                                  for i in range(2)}}
    finally:
        tree, mark = proc.descendants(), len(proc.lines)
        code = proc.stop(timeout=90)
        # Stopped as an operator stops it: nothing to read past in any process's log.
        quiet_violations = [x for x in proc.lines[mark:]
                            if "exception was never retrieved" in x or C_CORE_LINE.search(x)]
        deadline = time.monotonic() + 10
        while (alive := [p for p in tree if psutil.pid_exists(p)
                         and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, f"processes left after shutdown: {alive}"
        assert code == 0, "\n".join(proc.lines[-40:])
        assert not quiet_violations, "\n".join(proc.lines[mark:])


def _chat(pool, messages, session: str) -> tuple[dict, str, float]:
    return chat_turn(pool["url"], pool["model"], messages, session)


def _counters(url: str) -> dict[str, float]:
    return {name: metric_sum(url, f"vllm:{name}_total")
            for name in ("prefix_cache_hits", "external_prefix_cache_hits")}


def _since(url: str, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in _counters(url).items()}


def test_later_turns_follow_the_session_and_reuse_its_kv(pool):
    history = CASES[3].payload["messages"]                 # the long multi-turn case
    h1, reply, ttft1 = _chat(pool, history, "session-a")
    worker = h1["x-pdserve-worker"]
    prefill, decode = pool["prefill_metrics"], pool["decode_metrics"][worker]

    # Turn 2, a short new message: the router knows from the decode engine's KV
    # events that the worker holds most of the prompt, so the few new tokens are
    # prefilled right there: nothing travels.
    p0, d0 = _counters(prefill), _counters(decode)
    turn2 = history + [{"role": "assistant", "content": reply},
                       {"role": "user", "content": "And then?"}]
    h2, reply2, ttft2 = _chat(pool, turn2, "session-a")
    assert h2["x-pdserve-worker"] == worker
    assert (h2["x-pdserve-placement"], h2["x-pdserve-path"]) == ("cached", "local")
    d = _since(decode, d0)
    assert d["prefix_cache_hits"] >= 512 and d["external_prefix_cache_hits"] == 0, d
    assert _since(prefill, p0)["prefix_cache_hits"] == 0
    assert ttft2 < ttft1, (ttft1, ttft2)

    # Turn 3, a long new message: prefilled remotely (the prefill engine computes
    # only what its cache lacks), and the decode worker pulls only the blocks it
    # lacks, reusing the history it holds.
    p0, d0 = _counters(prefill), _counters(decode)
    turn3 = turn2 + [{"role": "assistant", "content": reply2},
                     {"role": "user", "content": CASES[0].payload["prompt"]}]
    h3, _, _ = _chat(pool, turn3, "session-a")
    assert h3["x-pdserve-worker"] == worker
    assert (h3["x-pdserve-placement"], h3["x-pdserve-path"]) == ("remote", "disaggregated")
    assert _since(prefill, p0)["prefix_cache_hits"] >= 512
    d = _since(decode, d0)
    assert d["prefix_cache_hits"] >= 512, d                  # the history, held
    # Only the rest travelled (turn 2's tail, its reply, the new message: under 4 of
    # the prompt's ~9 blocks).
    assert 0 < d["external_prefix_cache_hits"] <= 4 * 128, d


def test_sessions_spread_over_both_decode_workers(pool):
    seen = {_chat(pool, [{"role": "user", "content": f"Tell me about the number {i}."}],
                  f"spread-{i}")[0]["x-pdserve-worker"] for i in range(8)}
    assert seen == {"decode-0", "decode-1"}


def _response(sdk, model: str, chain: int, text: str, previous: str | None):
    """One turn of chain `chain` (its own system prompt): ((worker, path), the Response)."""
    raw = sdk.responses.with_raw_response.create(
        model=model, instructions=f"You are assistant {chain}. Answer briefly.", input=text,
        temperature=0, max_output_tokens=8, previous_response_id=previous)
    return (raw.headers["x-pdserve-worker"], raw.headers["x-pdserve-path"]), raw.parse()


def test_response_chains_stay_on_their_decode_worker_and_reuse_its_kv(pool):
    """Four /v1/responses chains of four turns through the OpenAI SDK, keyed by their first
    response ids (no session header). Turn k of every chain runs at once, so the first turns
    spread by load; turns 2-4 follow turn 1's worker. A long first turn and ~170 tokens more
    a turn keep each later prompt mostly held there (prefilled locally): a block more each."""
    from openai import OpenAI
    sdk = OpenAI(base_url=f"{pool['url']}/v1", api_key="none", max_retries=0, timeout=120)
    chains, more = range(4), "Say more about colours and light. "
    last, seen, cached = dict.fromkeys(chains), {c: [] for c in chains}, {c: [] for c in chains}
    with ThreadPoolExecutor(len(chains)) as ex:
        for text in ("Hello. " + more * 76, "More. " + more * 8, "Then? " + more * 8,
                     "Bye. " + more * 8):
            turns = {c: ex.submit(_response, sdk, pool["model"], c, text, last[c])
                     for c in chains}
            for c, turn in turns.items():
                where, r = turn.result()
                assert r.previous_response_id == last[c]
                seen[c].append(where)
                cached[c].append(r.usage.input_tokens_details.cached_tokens)
                last[c] = r.id
    for c in chains:
        print(f"chain {c}: (worker, path) {seen[c]}, cached tokens {cached[c]}")
    for c in chains:
        assert [w for w, _ in seen[c][1:]] == [seen[c][0][0]] * 3, (c, seen[c])
        assert 0 < cached[c][1] < cached[c][2] < cached[c][3], (c, cached[c], seen[c])
    assert {seen[c][0][0] for c in chains} == {"decode-0", "decode-1"}, seen


def test_the_router_runs_inside_the_edge(pool):
    children = [c.cmdline() for c in psutil.Process(pool["proc"].popen.pid).children()]
    assert not [c for c in children if "router" in c], children      # no `pdserve router`
    edge = next(c for c in children if "edge" in c)
    assert edge[edge.index("--router") + 1] == "embedded"
    # Its decisions so far (the tests above), on the edge's own /metrics.
    assert metric_sum(f"{pool['url']}/metrics", "pdserve:router_decisions_total") >= 8


def _workers(pool) -> set[str]:
    """The workers the router offers, as the edge's /health lists them."""
    try:
        with urllib.request.urlopen(f"{pool['url']}/health", timeout=5) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:          # 503 while the pool is short of a worker
        body = json.loads(e.read())
    return {w["worker_id"] for w in body["workers"] if w["serving"]}


def test_losing_a_decode_worker_moves_only_its_sessions(pool):
    """Kills decode-1 (the supervisor then restarts it): the tests from here on break workers."""
    turns = {f"loss-{i}": [{"role": "user", "content": f"Tell me about the number {i}."}]
             for i in range(8)}
    home = {}
    for session, messages in turns.items():
        headers, reply, _ = _chat(pool, messages, session)
        home[session] = headers["x-pdserve-worker"]
        turns[session] = messages + [{"role": "assistant", "content": reply},
                                     {"role": "user", "content": "Go on."}]
    # The sessions' rendezvous homes split 6/2 over the two workers; placement
    # departs from them only for load. On a miss, show why the router chose as it did.
    routes = [line for line in pool["proc"].lines if "router" in line
              and ("route " in line or "worker" in line)][-40:]
    assert set(home.values()) == {"decode-0", "decode-1"}, "\n".join(routes)

    victim = next(c for c in psutil.Process(pool["proc"].popen.pid).children()
                  if "decode-1" in c.cmdline())
    # A crash of the worker process alone, no goodbye to the router; its engine's
    # processes are the supervisor's to end.
    os.kill(victim.pid, signal.SIGKILL)
    # Noticed when its event stream breaks: well inside the 6 s heartbeat timeout.
    deadline = time.monotonic() + 3
    while "decode-1" in _workers(pool) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "decode-1" not in _workers(pool)

    for session, messages in turns.items():
        headers, reply, _ = _chat(pool, messages, session)
        assert reply
        assert headers["x-pdserve-worker"] == "decode-0", session   # the survivor serves all...
    # ... and only decode-1's sessions moved: decode-0's were there already.
    moved = [s for s in turns if home[s] != "decode-0"]
    assert 0 < len(moved) < len(turns)
    pool["proc"].wait_for("decode-1 exited", timeout=30)
    pool["proc"].wait_for("restarting it", timeout=30)


def test_a_prefill_worker_killed_before_the_pull_costs_a_local_prefill_not_the_request(
        pool, model_dir):
    """SIGKILL the prefill worker between its answer and the decode's pull. The edge
    vouches for a young lease (no claim) only while its own connection to the prefill
    worker stands (`generation.fresh_lease`): that connection drops with the worker, so
    the decode request goes unmarked, the decode worker's claim finds nobody, and it
    computes the prompt itself: the same tokens, well within a second of the failure.
    (A pull from the dead worker instead would wait out NIXL's timeout, ~5 s here.)"""
    import grpc
    from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
    from transformers import AutoTokenizer

    from engine_client import flush_prefix_cache, generate
    from pdserve.rpc import channel
    from pdserve.v1 import common_pb2
    from pdserve.services.edge.engine_requests import prefill_request
    from pdserve.services.edge.leg import DecodeLeg, fresh_lease
    from pdserve.transfer.params import request_params_for_decode

    ids = AutoTokenizer.from_pretrained(model_dir).encode(CASES[0].payload["prompt"])

    async def prefill_then_kill():
        """Prefill over a channel held as the edge holds its own, then kill the worker:
        (params, still vouched for, seconds until the edge's channel noticed)."""
        edge_channel = channel(pool["prefill"])
        try:
            params = None
            async for resp in pb_grpc.VllmEngineStub(edge_channel).Generate(
                    prefill_request("killed-p", ids, common_pb2.SamplingParams(max_tokens=1)),
                    timeout=60):
                if resp.HasField("complete"):
                    params = json.loads(resp.complete.kv_transfer_params_json)
            leg = DecodeLeg("killed-d", "decode-0", None, params, pool["prefill"], None,
                            time.monotonic(), edge_channel)
            assert fresh_lease(leg, time.monotonic())     # connected and young: vouched for
            victim = next(c for c in psutil.Process(pool["proc"].popen.pid).children()
                          if "prefill-0" in c.cmdline())
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(10)
            killed = time.monotonic()
            while fresh_lease(leg, time.monotonic()) and time.monotonic() < killed + 0.5:
                await asyncio.sleep(0.001)
            return params, fresh_lease(leg, time.monotonic()), time.monotonic() - killed
        finally:
            await edge_channel.close()

    with grpc.insecure_channel(pool["decode-0"]) as d:
        decode = pb_grpc.VllmEngineStub(d)
        want, _ = generate(decode, "killed-ref", ids, 12)
        flush_prefix_cache(decode)
        params, vouched, noticed = asyncio.run(prefill_then_kill())
        started = time.monotonic()
        out, done = generate(decode, "killed-d", ids, 12,
                             kv=request_params_for_decode(params, pool["prefill"], vouched))
        recovered = time.monotonic() - started + noticed
    assert not vouched, noticed
    assert out == want and done.cached_tokens < len(ids) - 1
    # The whole 12-token request, fallback included, within a second of the kill.
    assert recovered < 1.0, recovered
    assert metric_sum(pool["decode_metrics"]["decode-0"], "pdserve:kv_transfer_failures_total",
                      'reason="prefill_unreachable"') >= 1
    print(f"prefill killed: the edge's channel dropped {noticed * 1000:.1f} ms after the kill; "
          f"local recompute answered {recovered * 1000:.0f} ms after it")


STREAM_TOKENS = 400                     # ~5 s of decoding, well inside max_model_len


def _worker(pool, worker_id: str) -> psutil.Process:
    """The worker process itself (a child of `pdserve up`), not its engine's."""
    return next(c for c in psutil.Process(pool["proc"].popen.pid).children()
                if worker_id in c.cmdline())


def _health(pool) -> int:
    try:
        with urllib.request.urlopen(f"{pool['url']}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _wait_healthy(pool, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _health(pool) != 200:
        assert time.monotonic() < deadline, "\n".join(pool["proc"].lines[-40:])
        time.sleep(0.5)


def test_the_killed_prefill_worker_is_restarted_and_no_request_fails(pool):
    """Follows the kill above: while prefill-0 is down, a request is prefilled on its
    decode worker; the supervisor restarts prefill-0 and the edge uses it again."""
    _, reply, _ = _chat(pool, CASES[2].payload["messages"], "restart-0")  # long: remote prefill
    assert reply
    pool["proc"].wait_for("pdserve: prefill-0 exited (code -9); restarting it", timeout=10)
    _wait_healthy(pool)                                         # back, and registered
    # The edge dials it again within a second or so (its channel's reconnect backoff);
    # meanwhile a request is prefilled locally. Each prompt is new: none is cached.
    paths = []
    deadline = time.monotonic() + 5
    while "disaggregated" not in paths and time.monotonic() < deadline:
        messages = [{"role": "user", "content": f"Question {len(paths)}: "
                     + CASES[3].payload["messages"][0]["content"]}]
        headers, reply, _ = _chat(pool, messages, f"restart-{len(paths) + 1}")
        assert reply
        paths.append(headers["x-pdserve-path"])
        time.sleep(0.25)
    why = [line for line in pool["proc"].lines[-60:] if "route " in line or "prefill" in line]
    assert paths[-1] == "disaggregated", "\n".join(why)      # through the new prefill worker
    assert not any("stopping the stack" in line for line in pool["proc"].lines)


def _wait_whole(pool, timeout: float = 120) -> None:
    """Until the edge lists all three workers serving."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{pool['url']}/health", timeout=5) as r:
                workers = json.loads(r.read())["workers"]
            if sum(w["serving"] for w in workers) == 3:
                return
        except urllib.error.HTTPError:
            pass
        assert time.monotonic() < deadline, "\n".join(pool["proc"].lines[-40:])
        time.sleep(0.5)


class _PoolUnderChaos:
    """This module's stack, driven as `pdserve chaos` drives the one it starts."""

    def __init__(self, pool):
        self.pool = pool
        self.up_pid = pool["proc"].popen.pid

    def start(self) -> list[str]:
        _wait_whole(self.pool)
        return [self.pool["url"]]

    def worker_metrics(self) -> dict[str, str]:
        return {"prefill-0": self.pool["prefill_metrics"], **self.pool["decode_metrics"]}

    def worker_addresses(self, role: str) -> list[str]:
        assert role == "prefill", role
        return [self.pool["prefill"]]


def test_chaos_loses_no_stream_while_workers_are_killed_and_stopped(pool):
    """`pdserve chaos` in short, on this stack (the command itself starts 2 prefill + 2
    decode workers: full runs in bench/README.md): every accepted stream completes with
    its uninterrupted text, and no KV block or lease is left behind."""
    a = chaos.parser().parse_args(["--seed", "3", "--duration", "10", "--faults", "kill,stop",
                                   "--first-fault", "2", "--gap", "3",
                                   "--model", pool["model"]])
    r = asyncio.run(chaos.Chaos(a, stack=_PoolUnderChaos(pool)).run())
    assert r["faults"], r                               # something was broken...
    assert r["streams"] > 0 and r["completed"] == r["streams"], r
    assert (r["lost"], r["duplicated"], r["missing"], r["text_mismatches"]) == (0, 0, 0, 0), r
    assert (r["leaked_blocks"], r["open_leases"]) == (0, 0), r
    assert chaos.passed(r), r


def _long_stream(pool) -> urllib.request.Request:
    """A STREAM_TOKENS-token streamed completion (greedy, usage in its last event)."""
    body = {"model": pool["model"], "prompt": "Once upon a time", "max_tokens": STREAM_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    return urllib.request.Request(f"{pool['url']}/v1/completions",
                                  data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})


def _sse_events(response):
    """The JSON events of an SSE response, up to its [DONE]."""
    for line in response:
        if not line.startswith(b"data: "):
            continue
        if line.strip() == b"data: [DONE]":
            return
        yield json.loads(line[6:])


def _watch_health(address: str, service: str, seen: list) -> threading.Thread:
    """Follows `service`'s gRPC health on `address` into `seen` ((status name, when)),
    until the server goes away."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def follow():
        with grpc.insecure_channel(address) as ch:
            try:
                for r in health_pb2_grpc.HealthStub(ch).Watch(
                        health_pb2.HealthCheckRequest(service=service), timeout=60):
                    seen.append((health_pb2.HealthCheckResponse.ServingStatus.Name(r.status),
                                 time.monotonic()))
            except grpc.RpcError:
                pass                                   # the worker exited
    t = threading.Thread(target=follow, daemon=True)
    t.start()
    return t


def _engine_core(worker: psutil.Process) -> psutil.Process:
    """The worker's vLLM engine core: the child process AsyncLLM started."""
    cores = [p for p in worker.children(recursive=True)
             if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]
    assert len(cores) == 1, [(p.pid, p.name(), p.cmdline()) for p in worker.children()]
    return cores[0]


def test_a_decode_worker_whose_engine_core_dies_exits_and_its_stream_moves(pool):
    """SIGKILL one worker's engine core mid-stream: its gRPC health (the liveness
    name too) turns NOT_SERVING, it leaves the router and exits (code 70) within
    5 s, the supervisor restarts it, and the stream finishes on the other worker."""
    from pdserve.services.worker.engine_watch import ENGINE_ALIVE, EXIT_ENGINE_DEAD

    _wait_whole(pool)
    moved = metric_sum(f"{pool['url']}/metrics", "pdserve:migrations_total")
    req = _long_stream(pool)
    events, health, exits, killed, mark = [], [], [], None, len(pool["proc"].lines)
    with urllib.request.urlopen(req, timeout=120) as r:
        worker_id = r.headers["x-pdserve-worker"]
        worker = _worker(pool, worker_id)
        watcher = _watch_health(pool["decode_grpc"][worker_id], ENGINE_ALIVE, health)
        for event in _sse_events(r):
            events.append(event)
            if len(events) == 5:
                _engine_core(worker).kill()
                killed = time.monotonic()
                # Timed apart from the stream, which goes on elsewhere meanwhile (its
                # exit code is the supervisor's to read, below).
                exit_watch = threading.Thread(target=lambda: (worker.wait(timeout=15),
                                                              exits.append(time.monotonic())))
                exit_watch.start()
    assert killed, "the stream ended before the engine core was killed"
    exit_watch.join(timeout=15)
    assert exits, "the worker did not exit"
    exited = exits[0] - killed
    assert exited <= 5, exited
    watcher.join(timeout=5)
    assert [s for s, _ in health] == ["SERVING", "NOT_SERVING"], health
    assert not any("error" in e for e in events), [e for e in events if "error" in e]
    assert events[-1]["usage"]["completion_tokens"] == STREAM_TOKENS
    assert metric_sum(f"{pool['url']}/metrics", "pdserve:migrations_total") >= moved + 1
    lines = pool["proc"].lines[mark:]
    assert any(f"worker gone: {worker_id}" in line for line in lines)      # it said goodbye
    assert worker_id not in _workers(pool)
    pool["proc"].wait_for(f"pdserve: {worker_id} exited (code {EXIT_ENGINE_DEAD}); "
                          "restarting it", timeout=10, since=mark)
    print(f"engine core killed: {worker_id} exited {exited:.2f} s later")


def test_a_sigtermed_decode_worker_finishes_its_stream_then_exits(pool):
    """Runs last: the decode worker it stops is being restarted at teardown. Its log, at
    the default level, holds nothing an operator must read past: no asyncio task left
    with an exception nobody read (its KV-event stream, closed under the router that
    follows it, ended vLLM's relay), and no line of gRPC's C core (`I1206 12:00:00.000000
    123 chttp2_transport.cc:1403] ...`)."""
    _wait_healthy(pool)
    req = _long_stream(pool)
    events, signalled, mark = [], None, len(pool["proc"].lines)
    with urllib.request.urlopen(req, timeout=120) as r:
        worker_id = r.headers["x-pdserve-worker"]
        worker = _worker(pool, worker_id)
        for event in _sse_events(r):
            events.append(event)
            if len(events) == 1:
                signalled = time.monotonic()
                worker.send_signal(signal.SIGTERM)             # the worker alone, as k8s does
    finished = time.monotonic()
    assert signalled, "the stream ended before the worker was signalled"
    assert not any("error" in e for e in events), [e for e in events if "error" in e]
    reasons = [c["finish_reason"] for e in events for c in e.get("choices", [])
               if c.get("finish_reason")]
    assert reasons == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == STREAM_TOKENS
    worker.wait(timeout=30)                                    # then it stops on its own
    lines = pool["proc"].lines[mark:]
    assert any(f"{worker_id} draining: 1 Generate calls in flight" in line for line in lines)
    assert any(f"{worker_id} drained in" in line for line in lines)
    pool["proc"].wait_for(f"pdserve: {worker_id} exited (code 0); restarting it", timeout=10,
                          since=mark)
    lines = pool["proc"].lines[mark:]
    assert not [x for x in lines if "exception was never retrieved" in x], "\n".join(lines)
    assert not [x for x in lines if C_CORE_LINE.search(x)], "\n".join(lines)
    print(f"stream ran {finished - signalled:.1f} s past the SIGTERM")
