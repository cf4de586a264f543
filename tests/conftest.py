"""Fixtures shared across the suite."""
from __future__ import annotations

from pathlib import Path

import pytest

from support import MODEL_DIR


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny generated model (built once, deterministic from seed 0)."""
    from pdserve.tiny_model import ensure_tiny_model
    return ensure_tiny_model(MODEL_DIR)

