"""Fixtures shared across the suite."""
from __future__ import annotations

import os

# As every pdserve process runs (pdserve.cli): gRPC's C core quiet but for errors, in
# this process and the servers and workers tests start. Before anything imports grpc.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from support import MODEL_DIR  # noqa: E402


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny generated model (built once, deterministic from seed 0)."""
    from pdserve.tiny_model import ensure_tiny_model
    return ensure_tiny_model(MODEL_DIR)

