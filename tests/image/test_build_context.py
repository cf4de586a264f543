"""The image's build context: what the Dockerfile copies is what .dockerignore lets through.

docker-py's matcher implements Docker's .dockerignore rules (Go's filepath.Match, `**`,
`!` exceptions, the last match deciding), so this sees the context docker, podman and
buildah send.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from docker.utils.build import exclude_paths

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("cpu", "gpu")


def instructions(dockerfile: str) -> list[tuple[str, list[str]]]:
    """(INSTRUCTION, words) per instruction, continuation lines joined, comments dropped."""
    lines = [line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), shlex.split(rest)))
    return out


def copy_sources(dockerfile: str, extras: str) -> list[str]:
    """The build-context paths each COPY/ADD reads (not those copied from a stage)."""
    sources = []
    for word, args in instructions(dockerfile):
        if word not in ("COPY", "ADD") or any(a.startswith("--from") for a in args):
            continue
        paths = [a for a in args if not a.startswith("--")][:-1]
        sources += [p.replace("${EXTRAS}", extras).replace("$EXTRAS", extras) for p in paths]
    return sources


def context() -> set[str]:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    return set(exclude_paths(str(ROOT), patterns, dockerfile="Dockerfile"))


@pytest.mark.parametrize("extras", EXTRAS)
def test_every_copy_source_is_in_the_build_context(extras):
    kept = context()
    sources = copy_sources((ROOT / "Dockerfile").read_text(), extras)
    assert sources, "the Dockerfile copies nothing from the context"
    missing = []
    for src in sources:
        src = src.rstrip("/")
        if (ROOT / src).is_dir():
            if not any(path.startswith(src + "/") and (ROOT / path).is_file() for path in kept):
                missing.append(src + "/")
        elif src not in kept:
            missing.append(src)
    assert not missing, f".dockerignore leaves these COPY sources out of the context: {missing}"


def test_the_context_holds_no_build_outputs_or_secrets():
    kept = context()
    heavy = [p for p in kept if p.split("/")[0] in (".venv", ".venv-clients", ".git", "models")
             or p.endswith((".so", ".pyc")) or "node_modules" in p]
    assert not heavy, heavy[:10]
    assert "k8s/overlays/cpu-dev/api-keys.dev.txt" not in kept


def test_the_matcher_reads_dockerignore_as_docker_does(tmp_path):
    """The rules this check leans on: `*` then `!` exceptions, and an exception that a
    later pattern excludes again."""
    for rel in ("a.py", "keep/x.py", "keep/y.pyc", "drop/z.py"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("")
    kept = set(exclude_paths(str(tmp_path), ["*", "!keep/", "**/*.pyc"]))
    assert "keep/x.py" in kept and "keep/y.pyc" not in kept
    assert "a.py" not in kept and "drop/z.py" not in kept
