"""The cpu-dev overlay's pods, run on this machine: as plain processes (LocalCluster) or as
containers of the image (tests/k8s/test_k8s_image.py).

Each container runs with the command, args and env the rendered manifests give it
(ConfigMap, downward API, `$(VAR)` expanded as the kubelet does). Only what a pod's
sandbox would provide is translated, and nothing else:
  - the network: every pod has its own IP and ports, here they share loopback, so each
    container port gets a free local port outside UCX's port range (where the engines'
    UCX listens), Service names resolve to those ports, the pod IP is 127.0.0.1, and
    UCX's device (the pod's eth0) is `lo`;
  - the volumes: each mount path is a local directory (the Secret's files written into
    it); the model volume is shared, built once by the init container (the three pods'
    init containers are identical, and the model is byte-identical by construction);
  - the cpuset: each engine gets one core, as the static CPU manager gives a Guaranteed
    pod with 1 CPU.
"""
from __future__ import annotations

import json
import re
import socket
import sys
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from k8s_manifests import by_kind, pods, render, secret_files
from support import Proc, free_port

CORES = {"prefill": "0", "decode": "1"}      # one exclusive core per engine pod
ORDER = ("router", "prefill", "decode", "edge")
PROMPT = ("Tell me a long story about the small green dog, the quick network, and the old "
          "ship that sends every request across the cold blue river.")


class LocalCluster:
    """The cpu-dev pods as local processes."""

    def __init__(self, tmp_path):
        self.docs = render("cpu-dev")
        self.pods = pods(self.docs)
        self.tmp = tmp_path
        # (component, container port) -> local port, none where UCX will listen: its
        # range is fixed (UCX_TCP_PORT_RANGE) and a pod's engine takes a port of it first
        ucx = tuple(_port_range(pod.main.env["UCX_TCP_PORT_RANGE"]) for pod in self.pods.values()
                    if "UCX_TCP_PORT_RANGE" in pod.main.env)
        self.ports = {(n, p): free_port(avoid=ucx) for n, pod in self.pods.items()
                      for p in pod.main.ports.values()}
        self.services = {}                                   # "name:port" -> local address
        for name, svc in by_kind(self.docs, "Service").items():
            owner = next(n for n, pod in self.pods.items()
                         if svc["spec"]["selector"].items() <= pod.labels.items())
            for port in svc["spec"]["ports"]:
                target = self.pods[owner].main.port(port["targetPort"])
                self.services[f"{name}:{port['port']}"] = f"127.0.0.1:{self.ports[owner, target]}"
        self.procs: dict[str, Proc] = {}

    def mounts(self, name: str, container) -> dict[str, str]:
        """mountPath -> local directory, for one container of pod `name`."""
        out = {}
        for m in container.spec.get("volumeMounts", []):
            vol = next(v for v in self.pods[name].spec["volumes"] if v["name"] == m["name"])
            local = self.tmp / ("models" if m["name"] == "models" else f"{name}-{m['name']}")
            local.mkdir(exist_ok=True)
            if "secret" in vol:
                for fname, data in secret_files(self.docs, vol["secret"]["secretName"]).items():
                    (local / fname).write_bytes(data)
            out[m["mountPath"]] = str(local)
        return out

    def translate(self, name: str, container, paths: bool = True
                  ) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """The container's argv, env and mounts (mountPath -> local directory), translated
        to this machine (see the module doc); mount paths in values too where `paths`."""
        container.env["POD_IP"] = "127.0.0.1"
        mounts = self.mounts(name, container)
        paths = paths and re.compile("(?:" + "|".join(map(re.escape, sorted(mounts, key=len, reverse=True)))
                           + r")(?=/|$)") if mounts else None
        own = {p: self.ports[name, p] for p in container.ports.values()}

        def local(value: str) -> str:
            value = paths.sub(lambda m: mounts[m.group(0)], value) if paths else value
            for addr, here in self.services.items():
                value = value.replace(addr, here)
            return value.replace("0.0.0.0", "127.0.0.1")

        argv = []
        for arg in container.argv:
            flag, eq, value = arg.partition("=")
            if eq and flag.endswith("port") and value.isdigit() and int(value) in own:
                arg = f"{flag}={own[int(value)]}"
            argv.append(local(arg))
        env = {k: local(v) for k, v in container.env.items()}
        if "UCX_NET_DEVICES" in env:
            env["UCX_NET_DEVICES"] = "lo"
        return argv, env, mounts

    def command(self, name: str, container) -> tuple[list[str], dict[str, str]]:
        """The container's argv and env as a local process."""
        argv, env, _ = self.translate(name, container)
        assert argv[0] == "pdserve"                  # the image's console script
        argv = [sys.executable, "-m", "pdserve.cli", *argv[1:]]
        if name in CORES and not container.init:
            argv = ["taskset", "-c", CORES[name], *argv]
        return argv, env

    def build_model(self) -> None:
        """Run the init container once (see the module doc: all three are the same)."""
        inits = {n: [c for c in pod.containers if c.init] for n, pod in self.pods.items()}
        inits = {n: cs[0] for n, cs in inits.items() if cs}
        assert set(inits) == {"edge", "prefill", "decode"}
        as_written = {json.dumps([c.argv, c.env, c.spec["volumeMounts"]], sort_keys=True)
                      for c in inits.values()}
        assert len(as_written) == 1, "the pods build the model differently"
        argv, env = self.command("edge", inits["edge"])
        proc = Proc(argv, env=env, name="build-model")
        assert proc.popen.wait(timeout=180) == 0, "\n".join(proc.lines[-30:])

    def up(self, timeout: float = 300) -> None:
        """The init container, then every pod, then their probes passing."""
        self.build_model()
        self.start()
        self.wait_ready(timeout)

    def api_key(self) -> str:
        """The first key of the overlay's generated API-key Secret."""
        keys = secret_files(self.docs, "pdserve-api-keys")["api-keys"].decode()
        return next(line.split()[0] for line in keys.splitlines()
                    if line.strip() and not line.startswith("#"))

    def start(self) -> None:
        for name in ORDER:
            argv, env = self.command(name, self.pods[name].main)
            self.procs[name] = Proc(argv, env=env, name=name)

    def local_port(self, name: str, ref) -> int:
        return self.ports[name, self.pods[name].main.port(ref)]

    def probe(self, name: str, kind: str) -> bool:
        """One run of a container's probe, as the kubelet does it."""
        probe = self.pods[name].main.spec[kind]
        timeout = probe.get("timeoutSeconds", 1)
        try:
            if "grpc" in probe:
                port = self.local_port(name, probe["grpc"]["port"])
                with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                    reply = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")),
                        timeout=timeout)
                return reply.status == health_pb2.HealthCheckResponse.SERVING
            if "httpGet" in probe:
                get = probe["httpGet"]
                url = f"http://127.0.0.1:{self.local_port(name, get['port'])}{get['path']}"
                with urllib.request.urlopen(url, timeout=timeout) as r:
                    return 200 <= r.status < 400
            port = self.local_port(name, probe["tcpSocket"]["port"])
            socket.create_connection(("127.0.0.1", port), timeout=timeout).close()
            return True
        except (grpc.RpcError, OSError):
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name in ("router", "prefill", "decode", "edge"):
            for kind in ("startupProbe", "readinessProbe"):
                if kind not in self.pods[name].main.spec:
                    continue
                while not self.probe(name, kind):
                    proc = self.procs[name]
                    if proc.popen.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"{name}: {kind} never passed (exit "
                                             f"{proc.popen.poll()}):\n"
                                             + "\n".join(proc.lines[-40:]))
                    time.sleep(0.5)

    def stop(self) -> dict[str, tuple[int | None, float]]:
        """SIGTERM in the order a rollout would (edge first); exit code and seconds taken
        by each, killing (and failing) what outlives its grace period."""
        out = {}
        self.tree = [pid for proc in self.procs.values() for pid in proc.descendants()]
        for name in reversed(ORDER):
            proc = self.procs.get(name)
            if proc is None:
                continue
            grace = self.pods[name].spec["terminationGracePeriodSeconds"]
            started = time.monotonic()
            try:
                code = proc.stop(timeout=grace)
            except AssertionError:
                code = None
            out[name] = (code, time.monotonic() - started)
        return out


def _port_range(spec: str) -> range:
    """'20000-20999' -> range(20000, 21000)."""
    low, _, high = spec.partition("-")
    return range(int(low), int(high or low) + 1)


def stream(url: str, key: str, model: str):
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, dict(r.headers), r.read().decode()
