"""One simulated vLLM engine: continuous batching with chunked prefill, over a profile.

Each step is scheduled the way vLLM v1's scheduler does it: the running requests first
(a decode takes 1 token of the step's `max_num_batched_tokens`, a prompt part-way
through its prefill takes what is left of it, up to the budget), then waiting requests
in arrival order while the budget and `max_num_seqs` allow. A step lasts the fixed per-step
cost (`fixed_step_ms`) plus its decodes' and its prefill chunks' costs beyond it; every request
in it that finished its prompt or decoded gets a token at the step's end.

A prompt's prefill costs `profile.prefill_ms(prompt, cached_fraction)`, where the cached
part is what this engine's prefix cache holds of the prompt's earlier content (whole
blocks, never the whole prompt: vLLM recomputes the last token), spread evenly over the
prompt's uncached tokens. An engine on several units (cores, GPUs) runs the variable
part of every step `speedup` times faster; the fixed part stays.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .profile import Profile


@dataclass(frozen=True, slots=True)
class Speed:
    """How much faster than the profiled engine the variable part of a step runs."""

    prefill: float = 1.0
    decode: float = 1.0

    def __post_init__(self) -> None:
        if self.prefill <= 0 or self.decode <= 0:
            raise ValueError(f"speedups must be > 0, got {self.prefill}, {self.decode}")


@dataclass(slots=True)
class Job:
    """One request on one engine."""

    rid: int
    prompt: int
    emit: int               # tokens this engine streams (0: prefill only, hand off)
    todo: int = 0           # prompt tokens still to compute
    ms_per_token: float = 0.0
    emitted: int = 0
    key: str = ""
    wait_steps: int = 0     # steps to sit out first (KV still arriving)

    @property
    def context(self) -> int:
        return self.prompt + self.emitted


@dataclass(slots=True)
class StepResult:
    """What one step did: its length and which jobs got a token or finished."""

    ms: float
    tokens: list[Job] = field(default_factory=list)      # streamed a token at the end
    prefilled: list[Job] = field(default_factory=list)   # prompt done, hand-off jobs
    finished: list[Job] = field(default_factory=list)


def fixed_step_ms(profile: Profile) -> float:
    """The per-step cost no token count changes: the prefill curve's intercept at zero
    tokens, at most a one-sequence decode step."""
    pts = sorted({int(p["tokens"]) for p in profile.prefill if not p["cached_fraction"]})
    cap = profile.decode_step_ms(1, profile.block_size)
    if len(pts) < 2:
        return cap
    t1, t2 = pts[0], pts[1]
    y1, y2 = profile.prefill_ms(t1), profile.prefill_ms(t2)
    return min(cap, max(0.0, y1 - t1 * (y2 - y1) / (t2 - t1)))


class EngineModel:
    """One engine's queue, running batch and prefix cache."""

    def __init__(self, profile: Profile, speed: Speed = Speed(), name: str = "",
                 slowdown: float = 1.0, serve: tuple[float, float] = (0.0, 0.0)):
        self.profile = profile
        self.speed = speed
        self.slowdown = slowdown        # whole steps: cores shared with other processes
        # the server's own output path, ms a step that streams and ms a streamed token
        self.serve_step_ms, self.serve_token_ms = serve
        self.name = name
        self.fixed = fixed_step_ms(profile)
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.cache: dict[str, int] = {}
        self.busy = False
        self._decode_memo: dict[tuple[int, int], float] = {}

    @property
    def load(self) -> int:
        """Requests queued or running here."""
        return len(self.waiting) + len(self.running)

    def cached_tokens(self, prompt: int, prefixes) -> int:
        """Prompt tokens this engine's cache holds: the longest earlier content it
        holds, whole blocks only, at least one token left to compute."""
        held = max((min(self.cache.get(k, 0), n) for k, n in prefixes), default=0)
        block = self.profile.block_size
        return min(held // block * block, (prompt - 1) // block * block)

    def admit(self, job: Job, prefixes=()) -> None:
        """Queue `job`; its prefill is priced now, against what the cache holds."""
        if job.todo:
            cached = self.cached_tokens(job.prompt, prefixes)
            job.todo = job.prompt - cached
            job.ms_per_token = self._prefill_var_ms(job.prompt, cached / job.prompt) / job.todo
        self.waiting.append(job)

    def _prefill_var_ms(self, prompt: int, cached_fraction: float) -> float:
        """A prefill's cost beyond the fixed step cost."""
        ms = self.profile.prefill_ms(prompt, cached_fraction)
        return max(0.0, ms - self.fixed) / self.speed.prefill

    def _decode_var_ms(self, batch: int, context: float) -> float:
        """A decode step's cost beyond the fixed step cost (the context to 1/8 block:
        interpolating every step would be most of the simulation's time)."""
        key = (batch, int(context * 8) // self.profile.block_size)
        if key not in self._decode_memo:
            ms = self.profile.decode_step_ms(batch, context)
            self._decode_memo[key] = max(0.0, ms - self.fixed) / self.speed.decode
        return self._decode_memo[key]

    def _schedule(self) -> tuple[list[tuple[Job, int]], list[Job]]:
        """(prefill chunks, decoding jobs) of the next step; admits waiting jobs."""
        budget = self.profile.max_num_batched_tokens
        chunks: list[tuple[Job, int]] = []
        decodes: list[Job] = []
        for job in self.running:
            if budget <= 0:
                break
            budget = self._take(job, budget, chunks, decodes)
        while self.waiting and budget > 0 and len(self.running) < self.profile.max_num_seqs:
            job = self.waiting.popleft()
            self.running.append(job)
            budget = self._take(job, budget, chunks, decodes)
        return chunks, decodes

    @staticmethod
    def _take(job: Job, budget: int, chunks: list, decodes: list) -> int:
        """Put `job`'s share of the step in `chunks` (a prefill chunk) or `decodes` (one
        token), unless it waits a step; the token budget left."""
        if job.wait_steps:
            job.wait_steps -= 1
        elif job.todo:
            chunks.append((job, min(job.todo, budget)))
            budget -= chunks[-1][1]
        else:
            decodes.append(job)
            budget -= 1
        return budget

    def step(self) -> StepResult | None:
        """Run one step (None: nothing to do)."""
        if not self.running and not self.waiting:
            return None
        chunks, decodes = self._schedule()
        prefill = sum(job.ms_per_token * n for job, n in chunks)
        decode = (self._decode_var_ms(len(decodes),
                                      sum(j.context for j in decodes) / len(decodes))
                  if decodes else 0.0)
        # NOTE: a step that only starts KV loads still costs the fixed part.
        out = StepResult(ms=(self.fixed + prefill + decode) * self.slowdown)
        for job, n in chunks:
            job.todo -= n
            if not job.todo:
                (out.prefilled if job.emit == 0 else out.tokens).append(job)
        out.tokens += decodes
        if streamed := len(out.tokens) + len(out.prefilled):
            out.ms += self.serve_step_ms + self.serve_token_ms * streamed
        for job in out.tokens:
            job.emitted += 1
        out.finished = [j for j in out.tokens if j.emitted >= j.emit] + out.prefilled
        for job in out.finished:
            self.running.remove(job)
            if job.key:
                self.cache[job.key] = job.prompt + job.emitted
        return out
