"""The h100 model download survives a re-apply: its Job's pod template (immutable once
created) is the same whatever else the config or the serving image says; the serving pods
wait for the marker written after the last file, not for config.json; and the download
script, run against a stub huggingface_hub, downloads once under concurrency, resumes after
a failure, and writes the marker last."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import yaml
from k8s_manifests import K8S, by_kind, pods, render, tool

MARKER = ".pdserve-download-complete"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _render_dir(path: Path) -> str:
    out = subprocess.run([tool("kubectl"), "kustomize", str(path)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _doc_text(rendered: str, kind: str, name: str) -> str:
    """One object of a render, as kustomize wrote it."""
    found = [d for d in rendered.split("\n---\n")
             if (y := yaml.safe_load(d)) and y["kind"] == kind and y["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} in the render"
    return found[0]


def _h100_copy(tmp_path: Path, edit) -> str:
    """Render a copy of k8s/ whose h100 kustomization `edit` changed."""
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root)
    path = root / "overlays" / "h100" / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    edit(kustomization)
    path.write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return _render_dir(root / "overlays" / "h100")


def _set_literal(kustomization: dict, key: str, value: str) -> None:
    gen = next(g for g in kustomization["configMapGenerator"] if g["name"] == "pdserve-config")
    gen["literals"] = [lit for lit in gen["literals"] if not lit.startswith(f"{key}=")]
    gen["literals"].append(f"{key}={value}")


def _config_and_image(kustomization: dict) -> None:
    """A changed and an added config literal, and a new serving image."""
    _set_literal(kustomization, "PDSERVE_MAX_MODEL_LEN", "16384")
    _set_literal(kustomization, "PDSERVE_STREAM_STORE", "redis://redis:6379")
    image = next(i for i in kustomization["images"] if i["name"] == "pdserve")
    image.update(newName="registry.example/pdserve", newTag="0.1.1-gpu")


def _release(kustomization: dict) -> None:
    _config_and_image(kustomization)
    for entry in kustomization["labels"]:
        if "app.kubernetes.io/version" in entry["pairs"]:
            entry["pairs"]["app.kubernetes.io/version"] = "0.1.1"


JOB = "pdserve-model-download"


def test_download_job_is_byte_identical_after_config_and_image_changes(tmp_path):
    before = _h100_copy(tmp_path / "a", lambda k: None)
    after = _h100_copy(tmp_path / "b", _config_and_image)
    assert _doc_text(before, "Job", JOB) == _doc_text(after, "Job", JOB)
    # ... while the change did reach everything else.
    configmaps = lambda text: {n for n in by_kind(  # noqa: E731
        [d for d in yaml.safe_load_all(text) if d], "ConfigMap") if n.startswith("pdserve-config")}
    assert configmaps(before) != configmaps(after)
    assert "registry.example/pdserve:0.1.1-gpu" in _doc_text(after, "StatefulSet", "pdserve-decode")


def test_download_job_template_is_the_same_across_releases(tmp_path):
    """A release's version label reaches the Job's metadata (mutable), not its spec."""
    before = _h100_copy(tmp_path / "a", lambda k: None)
    after = _h100_copy(tmp_path / "b", _release)
    spec = lambda text: yaml.safe_dump(yaml.safe_load(text)["spec"])  # noqa: E731
    assert spec(_doc_text(before, "Job", JOB)) == spec(_doc_text(after, "Job", JOB))
    assert "app.kubernetes.io/version: 0.1.1" in _doc_text(after, "StatefulSet", "pdserve-decode")


def test_download_job_takes_the_model_but_not_the_configmap():
    docs = render("h100")
    job = pods(docs)["model-download"]
    (c,) = job.containers
    assert "envFrom" not in c.spec and "configMap" not in yaml.safe_dump(job.template)
    assert "app.kubernetes.io/version" not in job.labels
    config = next(iter(by_kind(docs, "ConfigMap").values()))["data"]
    assert c.env["MODEL_ID"] == config["PDSERVE_SERVED_MODEL_NAME"] == MODEL
    assert c.env["MODEL_DIR"] == config["PDSERVE_MODEL"]
    assert c.env["MODEL_REVISION"] == config["PDSERVE_MODEL_REVISION"]
    token = next(e for e in c.spec["env"] if e["name"] == "HF_TOKEN")
    assert "value" not in token and token["valueFrom"]["secretKeyRef"]["name"] == "pdserve-hf-token"


def test_a_model_change_reaches_the_job(tmp_path):
    def other_model(k):
        _set_literal(k, "PDSERVE_SERVED_MODEL_NAME", "Qwen/Qwen3-8B")
        _set_literal(k, "PDSERVE_MODEL", "/models/Qwen/Qwen3-8B")
    env = {e["name"]: e.get("value") for e in yaml.safe_load(_doc_text(
        _h100_copy(tmp_path, other_model), "Job", JOB))
        ["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MODEL_ID"] == "Qwen/Qwen3-8B" and env["MODEL_DIR"] == "/models/Qwen/Qwen3-8B"


def test_serving_pods_wait_for_the_marker_not_config_json():
    script = _job_script()
    assert f'"{MARKER}"' in script
    for name in ("edge", "prefill", "decode"):
        (wait,) = [c for c in pods(render("h100"))[name].containers if c.init]
        assert wait.name == "wait-for-model", name
        assert f'"{MARKER}"' in wait.argv[2] and "config.json" not in wait.argv[2], name
    # The marker is renamed into place after the download call returns.
    assert script.index("snapshot_download(repo") < script.index("os.replace(tmp, marker)")


def test_wait_for_model_waits_until_the_marker(tmp_path):
    (wait,) = [c for c in pods(render("h100"))["decode"].containers if c.init]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")          # the first file of a download
    env = {**os.environ, "PDSERVE_MODEL": str(model)}
    proc = subprocess.Popen([sys.executable, "-c", wait.argv[2]], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        assert proc.poll() is None, "wait-for-model ended with config.json only"
    finally:
        proc.kill()
        proc.communicate()
    (model / MARKER).write_text(f"{MODEL} main c0ffee\n")
    done = subprocess.run([sys.executable, "-c", wait.argv[2]], env=env, capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 0 and "c0ffee" in done.stdout


# --- the download script against a stub hub --------------------------------------------

SHARDS = ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")

STUB = textwrap.dedent(f'''
    """A stand-in for huggingface_hub: files land one by one, config.json first; a file
    already there is kept (as the real one resumes); every step is logged."""
    import os, time

    SHARDS = {SHARDS!r}

    def _log(line):
        with open(os.environ["STUB_LOG"], "a") as f:
            f.write(line + "\\n")

    class _Info:
        def __init__(self, sha):
            self.sha = sha

    class HfApi:
        def __init__(self, token=None):
            pass

        def model_info(self, repo_id, revision=None):
            return _Info({{"main": "c0ffee"}}.get(revision, revision))

    def snapshot_download(repo_id, *, revision, local_dir, token=None):
        _log(f"start {{repo_id}} {{revision}}")
        marker = os.path.join(local_dir, "{MARKER}")
        for name in SHARDS:
            path = os.path.join(local_dir, name)
            if name == SHARDS[-1]:
                gate = os.environ.get("STUB_GATE")
                while gate and not os.path.exists(gate):
                    time.sleep(0.05)
                if os.environ.get("STUB_FAIL_AT") == name:
                    raise OSError("connection reset by peer")
            if os.path.exists(path) and open(path).read() == revision:
                continue
            with open(path, "w") as f:
                f.write(revision)
            _log(f"wrote {{name}} marker={{os.path.exists(marker)}}")
        return local_dir
''')


def _job_script() -> str:
    (c,) = pods(render("h100"))["model-download"].containers
    assert c.argv[:2] == ["python", "-c"]
    return c.argv[2]


class Hub:
    """Runs the Job's own script with the stub hub first on the module path."""

    def __init__(self, tmp_path: Path):
        (tmp_path / "stub" / "huggingface_hub").mkdir(parents=True)
        (tmp_path / "stub" / "huggingface_hub" / "__init__.py").write_text(STUB)
        self.model = tmp_path / "models" / MODEL
        self.log = tmp_path / "hub.log"
        self.gate = tmp_path / "gate"
        self.env = {**os.environ, "PYTHONPATH": str(tmp_path / "stub"), "STUB_LOG": str(self.log),
                    "MODEL_ID": MODEL, "MODEL_REVISION": "main", "MODEL_DIR": str(self.model)}
        self.script = _job_script()

    def start(self, stderr=subprocess.PIPE, **env) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", self.script], env={**self.env, **env},
                                stdout=subprocess.PIPE, stderr=stderr, text=True)

    def run(self, **env) -> subprocess.CompletedProcess:
        proc = self.start(**env)
        out, err = proc.communicate(timeout=60)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    @property
    def marker(self) -> Path:
        return self.model / MARKER


def _wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_two_concurrent_downloads_download_once_and_mark_at_the_end(tmp_path):
    hub = Hub(tmp_path)
    first = hub.start(STUB_GATE=str(hub.gate))
    second = None
    try:
        _wait_for(lambda: any(line.startswith("wrote config.json") for line in hub.lines()))
        assert not hub.marker.exists()         # config.json is there; the model is not
        with open(tmp_path / "second.err", "w") as err:
            second = hub.start(stderr=err, STUB_GATE=str(hub.gate))
        _wait_for(lambda: "another download" in (tmp_path / "second.err").read_text())
        assert second.poll() is None           # held on the lock, not downloading
        assert [x for x in hub.lines() if x.startswith("start")] == [f"start {MODEL} c0ffee"]
        hub.gate.touch()
        results = [p.communicate(timeout=60) + (p.returncode,) for p in (first, second)]
    finally:
        for p in (first, second):
            if p and p.poll() is None:
                p.kill()
                p.communicate()
    for out, err, rc in results:
        assert rc == 0, err
    assert hub.lines() == [f"start {MODEL} c0ffee"] + [
        f"wrote {name} marker=False" for name in SHARDS]
    assert hub.marker.read_text() == f"{MODEL} main c0ffee\n"
    assert not (hub.model / (MARKER + ".tmp")).exists()

    again = hub.run()                         # after success: nothing downloaded
    assert again.returncode == 0, again.stderr
    assert len(hub.lines()) == 1 + len(SHARDS) and "is complete" in again.stdout


def test_a_failed_download_leaves_no_marker_and_a_rerun_completes_it(tmp_path):
    hub = Hub(tmp_path)
    failed = hub.run(STUB_FAIL_AT=SHARDS[-1])
    assert failed.returncode != 0 and "connection reset" in failed.stderr
    assert (hub.model / "config.json").exists() and not hub.marker.exists()

    rerun = hub.run()
    assert rerun.returncode == 0, rerun.stderr
    assert hub.lines()[-2:] == [f"start {MODEL} c0ffee", f"wrote {SHARDS[-1]} marker=False"]
    assert hub.marker.read_text() == f"{MODEL} main c0ffee\n"


def test_another_revision_drops_the_marker_until_it_is_downloaded(tmp_path):
    hub = Hub(tmp_path)
    assert hub.run().returncode == 0
    pinned = hub.run(MODEL_REVISION="0123abcd", STUB_FAIL_AT=SHARDS[-1])
    assert pinned.returncode != 0 and not hub.marker.exists()
    pinned = hub.run(MODEL_REVISION="0123abcd")
    assert pinned.returncode == 0, pinned.stderr
    assert hub.marker.read_text() == f"{MODEL} 0123abcd 0123abcd\n"


def test_cpu_dev_builds_the_model_before_anything_reads_it():
    """cpu-dev downloads nothing: each pod's init container builds the model into a
    temporary directory and renames it into place (pdserve.tiny_model), and the pod's
    other containers start only after it has exited."""
    for name in ("edge", "prefill", "decode"):
        (init,) = [c for c in pods(render("cpu-dev"))[name].containers if c.init]
        assert init.argv[:2] == ["pdserve", "build-model"], name
