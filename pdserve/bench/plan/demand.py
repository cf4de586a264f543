"""What the planner simulates a deployment serving: requests by their lengths, not their text.

A `Demand` is either independent requests (Poisson arrivals at the run's rate, drawn
exactly as vLLM's benchmark draws them, so a simulated run and a measured one with the
same seed see the same arrival times) or multi-turn sessions (sessions start Poisson;
a session's next turn is sent when its previous answer has streamed in, its prompt
the whole conversation so far), or a trace replayed at its own times. Every prompt
names the earlier content it starts with (`prefixes`), which is what an engine's
prefix cache can hold.

Trace files are JSONL, one request a line (docs/planning.md, "Workloads"):
    {"t": 0.12, "prompt": 900, "output": 40, "session": "u7",
     "shared": "sys-a", "shared_tokens": 400}
`t` is the arrival in seconds; within a session only the first turn's `t` counts, later
turns are sent when the previous answer is in. `shared`/`shared_tokens` name a shared
system prompt at the start of the prompt (optional).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class Turn:
    """One request: its prompt and output lengths and the earlier content its prompt
    starts with, as (content key, tokens) pairs."""

    prompt: int
    output: int
    prefixes: tuple[tuple[str, int], ...] = ()
    key: str = ""           # what this request's prompt + answer is cached as


@dataclass(frozen=True, slots=True)
class Demand:
    """A workload by lengths: `requests` (one turn each) or `sessions` (turns in order).

    `arrivals`, when set, are the trace's own start times (requests or sessions)."""

    name: str
    requests: list[Turn] = field(default_factory=list)
    sessions: list[list[Turn]] = field(default_factory=list)
    arrivals: list[float] | None = None

    def __post_init__(self) -> None:
        if bool(self.requests) == bool(self.sessions):
            raise ValueError(f"workload {self.name!r}: exactly one of requests and sessions")

    @property
    def units(self) -> int:
        """How many things arrive (requests, or sessions)."""
        return len(self.requests or self.sessions)

    @property
    def total_requests(self) -> int:
        return len(self.requests) or sum(len(s) for s in self.sessions)


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s) of `n` Poisson arrivals at `rate`, as vLLM's `get_request` draws them
    after `np.random.seed(seed)` (exponential gaps, rescaled to end at n / rate)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = np.random.RandomState(seed)
    gaps = [rng.gamma(shape=1.0, scale=1.0 / rate) for _ in range(n)]
    times = np.cumsum(gaps)
    return list(times * (n / rate) / times[-1]) if times[-1] else list(times)


def _spread(rng: random.Random, length: int, ratio: float) -> int:
    """A length uniform in length x (1 +- ratio), as vLLM's random dataset draws them."""
    lo, hi = int(length * (1 - ratio)), int(length * (1 + ratio))
    return max(1, rng.randint(lo, hi))


def long_prompts(n: int, seed: int) -> Demand:
    """Half 1,520-1,680-token prompts with 16 out, half ~128-token prompts decoding 64."""
    rng = random.Random(seed)
    longs = [Turn(_spread(rng, 1600, 0.05), _spread(rng, 16, 0.05)) for _ in range(n // 2)]
    shorts = [Turn(_spread(rng, 128, 0.1), _spread(rng, 64, 0.1)) for _ in range(n - n // 2)]
    mixed = longs + shorts
    rng.shuffle(mixed)
    return Demand("long_prompts", requests=mixed)


def short_chat(n: int, seed: int) -> Demand:
    """~128-token prompts, ~64 out."""
    rng = random.Random(seed)
    return Demand("short_chat", requests=[Turn(_spread(rng, 128, 0.1), _spread(rng, 64, 0.1))
                                          for _ in range(n)])


def chat_sessions(n: int, seed: int, turns: int = 4, first: int = 512, later: int = 64,
                  output: int = 32, system: int = 0, systems: int = 1,
                  name: str = "sessions") -> Demand:
    """`n` requests as n / turns conversations: the first turn `first` tokens (after a
    `system`-token system prompt, one of `systems` shared ones), each later turn adds
    `later` tokens to the conversation so far; every answer `output` tokens."""
    rng = random.Random(seed)
    convs = []
    for s in range(max(1, n // turns)):
        shared = (f"sys-{rng.randrange(systems)}", system) if system else None
        history, conv = 0, []
        for t in range(turns):
            new = _spread(rng, first if t == 0 else later, 0.1)
            out = _spread(rng, output, 0.1)
            prefixes = ([shared] if shared else []) + (
                [(f"s{s}-{t - 1}", history)] if t else [])
            prompt = history + new + (system if t == 0 else 0)
            conv.append(Turn(prompt, out, tuple(prefixes), key=f"s{s}-{t}"))
            history = prompt + out
        convs.append(conv)
    return Demand(name, sessions=convs)


def sessions(n: int, seed: int) -> Demand:
    """The benchmark's sessions: 4 turns, 512-token first turn, +64 per turn, 32 out."""
    return chat_sessions(n, seed)


def shared_sessions(n: int, seed: int) -> Demand:
    """4-turn sessions starting with one of 3 shared 400-token system prompts."""
    return chat_sessions(n, seed, first=150, later=30, output=16, system=400, systems=3,
                         name="shared_sessions")


def long_context(n: int, seed: int, tokens: int = 8192) -> Demand:
    """Half `tokens`-token prompts with 16 out, half 128-token prompts decoding 64."""
    d = long_prompts(n, seed)
    return Demand(f"long_context_{tokens}", requests=[
        Turn(int(t.prompt * tokens / 1600), t.output) if t.prompt > 1000 else t
        for t in d.requests])


BUILDERS = {"long_prompts": long_prompts, "short_chat": short_chat, "sessions": sessions,
            "shared_sessions": shared_sessions}


def _trace_turn(row: dict, line: int) -> Turn:
    try:
        prompt, output = int(row["prompt"]), int(row["output"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"trace line {line}: needs integer 'prompt' and 'output'") from e
    if prompt < 1 or output < 1:
        raise ValueError(f"trace line {line}: prompt and output must be >= 1")
    shared = ((f"sys-{row['shared']}", int(row.get("shared_tokens", 0))),) if row.get(
        "shared") else ()
    return Turn(prompt, output, shared)


def _chain(turns: list[Turn], sid: str) -> list[Turn]:
    """A session's turns, each starting with the conversation before it."""
    out, history = [], None
    for i, t in enumerate(turns):
        prefixes = t.prefixes + ((history,) if history else ())
        out.append(Turn(t.prompt, t.output, prefixes, key=f"{sid}-{i}"))
        history = (f"{sid}-{i}", min(t.prompt + t.output, turns[i + 1].prompt - 1)
                   if i + 1 < len(turns) else t.prompt + t.output)
    return out


def load_trace(path: Path) -> Demand:
    """A JSONL trace (module docstring): sessions if any line names one, else requests."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append((i, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"trace line {i}: not JSON ({e.msg})") from e
    if not rows:
        raise ValueError(f"trace {path} holds no requests")
    if not any("session" in r for _, r in rows):
        rows.sort(key=lambda r: float(r[1].get("t", 0)))
        return Demand(Path(path).stem, requests=[_trace_turn(r, i) for i, r in rows],
                      arrivals=[float(r.get("t", 0)) for _, r in rows])
    by: dict[str, list] = {}
    for i, r in rows:
        by.setdefault(str(r.get("session", f"line{i}")), []).append((float(r.get("t", 0)), i, r))
    convs = sorted(by.items(), key=lambda kv: min(x[0] for x in kv[1]))
    return Demand(Path(path).stem,
                  sessions=[_chain([_trace_turn(r, i) for _, i, r in sorted(v)], sid)
                            for sid, v in convs],
                  arrivals=[min(x[0] for x in v) for _, v in convs])
