"""The `kv_transfer_params` format: what a gateway asks of a prefill engine and a decode
engine, and what a prefill answers.

A prefill request carries `request_params_for_prefill()`. The prefill engine's
connector answers with params that name the blocks it keeps for a decoder (vLLM's
NIXL keys: `remote_block_ids`, `remote_request_id`, `remote_num_tokens`, ...), and
the prefill worker adds how long it holds them (`with_lease_seconds`). The decode
request carries that answer back with the prefill worker's address and, on a young
lease's first use, the fresh mark (`request_params_for_decode`). The engine protocol
moves them as JSON (`kv_transfer_params_json`: `encode`, `decode`).

This is the contract alone: the edge and the router import it and nothing else of
`transfer/`; the engine side (the connector in vLLM's engine process, the lease
claim, the worker) reads the same keys from here. It imports neither vLLM nor NIXL.
Keys it does not name pass through untouched: vLLM's connector owns them.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

# vLLM's NIXL connector's keys.
DO_REMOTE_DECODE = "do_remote_decode"          # a prefill: keep the blocks for a decoder
DO_REMOTE_PREFILL = "do_remote_prefill"        # a decode: pull the blocks named here
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_HOST = "remote_host"
REMOTE_PORT = "remote_port"
REMOTE_REQUEST_ID = "remote_request_id"        # the lease's id on the prefill engine
REMOTE_NUM_TOKENS = "remote_num_tokens"        # prompt tokens the prefill computed
REMOTE_PREFILL_CACHED_TOKENS = "remote_prefill_cached_tokens"

# pdserve's keys. The prefill worker's gRPC address, in a decode request: the decode
# worker claims the lease there before its engine pulls (transfer/claim.py).
PREFILL_ADDRESS = "pdserve_prefill_address"
# How long the prefill worker holds the lease after it answers (its
# `kv lease_seconds`), in the params it returns ...
LEASE_SECONDS = "pdserve_lease_seconds"
# ... so that a gateway forwarding them at once can say so: the first use of a
# lease, within its first lease minus a second, needs no claim (transfer/claim.py).
FRESH_LEASE = "pdserve_lease_fresh"
# A digest of the cache salt the prefill computed the blocks under (pdserve/cache_salt.py),
# in the params it returns: a decode worker pulls them only into a request of the same salt.
SALT_TAG = "pdserve_salt_tag"

# The gRPC health name under which a decode worker answers SERVING when it takes a
# decode request whose prompt goes on past the prefill's `remote_num_tokens` (the
# prefill's sampled token appended), for routers that probe workers instead of taking
# their registration (`WorkerInfo.continues_prefill`).
CONTINUES_PREFILL = "pdserve.v1.ContinuesPrefill"


class MalformedParams(ValueError):
    """`kv_transfer_params` that do not follow this format; the message names the key."""


def encode(params: dict[str, Any]) -> str:
    """Params as the engine protocol's `kv_transfer_params_json`."""
    return json.dumps(params)


def decode(text: str) -> dict[str, Any]:
    """`kv_transfer_params_json` as params; MalformedParams unless a JSON object."""
    try:
        params = json.loads(text)
    except ValueError as e:
        raise MalformedParams(f"kv_transfer_params is not JSON: {e}") from None
    if not isinstance(params, dict):
        raise MalformedParams(
            f"kv_transfer_params must be a JSON object, got {type(params).__name__}")
    return params


def request_params_for_prefill() -> dict[str, Any]:
    """Params for a prefill request: keep the blocks for a decoder."""
    return {DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False,
            REMOTE_ENGINE_ID: None, REMOTE_BLOCK_IDS: None,
            REMOTE_HOST: None, REMOTE_PORT: None}


def _count(value: Any) -> bool:
    """An int, and no bool (JSON's true would pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_prefill_answer(params: dict[str, Any]) -> dict[str, Any]:
    """`params` if a prefill's answer hands blocks over, else MalformedParams naming
    the key: blocks named, and the keys pdserve reads of the right types."""
    blocks = params.get(REMOTE_BLOCK_IDS)
    if not isinstance(blocks, list) or not blocks:
        raise MalformedParams(f"{REMOTE_BLOCK_IDS} must be a non-empty list: the prefill "
                              f"hands over no KV blocks (got {blocks!r})")
    lease = params.get(REMOTE_REQUEST_ID)
    if lease is not None and (not isinstance(lease, str) or not lease):
        raise MalformedParams(f"{REMOTE_REQUEST_ID} must be a non-empty string, got {lease!r}")
    computed = params.get(REMOTE_NUM_TOKENS)
    if computed is not None and not (_count(computed) and computed >= 0):
        raise MalformedParams(f"{REMOTE_NUM_TOKENS} must be a count, got {computed!r}")
    seconds = params.get(LEASE_SECONDS)
    if seconds is not None and (isinstance(seconds, bool)
                                or not isinstance(seconds, (int, float)) or seconds <= 0):
        raise MalformedParams(f"{LEASE_SECONDS} must be a positive number, got {seconds!r}")
    return params


def with_lease_seconds(prefill_params: dict[str, Any], seconds: float) -> dict[str, Any]:
    """A prefill's answer that says how long its worker holds the lease."""
    return {**prefill_params, LEASE_SECONDS: seconds}


def salt_tag(cache_salt: str) -> str:
    """The `SALT_TAG` of a salt ("" for none): a digest, so params never carry the salt."""
    if not cache_salt:
        return ""
    return hashlib.sha256(b"pdserve salt tag\0" + cache_salt.encode()).hexdigest()[:16]


def with_salt_tag(prefill_params: dict[str, Any], cache_salt: str) -> dict[str, Any]:
    """A prefill's answer that names the salt its blocks were computed under."""
    return {**prefill_params, SALT_TAG: salt_tag(cache_salt)}


def salt_mismatch(params: dict[str, Any], cache_salt: str) -> bool:
    """Whether a pull's blocks were computed under another salt than the request's (a
    prefill that names none, a stock worker's, is taken at its word)."""
    tag = params.get(SALT_TAG)
    return tag is not None and tag != salt_tag(cache_salt)


def request_params_for_decode(prefill_params: dict[str, Any],
                              prefill_address: str = "", fresh: bool = False) -> dict[str, Any]:
    """Params for the decode request that pulls the prefill's blocks; `fresh`: their
    first use, and `lease_is_fresh`."""
    params = dict(prefill_params)
    if prefill_address:
        params[PREFILL_ADDRESS] = prefill_address
    if fresh:
        params[FRESH_LEASE] = True
    # The decode engine then reports the pulled tokens as its own cache hits,
    # which is how callers see that the KV travelled.
    params.pop(REMOTE_PREFILL_CACHED_TOKENS, None)
    return params


def pulls_blocks(params: dict[str, Any]) -> bool:
    """Whether a request's params ask its engine to pull a prefill's blocks."""
    return bool(params.get(DO_REMOTE_PREFILL))


def keeps_blocks(params: dict[str, Any]) -> bool:
    """Whether a request's params ask its engine to keep the blocks for a decoder."""
    return bool(params.get(DO_REMOTE_DECODE))


def lease_id(params: dict[str, Any]) -> str | None:
    """The lease the params name on the prefill worker, or None."""
    lease = params.get(REMOTE_REQUEST_ID)
    return lease if isinstance(lease, str) and lease else None


def computed_tokens(params: dict[str, Any]) -> int | None:
    """How many prompt tokens the prefill computed (a decode pulls no more), or None
    when the params do not say."""
    computed = params.get(REMOTE_NUM_TOKENS)
    return computed if _count(computed) and computed > 0 else None


def lease_young(age_seconds: float, lease_seconds: float) -> bool:
    """A lease handed out this long ago cannot have expired yet (a second to spare for
    the answer's way to whoever holds it). The prefill worker's fast claim and the
    edge's fresh mark both go by it."""
    return age_seconds < lease_seconds - 1


def lease_is_fresh(prefill_params: dict[str, Any], age_seconds: float) -> bool:
    """Whether params the prefill answered `age_seconds` ago are still certainly held
    (for their first use: a lease is ended only by its expiry, a pull, or an Abort)."""
    lease = prefill_params.get(LEASE_SECONDS)
    return isinstance(lease, (int, float)) and lease_young(age_seconds, lease)
