"""The image serves: the cpu-dev overlay's pods run as containers of it (`make image-test`).

Each pod's containers run from $PDSERVE_IMAGE as the manifests run them: their command,
args and env (translated as local_cluster.py says: host network, local ports, one core per
engine), the pod's user, a read-only root filesystem, no capabilities, and each volume a
local directory; the model comes from the init container. One completion streams through
edge -> router -> prefill -> (NIXL) -> decode, and every container stops on SIGTERM.
Skipped unless PDSERVE_IMAGE names a built image (`make image` takes minutes).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from local_cluster import CORES, ORDER, LocalCluster, stream
from support import parse_sse

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("PDSERVE_IMAGE", "")
if not IMAGE:
    pytest.skip("PDSERVE_IMAGE is not set (make image-test sets it)", allow_module_level=True)


def container_tool() -> list[str]:
    """The tool and the run options this machine needs (scripts/container.sh)."""
    out = subprocess.run(["bash", "-c", 'source scripts/container.sh && pick_container_tool '
                          '&& printf "%s\\n" "$tool" "${global[@]}" run "${limits[@]}"'],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.split()


class ImageCluster(LocalCluster):
    """The cpu-dev pods as containers of IMAGE."""

    def __init__(self, tmp_path):
        super().__init__(tmp_path)
        self.run = container_tool()
        self.names: list[str] = []

    def command(self, name: str, container) -> tuple[list[str], dict[str, str]]:
        argv, env, mounts = self.translate(name, container, paths=False)
        pod = self.pods[name].spec.get("securityContext", {})
        sec = container.spec.get("securityContext", {})
        user = f"{pod['runAsUser']}:{pod.get('runAsGroup', pod['runAsUser'])}"
        cname = f"pdserve-image-test-{os.getpid()}-{name}-{len(self.names)}"
        self.names.append(cname)
        run = [*self.run, "--rm", "--name", cname, "--network", "host", "--user", user,
               "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
        if sec.get("readOnlyRootFilesystem"):
            run.append("--read-only")
        for mount in container.spec.get("volumeMounts", []):
            local = mounts[mount["mountPath"]]
            os.chown(local, *map(int, user.split(":")))      # as the pod's fsGroup would
            run += ["-v", f"{local}:{mount['mountPath']}" + (":ro" if mount.get("readOnly")
                                                             else "")]
        for key, value in env.items():
            run += ["-e", f"{key}={value}"]
        if name in CORES and not container.init:
            argv = ["taskset", "-c", CORES[name], *argv]
        return [*run, IMAGE, *argv], {}

    def remove(self) -> None:
        if self.names:
            subprocess.run([self.run[0], *self.run[1:self.run.index("run")], "rm", "-f",
                            "--ignore", *self.names], capture_output=True)


def test_the_image_holds_exactly_the_lock():
    run = container_tool()
    frozen = subprocess.run([*run, "--rm", IMAGE, "pip", "freeze", "--all"],
                            capture_output=True, text=True, check=True).stdout

    def pins(text: str) -> set[str]:
        return {re.sub(r"[-_.]+", "-", line.split(";")[0].strip()).lower()
                for line in text.splitlines()
                if re.match(r"^[A-Za-z0-9]", line) and not line.startswith(("pip=", "pdserve"))}

    assert pins(frozen) == pins((ROOT / "lock" / "cpu.txt").read_text())


def test_the_image_serves_the_cpu_dev_overlay(tmp_path):
    cluster = ImageCluster(tmp_path)
    stopped = {}
    try:
        cluster.up()
        edge = f"http://127.0.0.1:{cluster.local_port('edge', 'http')}"
        key = cluster.api_key()
        model = cluster.pods["edge"].main.env["PDSERVE_SERVED_MODEL_NAME"]
        status, headers, raw = stream(edge, key, model)
        assert status == 200 and headers["x-pdserve-path"] == "disaggregated"
        events = [data for _, data in parse_sse(raw)]
        assert events[-1] == "[DONE]"
        text = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in map(json.loads, events[:-1]) if c["choices"])
        assert text
        print(f"\nstreamed through {IMAGE}: {text!r}")
    finally:
        stopped = cluster.stop()
        cluster.remove()
    for name, (code, took) in stopped.items():
        assert code == 0, f"{name} exited {code} after {took:.1f} s:\n" + "\n".join(
            cluster.procs[name].lines[-30:])
    assert set(stopped) == set(ORDER)
