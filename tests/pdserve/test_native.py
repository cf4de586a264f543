"""PDSERVE_NATIVE picks each native part's implementation, for every module that runs it:
the C module where it is built (auto), the Python (python), or the C module or a
clear error at import (require)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve import native
from support import c_part

# What a router and an edge run, as each module that can run either has chosen it.
CHOSEN = ("import json\n"
          "from pdserve.services.router import keystore, placement, registry\n"
          "from pdserve.services.edge import detokenizer\n"
          "print(json.dumps({'keys': keystore.KeyStore.__module__,\n"
          "                  'worker': registry.WorkerEntry.__mro__[1].__module__,\n"
          "                  'decide': 'python' if placement.decide is placement.py_decide\n"
          "                            else 'c',\n"
          "                  'bytes': detokenizer.ByteStream is not None}))\n")
C = {"keys": "pdserve.services.router._placement", "worker": "pdserve.services.router._placement",
     "decide": "c", "bytes": True}
PYTHON = {"keys": "pdserve.services.router.keystore", "worker": "pdserve.services.router.registry",
          "decide": "python", "bytes": False}


def _run(code: str, mode: str | None, hide: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    hidden = "".join(f"import sys; sys.modules[{n!r}] = None\n" for n in hide)
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_NATIVE"}
    if mode is not None:
        env["PDSERVE_NATIVE"] = mode
    return subprocess.run([sys.executable, "-c", hidden + code], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.parametrize("mode,want", [(None, C), ("auto", C), ("require", C),
                                       ("python", PYTHON)])
def test_every_module_runs_the_implementation_the_mode_picks(mode, want):
    for part in native.PARTS:
        c_part(part)                         # built: auto and require pick C
    out = _run(CHOSEN, mode)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == want


def test_auto_runs_the_python_where_a_part_is_not_built():
    out = _run(CHOSEN, "auto", hide=tuple(native.PARTS.values()))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == PYTHON


@pytest.mark.parametrize("part,module", [("placement", "pdserve.services.router.keystore"),
                                         ("bytetext", "pdserve.services.edge.detokenizer")])
def test_require_fails_the_import_of_a_part_that_is_not_built_saying_what_to_do(part, module):
    out = _run(f"import {module}", "require", hide=(native.PARTS[part],))
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve.native.NativeMissing: PDSERVE_NATIVE=require: "), last
    assert native.PARTS[part] in last and "build_ext --inplace" in last


def test_a_mode_that_is_none_of_the_three_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("PDSERVE_NATIVE", "fast")
    with pytest.raises(ValueError, match="PDSERVE_NATIVE must be one of auto|python|require"):
        native.load("placement")

