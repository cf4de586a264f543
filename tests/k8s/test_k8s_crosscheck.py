"""The manifests against the code: every pdserve command line parses with pdserve's own CLI,
probes and Services reach ports the processes listen on and health services they register,
and the NetworkPolicies allow exactly the architecture's flows."""
from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

import pytest
import yaml
from k8s_manifests import (
    OVERLAYS,
    ROOT,
    by_kind,
    component,
    keda_queries,
    parse,
    pods,
    render,
    tool,
)

from pdserve.netaddr import split_hostport
from pdserve.services.edge.openapi import SPEC
from pdserve.services.worker.engine_watch import ENGINE_ALIVE

SERVING = ("edge", "router", "prefill", "decode")


def _processes(docs):
    """component -> (Pod, Process of its main container)."""
    return {name: (pod, parse(pod.main)) for name, pod in pods(docs).items()
            if pod.main.argv[0] == "pdserve"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pdserve_container_parses_with_the_cli(overlay):
    docs = render(overlay)
    seen = set()
    for name, pod in pods(docs).items():
        for c in pod.containers:
            argv = c.argv
            assert "$(" not in " ".join(argv), f"{name}/{c.name}: unexpanded variable in {argv}"
            if argv[0] == "pdserve":
                seen.add(parse(c).command)   # SystemExit / ValueError / AssertionError fail
            else:                             # the h100 helpers: python -c SCRIPT
                assert argv[:2] == ["python", "-c"], f"{name}/{c.name}: runs {argv[0]}"
                compile(argv[2], f"{name}/{c.name}", "exec")
    assert set(SERVING) <= seen


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_reach_served_ports_and_registered_health_services(overlay):
    for name, (pod, proc) in _processes(render(overlay)).items():
        c = pod.main
        assert c.spec.get("readinessProbe") and c.spec.get("livenessProbe"), name
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.spec.get(kind)
            if probe is None:
                continue
            where = f"{overlay} {name} {kind}"
            if "grpc" in probe:
                assert probe["grpc"]["port"] == proc.listens["grpc"], where
                assert probe["grpc"].get("service", "") in proc.health_services, where
            elif "httpGet" in probe:
                assert c.port(probe["httpGet"]["port"]) == proc.listens["http"], where
                assert probe["httpGet"]["path"] in SPEC["paths"], where
            else:
                assert c.port(probe["tcpSocket"]["port"]) in proc.listens.values(), where
        if proc.command in ("prefill", "decode"):
            # A draining worker sets every service's health NOT_SERVING: liveness must ask
            # the name only a dead engine fails, or the kubelet would kill it mid-drain.
            assert c.spec["livenessProbe"]["grpc"]["service"] == ENGINE_ALIVE, name
            assert "grpc" in c.spec["startupProbe"], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_declared_ports_are_exactly_the_listening_ones(overlay):
    for name, (pod, proc) in _processes(render(overlay)).items():
        assert sorted(pod.main.ports.values()) == sorted(proc.listens.values()), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_and_budgets_select_a_pod_template(overlay):
    docs = render(overlay)
    procs = _processes(docs)
    for kind in ("Service", "PodDisruptionBudget"):
        for sname, obj in by_kind(docs, kind).items():
            selector = obj["spec"]["selector"]
            selector = selector.get("matchLabels", selector) if kind != "Service" else selector
            matched = [n for n, (pod, _) in procs.items()
                       if selector and selector.items() <= pod.labels.items()]
            assert len(matched) == 1, f"{kind} {sname} selects {matched}"
            if kind == "Service":
                pod, proc = procs[matched[0]]
                for port in obj["spec"]["ports"]:
                    target = pod.main.port(port.get("targetPort", port["port"]))
                    assert target in proc.listens.values(), f"{sname}:{port}"
    budgets = {component(b) for b in by_kind(docs, "PodDisruptionBudget").values()}
    assert budgets == set(SERVING)


def _ucx_range(pod) -> str:
    return pod.main.env["UCX_TCP_PORT_RANGE"]


def _architecture(procs, extra_pods, services) -> set[tuple[str, str, str]]:
    """The flows the design needs (docs/architecture.md, k8s/base/networkpolicy.yaml), from
    the ports each process is configured to listen on and the addresses it dials
    (`services`: Service name -> the component it selects)."""
    grpc = {n: f"TCP/{p.listens['grpc']}" for n, (_, p) in procs.items()}
    metrics = {n: f"TCP/{p.listens['metrics']}" for n, (_, p) in procs.items()
               if "metrics" in p.listens}
    kv = f"TCP/{procs['prefill'][1].listens['kv']}"
    ucx = {f"TCP/{_ucx_range(procs[w][0])}" for w in ("prefill", "decode")}
    assert len(ucx) == 1, f"prefill and decode disagree on UCX_TCP_PORT_RANGE: {ucx}"
    ucx = ucx.pop()
    flows = {("anyone", "edge", f"TCP/{procs['edge'][1].listens['http']}"),
             ("inference-clients", "edge", grpc["edge"])}
    flows |= {("edge", w, grpc[w]) for w in ("router", "prefill", "decode")}
    flows |= {(w, "router", grpc["router"]) for w in ("prefill", "decode")}
    flows |= {("router", w, grpc[w]) for w in ("prefill", "decode")}
    flows |= {("decode", "prefill", grpc["prefill"]), ("decode", "prefill", kv),
              ("decode", "prefill", ucx), ("prefill", "decode", ucx)}
    flows |= {("monitoring", n, port) for n, port in metrics.items()}
    flows |= {(n, dns, proto) for n in list(procs) + extra_pods
              for dns in ("kube-dns", "node-local-dns") for proto in ("UDP/53", "TCP/53")}
    store = procs["edge"][1].args.stream_store
    if store.startswith("redis://"):         # the edge's stream logs, in a Redis it dials
        host, port = split_hostport(store[len("redis://"):])
        owner = services[host]
        assert owner in extra_pods, f"redis {host} is no pod of this render"
        flows.add(("edge", owner, f"TCP/{port}"))
    if "model-download" in extra_pods:       # h100: the one way out, to the model hub
        flows.add(("model-download", "internet", "TCP/443"))
    if "epp" in extra_pods:                  # inference-extension: the endpoint picker
        flows |= {("gateway", "epp", "TCP/9002"), ("gateway", "epp", "TCP/9003"),
                  ("monitoring", "epp", "TCP/9090"),
                  # the members' /metrics: the edge's metrics port, else its HTTP port
                  ("epp", "edge", metrics.get("edge",
                                              f"TCP/{procs['edge'][1].listens['http']}")),
                  ("epp", "internet", "TCP/443"), ("epp", "internet", "TCP/6443")}
    return flows


def _operator_pods(docs) -> dict[str, dict[str, str]]:
    """Pods the operator deploys beside the render, by the labels the manifests ask for:
    the inference-extension's endpoint picker."""
    return ({"epp": {"app.kubernetes.io/name": "pdserve-epp"}}
            if by_kind(docs, "InferencePool") else {})


_IP_BLOCKS = {"0.0.0.0/0": "internet", "169.254.20.10/32": "node-local-dns"}


def _peer(entry: dict, pod_labels: dict[str, dict]) -> list[str]:
    """The components (or named outside parties) a from/to entry stands for."""
    if "ipBlock" in entry:
        return [_IP_BLOCKS[entry["ipBlock"]["cidr"]]]
    if "namespaceSelector" in entry:
        labels = entry["namespaceSelector"]["matchLabels"]
        if labels == {"pdserve.io/inference-api": "allowed"}:
            return ["inference-clients"]         # the namespaces the operator labels
        if labels == {"pdserve.io/inference-gateway": "allowed"}:
            return ["gateway"]
        ns = labels["kubernetes.io/metadata.name"]
        pods_ = entry.get("podSelector", {}).get("matchLabels", {})
        return {"monitoring": ["monitoring"]}.get(ns) or (
            ["kube-dns"] if (ns, pods_) == ("kube-system", {"k8s-app": "kube-dns"}) else [ns])
    sel = entry["podSelector"].get("matchLabels", {})
    return [n for n, labels in pod_labels.items() if sel.items() <= labels.items()]


def _ports(rule: dict, pod) -> list[str]:
    out = []
    for p in rule.get("ports", []):
        port = p["port"]
        if isinstance(port, str):                # a named port: the destination pod's
            if pod is None:
                continue                         # no such port there: allows nothing
            if port not in pod.main.ports:
                continue
            port = pod.main.ports[port]
        out.append(f"{p.get('protocol', 'TCP')}/{port}"
                   + (f"-{p['endPort']}" if "endPort" in p else ""))
    assert rule.get("ports"), f"a rule open on every port: {rule}"
    return out


def _allowed(docs) -> set[tuple[str, str, str]]:
    """The flows the NetworkPolicies allow: in the namespace, a flow needs the source's
    egress and the destination's ingress; across its edge, the one side that is ours."""
    templates = pods(docs)
    labels = {n: p.labels for n, p in templates.items()} | _operator_pods(docs)
    egress, ingress = set(), set()
    for policy in by_kind(docs, "NetworkPolicy").values():
        sel = policy["spec"]["podSelector"].get("matchLabels", {})
        selected = [n for n, lab in labels.items() if sel.items() <= lab.items()]
        for n in selected:
            for rule in policy["spec"].get("ingress", []):
                sources = [p for e in rule.get("from", [{"anyone": True}])
                           for p in (["anyone"] if "anyone" in e else _peer(e, labels))]
                ingress |= {(s, n, port) for s in sources
                            for port in _ports(rule, templates.get(n))}
            for rule in policy["spec"].get("egress", []):
                for e in rule["to"]:
                    for d in _peer(e, labels):
                        egress |= {(n, d, port) for port in _ports(rule, templates.get(d))}
        assert set(policy["spec"]["policyTypes"]) <= {"Ingress", "Egress"}
    # Every pod is isolated both ways (the default-deny policy selects all of them).
    deny = by_kind(docs, "NetworkPolicy")["pdserve-default-deny"]["spec"]
    assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"}
    inside = set(labels)
    flows = {f for f in egress if f[1] not in inside}
    flows |= {f for f in ingress if f[0] not in inside}
    flows |= {f for f in egress if f[1] in inside and (f in ingress
                                                      or ("anyone",) + f[1:] in ingress)}
    one_sided = {f for f in egress ^ ingress if f[0] in inside and f[1] in inside
                 and ("anyone",) + f[1:] not in ingress}
    assert not one_sided, f"allowed on one side only (dead or missing rules): {one_sided}"
    return flows


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_allow_exactly_the_architecture(overlay):
    _check_flows(render(overlay))


def _services(docs) -> dict[str, str]:
    """Service name -> the component whose pods it selects."""
    labels = {n: p.labels for n, p in pods(docs).items()}
    return {name: next(n for n, lab in labels.items()
                       if svc["spec"]["selector"].items() <= lab.items())
            for name, svc in by_kind(docs, "Service").items()}


def _check_flows(docs) -> None:
    procs = _processes(docs)
    extra = [n for n in pods(docs) if n not in procs] + list(_operator_pods(docs))
    allowed, needed = _allowed(docs), _architecture(procs, extra, _services(docs))
    assert not needed - allowed, f"flows the policies block: {sorted(needed - allowed)}"
    assert not allowed - needed, f"flows nothing needs: {sorted(allowed - needed)}"


def test_the_redis_component_opens_exactly_the_edge_to_redis_flow(tmp_path):
    """cpu-dev with components/redis: the edges' stream store is the component's Redis
    (from the edge's own --stream-store, by way of pdserve-config), and the policies
    open edge -> redis and nothing more."""
    shutil.copytree(ROOT / "k8s", tmp_path / "k8s")
    overlay = tmp_path / "k8s" / "overlays" / "with-redis"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources: [../cpu-dev]\ncomponents: [../../components/redis]\n")
    out = subprocess.run([tool("kubectl"), "kustomize", str(overlay)], capture_output=True,
                         text=True, timeout=60, check=True)
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert _processes(docs)["edge"][1].args.stream_store == "redis://pdserve-redis:6379"
    _check_flows(docs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_covers_the_drain(overlay):
    for name, (pod, proc) in _processes(render(overlay)).items():
        pre_stop = (pod.main.spec.get("lifecycle", {}).get("preStop", {})
                    .get("sleep", {}).get("seconds", 0))
        grace = pod.spec["terminationGracePeriodSeconds"]
        assert grace >= pre_stop + proc.drain_seconds + proc.stop_grace, (
            f"{name}: {grace} s < preStop {pre_stop} + drain {proc.drain_seconds} "
            f"+ stop {proc.stop_grace}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_labelled_unprivileged_and_reference_what_exists(overlay):
    docs = render(overlay)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    config = next(iter(by_kind(docs, "ConfigMap").values()))["data"]
    device_tag = {"cpu": "cpu", "cuda": "gpu"}[config["PDSERVE_DEVICE"]]
    names = {k: set(by_kind(docs, k)) for k in ("ConfigMap", "Secret",
                                                "PersistentVolumeClaim")}
    # docs/operations.md: kubectl create secret
    operator_made = {"pdserve-api-keys", "pdserve-cluster-token", "pdserve-tenant-salt"}
    for name, pod in pods(docs).items():
        labels = pod.labels
        assert labels["app.kubernetes.io/name"] == labels["app.kubernetes.io/part-of"] == "pdserve"
        # The download Job's template is immutable: no release may change it (models.yaml).
        download = name == "model-download"
        assert labels.get("app.kubernetes.io/version") == (None if download else version), name
        assert pod.spec["securityContext"]["runAsNonRoot"] is True, name
        assert pod.spec["automountServiceAccountToken"] is False, name
        for c in pod.containers:
            sc = c.spec["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {
                "drop": ["ALL"]} and sc["readOnlyRootFilesystem"] is True, f"{name}/{c.name}"
            pinned = rf"docker\.io/library/pdserve:[0-9.]+-{device_tag}"   # any release's
            image = (re.fullmatch(pinned, c.spec["image"]) if download
                     else c.spec["image"] == f"pdserve:{version}-{device_tag}")
            assert image, f"{name}/{c.name}: {c.spec['image']}"
            res = c.spec["resources"]
            if name in ("prefill", "decode"):     # Guaranteed QoS: whole cores for an engine
                assert res["requests"] == res["limits"], f"{name}/{c.name}"
            assert {"cpu", "memory"} <= set(res["limits"]), f"{name}/{c.name}"
            for ref in c.spec.get("envFrom", []):
                assert ref["configMapRef"]["name"] in names["ConfigMap"]
            for e in c.spec.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                assert ref is None or ref.get("optional") or ref["name"] in names["Secret"]
        for v in pod.spec.get("volumes", []):
            if "secret" in v:
                assert (v["secret"]["secretName"] in names["Secret"]
                        or (v["secret"]["secretName"] in operator_made
                            and not any(s.startswith(v["secret"]["secretName"])
                                        for s in names["Secret"])))
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in names["PersistentVolumeClaim"]


@pytest.mark.parametrize("overlay", ["h100", "inference-extension"])
def test_autoscalers_scale_their_own_pool_on_its_own_pods(overlay):
    docs = render(overlay)
    sets = by_kind(docs, "StatefulSet")
    namespace = next(iter(sets.values()))["metadata"]["namespace"]
    scaled = by_kind(docs, "ScaledObject")
    assert {component(s) for s in scaled.values()} == {"prefill", "decode"}
    for so in scaled.values():
        target = so["spec"]["scaleTargetRef"]
        assert target["kind"] == "StatefulSet" and target["name"] in sets
        other = next(n for n in sets if n != target["name"])
        for name, query in keda_queries(so):
            ns = re.search(r'namespace="([^"]+)"', query).group(1)
            pod_re = re.search(r'pod=~"([^"]+)"', query).group(1)
            assert ns == namespace, name
            assert re.fullmatch(pod_re, f"{target['name']}-0"), name
            assert not re.fullmatch(pod_re, f"{other}-0"), name


def test_dockerfile_builds_the_extras_the_manifests_run():
    dockerfile = (ROOT / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert re.search(r"^ARG EXTRAS=cpu$", dockerfile, re.MULTILINE)
    assert "lock/install_lock.sh python lock/${EXTRAS}.txt" in dockerfile
    assert {"cpu", "gpu"} <= set(project["optional-dependencies"])
    assert all((ROOT / "lock" / f"{extras}.txt").is_file() for extras in ("cpu", "gpu"))
    assert project["scripts"]["pdserve"] == "pdserve.cli:main"
    user = int(re.search(r"^USER (\d+)$", dockerfile, re.MULTILINE).group(1))
    for overlay in OVERLAYS:
        for pod in pods(render(overlay)).values():
            assert pod.spec["securityContext"]["runAsUser"] == user


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels, matchExpressions In/NotIn/Exists) matches."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        value = labels.get(e["key"])
        if (e["operator"] == "In" and value not in e["values"]
                or e["operator"] == "NotIn" and value in e["values"]
                or e["operator"] == "Exists" and value is None):
            return False
    return True


def test_the_prometheus_operator_scrapes_every_metrics_port():
    """Every port a pdserve process serves /metrics on (the workers', the router's and the
    edge's --metrics-port; an edge without one, its HTTP port) is a PodMonitor endpoint, with the path the
    process serves; every PodMonitor endpoint is such a port (h100 runs the Operator)."""
    docs = render("h100")
    monitors = by_kind(docs, "PodMonitor")
    scraped = {}                        # component -> {(port number, path)}
    for monitor in monitors.values():
        chosen = [(n, pod) for n, (pod, _) in _processes(docs).items()
                  if _selects(monitor["spec"]["selector"], pod.labels)]
        assert chosen, f"PodMonitor {monitor['metadata']['name']} selects no pod"
        for name, pod in chosen:
            for ep in monitor["spec"]["podMetricsEndpoints"]:
                scraped.setdefault(name, set()).add((pod.main.port(ep["port"]), ep["path"]))
    for name, (pod, proc) in _processes(docs).items():
        served = {(proc.listens.get("metrics", proc.listens.get("http")), "/metrics")}
        assert scraped.get(name) == served, (name, scraped.get(name), served)
        # ... and for a Prometheus without the Operator, the same port in the annotations.
        annotations = pod.template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        assert int(annotations["prometheus.io/port"]) in {p for p, _ in served}, name
