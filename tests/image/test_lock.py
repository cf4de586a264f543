"""lock/*.txt, the one lock (scripts/lock.sh): it pins what pyproject.toml asks for, and
.venv holds what the lock pins (`make` installs it with scripts/install_lock.sh)."""
from __future__ import annotations

import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LOCKS = {"cpu": ("cpu",), "gpu": ("gpu",), "cpu-dev": ("cpu", "dev"), "gpu-dev": ("gpu", "dev")}
DROPPED_ON_CPU = {"torchvision", "torchaudio", "torchcodec", "triton"}   # scripts/lock.sh


def pins(lock: str) -> dict[str, Version]:
    text = (ROOT / "lock" / f"{lock}.txt").read_text()
    return {canonicalize_name(m[0]): Version(m[1])
            for m in re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", text, re.MULTILINE)}


@pytest.mark.parametrize("lock", LOCKS)
def test_the_lock_pins_every_requirement_of_pyproject(lock):
    pinned = pins(lock)
    wanted = [*PROJECT["dependencies"]]
    for extra in LOCKS[lock]:
        wanted += PROJECT["optional-dependencies"][extra]
    unmet = []
    for line in wanted:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name not in pinned or not req.specifier.contains(pinned[name], prereleases=True):
            unmet.append(f"{req} (lock: {pinned.get(name)})")
    assert not unmet, f"lock/{lock}.txt is stale, run `make lock`: {unmet}"
    if lock.startswith("cpu"):
        assert not DROPPED_ON_CPU & set(pinned)
        assert str(pinned["torch"]).endswith("+cpu")
    else:
        assert not pinned["torch"].local                   # the CUDA build from the index


def test_the_runtime_locks_are_the_dev_locks_without_dev():
    for device in ("cpu", "gpu"):
        runtime, dev = pins(device), pins(f"{device}-dev")
        assert {n: v for n, v in dev.items() if n in runtime} == runtime


@pytest.mark.skipif(not Path(sys.prefix, ".installed-cpu").exists(),
                    reason="this Python is not .venv as `make` installs it (EXTRAS=cpu)")
def test_the_venv_holds_the_cpu_dev_lock():
    wrong = {}
    for name, version in pins("cpu-dev").items():
        try:
            have = Version(md.version(name))
        except md.PackageNotFoundError:
            have = None
        if have != version:
            wrong[name] = (str(version), have and str(have))
    assert not wrong, f"(lock, installed): {wrong}; run make"
