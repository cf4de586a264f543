"""Which points `pdserve plan profile` measures, on which engine: the sweep's spec.

The spec travels to the engine's own process as JSON (engine_sweep.py), so it holds
plain values only."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from pdserve.config import EngineConfig

FRACTIONS = (0.0, 0.5, 0.9)              # prompt shares already in the prefix cache
TOP_MARGIN = 16                          # the longest prompt leaves room for outputs
DECODE_TOKEN_BUDGET = 66 * 1024          # tokens of all the requests of one decode point


def _powers(lo: int, hi: int) -> list[int]:
    out, x = [], lo
    while x <= hi:
        out.append(x)
        x *= 2
    return out


def prompt_lengths(max_len: int, quick: bool) -> list[int]:
    """Prompt lengths doubling from 64 (128 when quick or past 2,048) up to `max_len`
    minus a margin, the top one included."""
    top = max_len - TOP_MARGIN
    lo = 128 if quick or max_len > 2048 else 64
    return [x for x in _powers(lo, top) if x < top] + [top]


def decode_contexts(max_len: int, block: int, quick: bool) -> list[int]:
    """Contexts of the decode points: whole blocks plus one token (so that a prompt
    prefilled before is all cached but its last token): 128, 512, then doubling (4x
    when quick) to the top."""
    top = (max_len - 4 * TOP_MARGIN) // block * block
    steps = [128, 512] if top > 512 else [128]
    while steps[-1] * (4 if quick else 2) < top:
        steps.append(steps[-1] * (4 if quick else 2))
    return [-(-c // block) * block + 1 for c in steps + [top]]


@dataclass(frozen=True)
class SweepSpec:
    """The engine to profile and the points to measure on it."""

    model: str
    device: str = "cpu"
    cpus: str = ""                      # the core(s) the engine runs on ("" = anywhere)
    max_model_len: int = 2048
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    quick: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.max_model_len < 256:
            raise ValueError(f"max_model_len must be >= 256, got {self.max_model_len}")
        self.engine_config()                      # its own ValueErrors name the field

    def engine_config(self) -> EngineConfig:
        """The worker's engine config for this sweep (device defaults for the rest)."""
        return EngineConfig(model=self.model, device=self.device,
                            max_model_len=self.max_model_len,
                            kv_cache_bytes=self.kv_cache_bytes, max_num_seqs=self.max_num_seqs,
                            seed=self.seed)

    @property
    def reps(self) -> int:
        """Prefills per point (their median is the point)."""
        return 2 if self.quick else 3

    @property
    def decode_steps(self) -> int:
        """Decode steps timed per point (their median is the point): cheap beside
        filling the batch, and steadier on a shared machine."""
        return 6 if self.quick else 12

    def block_size(self) -> int:
        return int(self.engine_config().block_size)

    def cached_tokens(self, tokens: int, fraction: float) -> int:
        """The prompt tokens the prefix cache can hold of `fraction`: whole blocks, and
        never the last token (the engine always computes one)."""
        block = self.block_size()
        return min(int(fraction * tokens) // block, (tokens - 1) // block) * block

    def prefill_points(self) -> list[tuple[int, float]]:
        """(prompt tokens, cached fraction) of every prefill point."""
        return [(n, f) for f in FRACTIONS for n in prompt_lengths(self.max_model_len, self.quick)]

    def decode_points(self, kv_tokens: int) -> list[tuple[int, int]]:
        """(batch, context) of every decode point whose requests fit the engine's KV
        (`kv_tokens`, with a tenth to spare) and the sweep's token budget."""
        batches = _powers(1, self.max_num_seqs)[::2 if self.quick else 1]
        if batches[-1] != self.max_num_seqs:
            batches.append(self.max_num_seqs)
        room = min(int(0.9 * kv_tokens), DECODE_TOKEN_BUDGET)
        return [(b, c) for b in batches for c in decode_contexts(self.max_model_len,
                                                                   self.block_size(), self.quick)
                if b * (c + 16) <= room or b == 1]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "SweepSpec":
        return cls(**d)
