"""Each Generate call's cache salt, from the edge's metadata to vLLM's prompt.

vLLM's engine protocol has no salt field, so the edge sends it as gRPC metadata
(pdserve/cache_salt.py); `SaltedEngine` stands for the engine in vLLM's servicer and
puts the salt of the call it runs in into the prompt it hands the engine, where
vLLM folds it into the block hashes (services/worker/salted_blocks.py for the
shared form).
"""
from __future__ import annotations

import contextvars
from typing import Any

from pdserve.cache_salt import MAX_SALT_BYTES, METADATA_KEY

CURRENT: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_cache_salt", default="")


def salt_of(metadata) -> tuple[str, str | None]:
    """(the call's salt, "" for none; a problem for INVALID_ARGUMENT, or None)."""
    salt = dict(metadata or ()).get(METADATA_KEY, "")
    if not isinstance(salt, str) or len(salt.encode()) > MAX_SALT_BYTES:
        return "", f"{METADATA_KEY} must be text of at most {MAX_SALT_BYTES} bytes"
    return salt, None


class SaltedEngine:
    """vLLM's `AsyncLLM` as the servicer sees it: the same, but `generate` salts the
    prompt with the salt of the call it runs in (`CURRENT`)."""

    def __init__(self, llm: Any):
        self._llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def generate(self, prompt, *args, **kwargs):
        salt = CURRENT.get()
        if salt and isinstance(prompt, dict):
            # A salt the servicer set already (an image's identity) stays in it.
            mine = prompt.get("cache_salt")
            prompt = {**prompt, "cache_salt": f"{salt}|{mine}" if mine else salt}
        return self._llm.generate(prompt, *args, **kwargs)
