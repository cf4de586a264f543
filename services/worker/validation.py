"""Checks a worker applies to every request before it reaches the engine.

The edge validates user input; these guard the gRPC surface itself, which
internal callers (and other gateways) reach directly. A failure is
INVALID_ARGUMENT, never a crash.
"""
from __future__ import annotations


def prompt_problem(token_ids, max_model_len: int, vocab_size: int) -> str | None:
    """Why a tokenized prompt cannot run, or None."""
    if not token_ids:
        return "prompt_token_ids is empty"
    if len(token_ids) >= max_model_len:
        return f"prompt has {len(token_ids)} tokens; the model's context is {max_model_len}"
    if max(token_ids) >= vocab_size:
        return f"token id {max(token_ids)} is outside the vocabulary ({vocab_size})"
    return None


def sampling_problem(max_tokens: int | None, temperature: float | None,
                     top_p: float) -> str | None:
    """Why sampling parameters cannot run, or None (None = left to the engine's default)."""
    if max_tokens == 0:
        return "sampling.max_tokens must be >= 1"
    if (temperature is not None and temperature < 0) or not 0 <= top_p <= 1:
        return "sampling temperature must be >= 0 and top_p in [0, 1]"
    return None
