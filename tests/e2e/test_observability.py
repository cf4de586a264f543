"""Observability on the real stack: one trace per request across every process, every
service's /metrics moving by what one request did, and a dashboard whose every query
names a series the stack really serves.

The session stack exports its spans over OTLP to a collector in this process
(conftest.py): the real exporter, the real propagation through gRPC metadata.
"""
from __future__ import annotations

import json
import re
import secrets
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from support import parse_sse

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
DASHBOARD = K8S / "base" / "grafana" / "pdserve-dashboard.json"
# Long enough for the P/D path (the router prefills short prompts on the decode worker).
PROMPT = " ".join(f"word{i} is number {i}," for i in range(40))
MAX_TOKENS = 6


def _stream_chat(stack, headers: dict | None = None, salt: str = "") -> tuple[dict, dict]:
    """One streamed chat completion: (response headers, usage). A new `salt` makes a
    prompt no worker holds (a held one is prefilled on the decode worker)."""
    body = {"model": stack.model,
            "messages": [{"role": "user", "content": f"{salt} {PROMPT}".strip()}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{stack.url}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        got = dict(r.headers)
        events = parse_sse(r.read().decode())
    assert events[-1][1] == "[DONE]"
    usage = next(json.loads(e)["usage"] for _, e in reversed(events[:-1])
                 if json.loads(e).get("usage"))
    return got, usage


# --- tracing ---

_EDGE_STEPS = {"admit", "route", "prefill", "decode", "stream"}


def test_one_request_is_one_trace_across_edge_router_prefill_transfer_and_decode(stack):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    headers, usage = _stream_chat(stack, {"traceparent": f"00-{trace_id}-{client_span}-01"},
                                  salt=trace_id)
    assert headers["x-pdserve-path"] == "disaggregated"
    generation = f"chat {stack.model}"
    route_call, engine_call = "/pdserve.v1.Router/Route", "/vllm.grpc.engine.VllmEngine/Generate"
    claim_call = "/pdserve.v1.KVTransfer/Claim"
    spans = stack.traces.wait_for(trace_id, {
        *(("pdserve-edge", name) for name in (generation, route_call, *_EDGE_STEPS)),
        ("pdserve-router", route_call), ("pdserve-prefill", engine_call),
        ("pdserve-decode", engine_call), ("pdserve-decode", "kv_transfer"),
        ("pdserve-edge", "POST /v1/chat/completions")})
    by_id = {s.span_id: s for s in spans}

    def one(service: str, name: str, parent=None):
        found = [s for s in spans if s.service == service and s.name == name
                 and (parent is None or s.parent_id == parent.span_id)]
        assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
        return found[0]

    assert {s.service for s in spans} == {"pdserve-edge", "pdserve-router", "pdserve-prefill",
                                          "pdserve-decode"}
    # The client's traceparent is the parent of the edge's server span.
    http = one("pdserve-edge", "POST /v1/chat/completions")
    assert http.parent_id == client_span
    gen = one("pdserve-edge", generation, parent=http)
    steps = {name: one("pdserve-edge", name, parent=gen) for name in _EDGE_STEPS}
    # The steps run in turn inside the generation, by the spans' own times.
    r, p, d = steps["route"], steps["prefill"], steps["decode"]
    assert (0 < gen.start_ns <= r.start_ns <= r.end_ns <= p.start_ns <= p.end_ns <= d.start_ns
            <= d.end_ns <= gen.end_ns), [(s.name, s.start_ns, s.end_ns) for s in (gen, r, p, d)]
    # Each step's gRPC call, and the server span it continues in the other process (the
    # token streams carry their step's own context: no client span of their own).
    one("pdserve-router", route_call,
        parent=one("pdserve-edge", route_call, parent=steps["route"]))
    one("pdserve-prefill", engine_call, parent=steps["prefill"])
    # A lone leg gets a Generate call of its own, batched decode calls or not
    # (services/edge/batched.py); shared calls' spans: test_batched_decode.py.
    decode = one("pdserve-decode", engine_call, parent=steps["decode"])
    # The KV handover on the decode worker. The edge forwarded a fresh lease, so the
    # decode worker pulled without claiming it first (transfer/claim.py).
    transfer = one("pdserve-decode", "kv_transfer", parent=decode)
    assert not [s for s in spans if s.name == claim_call], [(s.service, s.name) for s in spans]
    assert transfer.attributes["pdserve.kv.pulled"] is True
    assert transfer.attributes["pdserve.kv.remote_blocks"] >= 1
    # Every span's parent is in the trace, but the client's.
    assert [s.name for s in spans if s.parent_id not in by_id] == [http.name]
    assert all(s.status != 2 for s in spans), [(s.name, s.status) for s in spans]
    # GenAI semantic conventions on the generation and on the decode worker's call.
    a = gen.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == stack.model
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == MAX_TOKENS
    assert a["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.response.id"] == headers["x-request-id"]
    assert a["pdserve.path"] == "disaggregated"
    # The first token was the prefill's: the decode engine went on after it.
    assert decode.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS - 1
    assert decode.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] + 1


def test_a_request_without_traceparent_starts_its_own_trace(stack):
    before = {s.trace_id for s in stack.traces.spans}
    _stream_chat(stack, salt=secrets.token_hex(8))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        new = [s for s in stack.traces.spans if s.trace_id not in before
               and s.name == "POST /v1/chat/completions"]
        if new:
            break
        time.sleep(0.1)
    assert len(new) == 1 and new[0].parent_id == ""
    spans = stack.traces.wait_for(new[0].trace_id, {
        f"chat {stack.model}", ("pdserve-router", "/pdserve.v1.Router/Route"),
        ("pdserve-decode", "kv_transfer")})
    assert {s.service for s in spans} >= {"pdserve-edge", "pdserve-router", "pdserve-decode"}


# --- metrics ---

def _scrape(url: str) -> dict[tuple, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _sum(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


class _Scrapes:
    """Every service's /metrics, before and after."""

    def __init__(self, stack):
        self.urls = {"edge": f"{stack.url}/metrics", "prefill": stack.prefill_metrics,
                     "decode": stack.decode_metrics}
        self.routers = [f"router-{i}" for i in range(len(stack.routers_metrics))]
        self.urls |= dict(zip(self.routers, stack.routers_metrics))
        self.before = {k: _scrape(u) for k, u in self.urls.items()}
        self.after = self.before

    def again(self) -> None:
        self.after = {k: _scrape(u) for k, u in self.urls.items()}

    def moved(self, service: str, name: str, **labels) -> float:
        """What `name` moved by; "router": summed over the replicas (the edge uses one)."""
        return sum(_sum(self.after[s], name, **labels) - _sum(self.before[s], name, **labels)
                   for s in (self.routers if service == "router" else [service]))


def _leases_settled(stack, timeout: float = 15.0) -> None:
    """Wait until earlier requests' leases are all ended and counted: the prefill
    worker refreshes its lease counts once a second."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        now = _scrape(stack.prefill_metrics)
        counts = (_sum(now, "pdserve:kv_leases_total"), _sum(now, "pdserve:kv_leases_open"))
        if counts == last and counts[1] == 0:
            return
        last = counts
        time.sleep(1.2)
    raise AssertionError(f"the prefill worker's leases did not settle: {last}")


def test_every_service_metrics_move_by_what_one_request_did(stack):
    _leases_settled(stack)
    m = _Scrapes(stack)
    headers, usage = _stream_chat(stack, salt=secrets.token_hex(8))
    assert headers["x-pdserve-path"] == "disaggregated"
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]

    # Engines report at their next step and leases at the next refresh (1 s): wait for them.
    deadline = time.monotonic() + 15
    while True:
        m.again()
        settled = (m.moved("decode", "vllm:request_success_total") == 1
                   and m.moved("prefill", "vllm:request_success_total") == 1
                   and m.moved("prefill", "pdserve:kv_leases_total") == 1)
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.25)

    chat = {"endpoint": "/v1/chat/completions", "path": "disaggregated"}
    path = {"path": "disaggregated"}
    # The edge: the whole request.
    assert m.moved("edge", "pdserve:requests_total", status="200", **chat) == 1
    assert m.moved("edge", "pdserve:requests_total") == 1
    assert m.moved("edge", "pdserve:time_to_first_token_seconds_count", **path) == 1
    assert m.moved("edge", "pdserve:e2e_request_latency_seconds_count", **path) == 1
    # One gap between each two of the tokens (the decode engine sends one a step).
    assert m.moved("edge", "pdserve:inter_token_latency_seconds_count", **path) == completion - 1
    assert m.moved("edge", "pdserve:prompt_tokens_total") == prompt
    assert m.moved("edge", "pdserve:generation_tokens_total") == completion
    assert m.moved("edge", "pdserve:placements_total", reason="remote") == 1
    assert m.moved("edge", "pdserve:prefill_first_tokens_total") == 1
    assert m.moved("edge", "pdserve:request_queue_time_seconds_count") == 1
    assert m.moved("edge", "pdserve:streams_ended_total", outcome="finished") == 1
    assert _sum(m.after["edge"], "pdserve:num_requests_running") == 0
    # The prefill worker: one request of max_tokens 1; its lease handed over and released.
    assert m.moved("prefill", "vllm:request_success_total") == 1
    assert m.moved("prefill", "vllm:prompt_tokens_total") == prompt
    assert m.moved("prefill", "vllm:generation_tokens_total") == 1
    assert m.moved("prefill", "pdserve:kv_leases_total", outcome="released") == 1
    assert _sum(m.after["prefill"], "pdserve:kv_leases_open") == 0
    # The decode worker: the request, and its KV pulled over NIXL. The first token was
    # the prefill's (the client had it before the handover): the decode engine was
    # asked for the rest, after the prompt and that token.
    assert m.moved("decode", "vllm:request_success_total") == 1
    assert m.moved("decode", "vllm:prompt_tokens_total") == prompt + 1
    assert m.moved("decode", "vllm:generation_tokens_total") == completion - 1
    assert m.moved("decode", "pdserve:kv_transfer_seconds_count") == 1
    transfers = m.moved("decode", "vllm:nixl_xfer_time_seconds_count")
    moved_bytes = m.moved("decode", "vllm:nixl_bytes_transferred_sum")
    assert transfers >= 1 and moved_bytes > 0
    assert m.moved("decode", "pdserve:kv_transfers_total") == transfers
    assert m.moved("decode", "pdserve:kv_transfer_bytes_total") == moved_bytes
    assert m.moved("decode", "pdserve:kv_transfer_failures_total") == 0
    # The router: one decision, and its view of both workers.
    assert m.moved("router", "pdserve:router_decisions_total", reason="remote") == 1
    assert m.moved("router", "pdserve:router_decisions_total") == 1
    assert m.moved("router", "pdserve:router_route_seconds_count") == 1
    for role in ("prefill", "decode"):
        for replica in m.routers:           # each replica holds the whole pool
            assert _sum(m.after[replica], "pdserve:router_worker_serving", role=role) == 1
        assert _sum(m.after[role], "pdserve:worker_info", role=role) == 1


# --- the dashboard ---

_SERIES = re.compile(r"\b((?:pdserve|vllm):[A-Za-z0-9_]+)")


def _served(stack) -> set[str]:
    """Every series name the stack's processes serve on their /metrics."""
    served = set()
    for url in (f"{stack.url}/metrics", stack.prefill_metrics, stack.decode_metrics,
                *stack.routers_metrics):
        served |= {name for name, _ in _scrape(url)}
    return served


def test_the_dashboard_queries_only_series_the_stack_serves(stack):
    board = json.loads(DASHBOARD.read_text())
    served = _served(stack)
    panels = [p for p in board["panels"] if p.get("type") != "row"]
    assert len(panels) >= 10 and len({p["id"] for p in board["panels"]}) == len(board["panels"])
    queried = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(_SERIES.findall(target["expr"]))
            assert names, (panel["title"], target["expr"])
            queried |= names
    assert not queried - served, sorted(queried - served)
    # What the issue asks to see: latencies by path, both pools, transfers, leases.
    for needed in ("pdserve:time_to_first_token_seconds_bucket",
                   "pdserve:inter_token_latency_seconds_bucket",
                   "pdserve:e2e_request_latency_seconds_bucket", "pdserve:requests_total",
                   "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                   "pdserve:kv_transfer_bytes_total", "pdserve:kv_transfer_failures_total",
                   "pdserve:kv_leases_total"):
        assert needed in queried, needed


def _queries() -> dict[str, str]:
    """Every PromQL query the manifests ship, by where it is: the KEDA ScaledObjects'
    triggers, the PrometheusRules' alerts, the dashboard's panels."""
    import yaml

    out = {}
    for doc in yaml.safe_load_all((K8S / "components/keda/scaledobjects.yaml").read_text()):
        for t in doc["spec"]["triggers"]:
            out[f"ScaledObject {doc['metadata']['name']}/{t['name']}"] = t["metadata"]["query"]
    rules = K8S / "components/monitoring/prometheusrules.yaml"
    for doc in yaml.safe_load_all(rules.read_text()):
        for group in doc["spec"]["groups"]:
            for rule in group["rules"]:
                out[f"PrometheusRule {rule.get('alert') or rule['record']}"] = rule["expr"]
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for i, target in enumerate(panel.get("targets", [])):
            out[f"dashboard panel {panel['title']}/{i}"] = target["expr"]
    return out


def test_every_series_autoscaling_alerts_and_dashboards_query_is_served(stack):
    """A query on a series no process serves is empty: an autoscaler that never fires,
    an alert that never rings. Each one names only series the live stack serves (after
    one request: a labelled series appears with its first event)."""
    _stream_chat(stack, salt="series")
    served = _served(stack)
    queries = _queries()
    assert sum(k.startswith("ScaledObject") for k in queries) >= 3
    assert sum(k.startswith("PrometheusRule") for k in queries) >= 6
    missing = {where: sorted(set(_SERIES.findall(q)) - served) for where, q in queries.items()}
    assert not {w: m for w, m in missing.items() if m}, missing
    assert all(_SERIES.findall(q) for q in queries.values())
