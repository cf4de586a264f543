"""Which implementation runs each native part: its C module, or its Python reference.

Two parts have both (setup.py builds the C ones where a compiler is at hand): the
router's placement core (`placement`: services/router/_placement.c against
keystore.py, registry.py and placement.py) and the edge's byte-level detokenizer
(`bytetext`: services/edge/_bytetext.c against the tokenizer's DecodeStream).
`PDSERVE_NATIVE` chooses for every part alike:

  auto     the C module where it was built, else the Python (the default)
  python   the Python, built or not (to compare the two, or to rule the C out)
  require  the C module; one that is not built fails the import that asks for it,
           saying so (`make test` runs this way: a lost build cannot pass unseen)

Every module that can run either asks `load` here, at its import, and nowhere else.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

MODES = ("auto", "python", "require")
PARTS = {"placement": "pdserve.services.router._placement",
         "bytetext": "pdserve.services.edge._bytetext"}


class NativeMissing(ImportError):
    """PDSERVE_NATIVE=require and a C part is not built."""


def mode() -> str:
    """PDSERVE_NATIVE, checked (ValueError names it)."""
    # NOTE: read here, not in pdserve.cli: a part is chosen when its module is imported,
    # in processes that never parse flags (tests, benchmarks, vLLM's engine process).
    value = os.environ.get("PDSERVE_NATIVE", "") or "auto"
    if value not in MODES:
        raise ValueError(f"PDSERVE_NATIVE must be one of {'|'.join(MODES)}, got {value!r}")
    return value


def c_module(part: str) -> ModuleType:
    """The C module of `part`, whatever the mode (NativeMissing when not built)."""
    name = PARTS[part]
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise NativeMissing(f"the C part {part!r} ({name}) is not built: run `python setup.py "
                            f"build_ext --inplace` (make does), or set PDSERVE_NATIVE=auto "
                            f"to run its Python reference ({e})") from e


def load(part: str) -> ModuleType | None:
    """The C module that runs `part` by PDSERVE_NATIVE, or None where the Python runs."""
    chosen = mode()
    if chosen == "python":
        return None
    try:
        return c_module(part)
    except NativeMissing as e:
        if chosen == "require":
            raise NativeMissing(f"PDSERVE_NATIVE=require: {e}") from e
        return None

