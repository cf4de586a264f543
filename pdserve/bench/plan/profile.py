"""An engine profile: what `pdserve plan profile` measures and the planner simulates from.

A profile is JSON (docs/planning.md): measured points, never a fitted formula, so that
what was measured stays visible. Between points the planner interpolates linearly;
beyond the last point it extrapolates from the last two (prefill grows with the
prompt, a decode step with the batch and the context).

    {"format": "pdserve-profile/1", "model": ..., "device": "cpu", "units_per_engine": 1,
     "block_size": 128, "max_num_batched_tokens": 2048, "max_num_seqs": 64,
     "max_model_len": 2048, "transport": "ucx/tcp", "command": ..., "commit": ...,
     "prefill":  [{"tokens": 128, "cached_fraction": 0.0, "ms": 9.1}, ...],
     "decode":   [{"batch": 1, "context": 256, "step_ms": 4.2}, ...],
     "transfer": [{"tokens": 1024, "ms": 3.0}, ...],
     "overheads": {"edge_request_ms": 1.1, "edge_token_ms": 0.02, "router_request_ms": 0.3},
     "enable_chunked_prefill": true, "sweep": {"total_s": 240, ...}}
"""
from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT = "pdserve-profile/1"


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs ascending, distinct), extrapolated from the
    end segments, never below 0."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _grid(points: list[dict], row: str, col: str, value: str) -> dict[float, tuple]:
    """{row value: (sorted col values, their values)}."""
    rows: dict[float, dict[float, float]] = {}
    for p in points:
        rows.setdefault(float(p[row]), {})[float(p[col])] = float(p[value])
    return {r: (sorted(c), [c[k] for k in sorted(c)]) for r, c in rows.items()}


def _interp2(grid: dict[float, tuple], r: float, c: float) -> float:
    """Bilinear over a grid of rows (each its own column points)."""
    keys = sorted(grid)
    at = [_interp(*grid[k], c) for k in keys]
    return _interp(keys, at, r) if len(keys) > 1 else at[0]


@dataclass(frozen=True)
class Overheads:
    """What the edge and the router add, per request and per streamed token."""

    edge_request_ms: float = 0.0
    edge_token_ms: float = 0.0
    router_request_ms: float = 0.0


@dataclass(frozen=True)
class Profile:
    """One engine's measured costs on one device."""

    model: str
    device: str
    prefill: list[dict]
    decode: list[dict]
    transfer: list[dict]
    overheads: Overheads = field(default_factory=Overheads)
    units_per_engine: int = 1
    block_size: int = 128
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048
    transport: str = ""
    command: str = ""
    commit: str = ""
    # Optional: whether a long prompt's prefill ran in chunks of max_num_batched_tokens
    # (the prefill points include every chunk), and how the sweep ran (its seconds,
    # the engine's KV capacity in tokens, the machine's load average).
    enable_chunked_prefill: bool = True
    sweep: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "transfer"):
            if not getattr(self, name):
                raise ValueError(f"profile has no {name} points")
        object.__setattr__(self, "_prefill", _grid(self.prefill, "cached_fraction", "tokens", "ms"))
        object.__setattr__(self, "_decode", _grid(self.decode, "batch", "context", "step_ms"))
        xfer = sorted((float(p["tokens"]), float(p["ms"])) for p in self.transfer)
        object.__setattr__(self, "_transfer", ([x for x, _ in xfer], [y for _, y in xfer]))

    def prefill_ms(self, tokens: int, cached_fraction: float = 0.0) -> float:
        """One prefill of `tokens` prompt tokens, `cached_fraction` of them already cached."""
        return _interp2(self._prefill, cached_fraction, tokens)

    def decode_step_ms(self, batch: int, context: float) -> float:
        """One decode step of `batch` sequences whose mean context is `context` tokens."""
        return _interp2(self._decode, batch, context)

    def transfer_ms(self, tokens: int) -> float:
        """Moving the KV of `tokens` prompt tokens from a prefill to a decode engine."""
        return _interp(*self._transfer, tokens)

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        return {"format": FORMAT, **d}

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, d: dict) -> "Profile":
        if d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} profile (format {d.get('format')!r})")
        fields = {k: v for k, v in d.items() if k != "format"}
        fields["overheads"] = Overheads(**fields.get("overheads", {}))
        return cls(**fields)

    @classmethod
    def load(cls, path: Path) -> "Profile":
        return cls.from_json(json.loads(Path(path).read_text()))
