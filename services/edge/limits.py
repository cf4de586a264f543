"""Per-key rate limits: token buckets on requests per second and tokens per minute.

A request costs one request and `prompt tokens + max output tokens` tokens,
as OpenAI counts them. Past a limit: 429 with `Retry-After` (seconds until the
bucket holds enough) and OpenAI's `x-ratelimit-*` headers, which also go out
on every admitted response of a limited key.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from .keys import APIKey
from .openai_protocol import APIError


@dataclass(slots=True)
class Bucket:
    """Holds up to `capacity`, refills at `rate` per second."""

    capacity: float
    rate: float
    level: float = -1.0
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.level < 0:
            self.level = self.capacity

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is there (0: now; inf: never, over capacity)."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate)

    def reset_in(self) -> float:
        return (self.capacity - self.level) / self.rate


def _duration(seconds: float) -> str:
    """OpenAI's reset format: `1s`, `6m0s`, `20ms`."""
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    minutes, secs = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


class RateLimits:
    """The buckets of every limited key, made on first use."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._buckets: dict[str, tuple[Bucket | None, Bucket | None]] = {}

    def _of(self, key: APIKey) -> tuple[Bucket | None, Bucket | None]:
        if key.key_id not in self._buckets:
            now = self.clock()
            self._buckets[key.key_id] = (
                Bucket(max(1.0, key.rps), key.rps, updated=now) if key.rps else None,
                Bucket(key.tpm, key.tpm / 60, updated=now) if key.tpm else None)
        return self._buckets[key.key_id]

    def take(self, key: APIKey, tokens: int) -> dict[str, str]:
        """Charge one request of `tokens` to the key; returns the x-ratelimit headers,
        or raises a 429 APIError carrying them."""
        requests, budget = self._of(key)
        if requests is None and budget is None:
            return {}
        now = self.clock()
        wait, which = 0.0, ""
        for bucket, amount, name in ((requests, 1, "requests"), (budget, tokens, "tokens")):
            if bucket is not None:
                bucket.refill(now)
                need = bucket.wait_for(amount)
                if need > wait:
                    wait, which = need, name
        headers = self._headers(requests, budget)
        if which:
            if math.isinf(wait):
                raise APIError(429, f"this request needs {tokens} tokens, more than the key's "
                               f"limit of {budget.capacity:.0f} per minute", type="tokens",
                               code="rate_limit_exceeded", headers=headers)
            headers["Retry-After"] = str(max(1, math.ceil(wait)))
            raise APIError(429, f"rate limit reached for {which} on this key; retry in "
                           f"{_duration(wait)}", type=which, code="rate_limit_exceeded",
                           headers=headers)
        if requests is not None:
            requests.level -= 1
        if budget is not None:
            budget.level -= tokens
        return self._headers(requests, budget)

    @staticmethod
    def _headers(requests: Bucket | None, budget: Bucket | None) -> dict[str, str]:
        out = {}
        for bucket, name in ((requests, "requests"), (budget, "tokens")):
            if bucket is not None:
                out[f"x-ratelimit-limit-{name}"] = str(int(bucket.capacity))
                out[f"x-ratelimit-remaining-{name}"] = str(max(0, int(bucket.level)))
                out[f"x-ratelimit-reset-{name}"] = _duration(bucket.reset_in())
        return out
