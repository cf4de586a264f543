"""The workloads `pdserve bench compare` runs, built from vLLM's random dataset.

A workload is either a list of independent requests (arrivals are Poisson at
the run's rate) or a list of multi-turn sessions (sessions arrive Poisson; a
session's next turn is sent when the previous answer has streamed in, with the
whole conversation so far as its prompt).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from vllm.benchmarks.datasets import RandomDataset, SampleRequest


@dataclass(frozen=True, slots=True)
class Session:
    """One conversation: the user's turns, sent one after another."""

    turns: list[SampleRequest]


@dataclass(frozen=True, slots=True)
class Workload:
    """What one run sends; exactly one of `requests` and `sessions` is non-empty."""

    name: str
    description: str
    requests: list[SampleRequest] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)


def _random(tokenizer, n: int, input_len: int, output_len: int, seed: int,
            tag: str, spread: float = 0.1) -> list[SampleRequest]:
    """`n` prompts of input_len ± spread tokens, output_len ± spread tokens."""
    return RandomDataset(random_seed=seed).sample(
        tokenizer, n, request_id_prefix=f"{tag}-", input_len=input_len,
        output_len=output_len, range_ratio=spread)


def long_prompts(tokenizer, n: int, seed: int) -> Workload:
    """Long prompts arriving among ongoing decodes: half the requests are 1,520-1,680-token
    prompts with 16 output tokens, half 128-token prompts that decode 64 tokens.
    Colocated, each long prefill stalls every decode in flight (ITL spikes);
    disaggregated, it runs on the prefill worker."""
    longs = _random(tokenizer, n // 2, 1600, 16, seed, "long", spread=0.05)
    shorts = _random(tokenizer, n - n // 2, 128, 64, seed + 1, "short")
    mixed = longs + shorts
    random.Random(seed).shuffle(mixed)
    return Workload("long_prompts", long_prompts.__doc__.split(":")[0], requests=mixed)


def short_chat(tokenizer, n: int, seed: int) -> Workload:
    """Short chat turns: 128-token prompts, 64 output tokens."""
    return Workload("short_chat", "short chat turns (128 in, 64 out)",
                    requests=_random(tokenizer, n, 128, 64, seed, "chat"))


def random_1024(tokenizer, n: int, seed: int) -> Workload:
    """The issue's first measurement: 1,024-token prompts, 64 output tokens."""
    return Workload("random_1024", "random 1,024-token prompts, 64 out",
                    requests=_random(tokenizer, n, 1024, 64, seed, "r1024"))


def sessions(tokenizer, n: int, seed: int, turns: int = 4) -> Workload:
    """Multi-turn sessions: `n` requests as n/turns conversations of `turns` turns;
    the first turn carries a 512-token context, each later turn adds 64 tokens of
    user text to the conversation so far; every answer is 32 tokens."""
    n_sessions = max(1, n // turns)
    firsts = _random(tokenizer, n_sessions, 512, 32, seed, "s0")
    laters = _random(tokenizer, n_sessions * (turns - 1), 64, 32, seed + 1, "sN")
    convs = [Session([firsts[i], *laters[i * (turns - 1):(i + 1) * (turns - 1)]])
             for i in range(n_sessions)]
    return Workload("sessions", f"{turns}-turn sessions (512-token context, +64 per turn, "
                    "32 out)", sessions=convs)


BUILDERS = {"long_prompts": long_prompts, "short_chat": short_chat,
            "sessions": sessions, "random_1024": random_1024}
