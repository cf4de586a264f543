"""Benchmark clients written elsewhere, run unmodified as subprocesses from their own
virtualenvs (`make bench-clients` puts them under .venv-clients/): one module per tool, each
turning a `Shape` into the tool's command line and the tool's own result files into
`Figures`. Nothing here imports the tools; only their files are read."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CLIENTS = ROOT / ".venv-clients"
# The tokenizer is the model's directory: no tool may reach for a hub.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True, slots=True)
class Shape:
    """The workload every client sends: `requests` streamed text completions of exactly
    `prompt_tokens` tokens in and `output_tokens` out (EOS ignored), arriving at `rate`
    per second, `arrival` "poisson" or "constant" (evenly spaced)."""

    prompt_tokens: int = 1024
    output_tokens: int = 64
    requests: int = 40
    rate: float = 2.0
    seed: int = 0
    arrival: str = "poisson"

    def __post_init__(self) -> None:
        if self.arrival not in ("poisson", "constant"):
            raise ValueError(f"arrival must be 'poisson' or 'constant', got {self.arrival!r}")
        for name in ("prompt_tokens", "output_tokens", "requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.output_tokens < 2:
            raise ValueError("output_tokens must be >= 2 (no gap between tokens otherwise)")
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")


@dataclass(frozen=True, slots=True)
class Figures:
    """One run's figures as its tool reported them (ms; throughput per second). `itl` is
    the gap between streamed chunks, pooled over requests (vLLM's ITL; None where the
    tool reports no such figure); `tpot` is per request, (last token - first token) /
    (tokens - 1) (vLLM's TPOT, which guidellm and aiperf call inter-token latency).
    `names`: the tool's own name of each figure."""

    completed: int
    failed: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    tpot_p50_ms: float
    tpot_p99_ms: float
    request_throughput: float
    output_token_throughput: float
    names: dict[str, str]


def executable(venv: str, name: str) -> Path:
    """A console script of a client's venv."""
    return CLIENTS / venv / "bin" / name


def environment(**extra: str) -> dict[str, str]:
    """The parent's environment, offline, plus `extra`."""
    return {**os.environ, **OFFLINE, **extra}
