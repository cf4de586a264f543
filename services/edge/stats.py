"""What one generation's record says: how it was placed, where its KV came from, its
token timings and its moves. The app reads it once the generation is over, for
metrics, the trace and the log line; the pieces of the token path write it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Placed:
    """What placing a leg found (Orchestrator.place): the router's decision, and the
    prefill worker that served it, if one did."""

    placement: str                      # the kind of the router's reason (a metric label)
    reason: str                         # the router's reason, "kind: detail"
    cached_tokens: int = 0              # prompt tokens the router expected cached there
    prefill_worker: str = ""            # "": prefilled on the decode worker
    prefill_cached_tokens: int = 0      # prefix hit on the prefill worker
    prefill_ms: float = 0.0
    prefill_failovers: int = 0          # prefill legs retried on another worker
    prefill_fallback: bool = False      # every prefill failed: the decode worker prefilled


@dataclass(slots=True)
class GenerationStats:
    """One generation's record, from its placement to its last token."""

    placed: Placed                      # the first leg's placement
    path: str                           # "disaggregated" | "local": where the prompt ran
    pull_refused: bool = False          # the decode worker prefilled after all
    prefill_first_token: bool = False   # the client's first token was the prefill's
    decode_cached_tokens: int = 0       # prompt tokens cached where the first decode ran
    decode_external_tokens: int = 0     # ...of those, pulled from the prefill worker
    first_token_at: float | None = None     # perf_counter() when the first token arrived
    token_gaps: list[float] = field(default_factory=list)   # s between consecutive outputs
    migrations: list[float] = field(default_factory=list)   # ms from failure to next leg
    preemptions: list[float] = field(default_factory=list)  # ms paused, each time

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV was cached where the prompt was computed: the prefill
        worker's prefix hit, or the decode worker's when it prefilled locally."""
        if self.decode_external_tokens:
            return self.placed.prefill_cached_tokens
        return self.decode_cached_tokens
