"""A cache salt that starts after a shared prefix, in vLLM's block hasher.

vLLM folds a request's `cache_salt` into its first block only
(`vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys`), so a salted
request shares nothing, not even an operator's common system prompt. pdserve's
shared form of the salt (pdserve/cache_salt.py) names a second salt and the token
where it starts: `install()` wraps vLLM's function so that block 0 carries the
group's salt (or none) and the block holding that token the request's own. Every
other salt is left to vLLM as it is. It runs as a vLLM general plugin (the
`vllm.general_plugins` entry point in pyproject.toml: vLLM loads it in each of its
processes, the engine core included, which its CPU platform starts by `spawn`),
and in the worker before its engine starts (an engine core it forks inherits it).
Where it is not installed (a stock vLLM, `VLLM_PLUGINS` leaving it out) the shared
form is an ordinary salt: isolated, unshared.

What vLLM lacks for this upstream: a salt per block range, e.g. `cache_salt`
accepting `[(start_token, salt), ...]` with `generate_block_hash_extra_keys`
folding each salt into the block its start falls in (a few lines there and in
the request's validation); the KV events already publish each block's extra keys.
"""
from __future__ import annotations

import importlib
import logging
from typing import Any

from pdserve.cache_salt import SHARED_TAG, plan

log = logging.getLogger(__name__)

# Modules that hold vLLM's function under its name (imported `from` kv_cache_utils).
_HOLDERS = ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.block_pool",
            "vllm.v1.simple_kv_offload.manager")
_NAME = "generate_block_hash_extra_keys"


def salted_extra_keys(original):
    """vLLM's extra-keys function, folding a shared-form salt at its two blocks."""

    def extra_keys(request, start_token_idx: int, end_token_idx: int, start_mm_idx: int):
        salt = getattr(request, "cache_salt", None)
        if not salt or not salt.startswith(SHARED_TAG):
            return original(request, start_token_idx, end_token_idx, start_mm_idx)
        keys, mm_idx = original(request, start_token_idx, end_token_idx, start_mm_idx)
        kept: list[Any] = [k for k in keys or () if not _is_salt(k)]
        block = end_token_idx - start_token_idx
        for index, part in plan(salt).folds(block):
            if start_token_idx == index * block:
                kept.append(("cache_salt", part))
        return (tuple(kept) if kept else None), mm_idx

    extra_keys.pdserve_wrapped = original
    return extra_keys


def _is_salt(key: Any) -> bool:
    return isinstance(key, tuple) and len(key) == 2 and key[0] == "cache_salt"


def install() -> bool:
    """Wrap vLLM's function wherever it is held (idempotent). False if vLLM has none."""
    try:
        utils = importlib.import_module(_HOLDERS[0])
    except ImportError:
        return False
    original = getattr(utils, _NAME, None)
    if original is None:
        log.warning("vLLM has no %s: shared prefixes stay isolated", _NAME)
        return False
    original = getattr(original, "pdserve_wrapped", original)
    wrapped = salted_extra_keys(original)
    for name in _HOLDERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, _NAME):
            setattr(module, _NAME, wrapped)
    return True
