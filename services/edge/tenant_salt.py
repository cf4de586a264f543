"""Which requests may share KV blocks: a cache salt per tenant, and the prefixes an
operator declares shared.

A prompt that another tenant sent recently comes back faster (a prefix-cache hit
skips its prefill), so a shared cache lets one tenant probe what another sent.
Where there are API keys, each tenant's requests carry their own salt: an
HMAC-SHA256 of the tenant's name under the deployment's secret
(`--tenant-salt-file`), never derived from a key, the same on every edge that
loads the same secret. A client's own `cache_salt` (vLLM's extension) is combined
with its tenant's, never replacing it. With no keys the edge is open and a client's
`cache_salt` goes to the engine as it came, as vLLM's server does.

Shared prefixes (`--shared-prefixes-file`, JSON): a list of
`{"text": T}` or `{"system": T}` entries, each optionally with `"tenants": [names]`
(absent: every tenant). `text` is tokenized as a completion prompt would be;
`system` is a chat that opens with that system message. A request whose tokens
start with an entry's tokens (in whole KV blocks; the longest common run counts)
shares those blocks with the entry's tenants: the salt that follows is its own
(pdserve/cache_salt.py has the salt's form).
"""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pdserve.cache_salt import shared

MIN_SECRET_BYTES = 16


class SaltConfigError(ValueError):
    """The salt secret or the shared-prefix file is missing or malformed."""


def load_secret(path: str) -> bytes:
    """The deployment's salt secret (a file: e.g. a mounted Kubernetes Secret)."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise SaltConfigError(f"--tenant-salt-file {path}: {e.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise SaltConfigError(f"--tenant-salt-file {path}: the secret must be at least "
                              f"{MIN_SECRET_BYTES} bytes")
    return secret


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Token ids an operator declared shared, and by whom (None: every tenant)."""

    ids: tuple[int, ...]
    tenants: frozenset[str] | None

    def common(self, prompt: Sequence[int]) -> int:
        """How many leading tokens `prompt` has in common with this prefix."""
        n = 0
        for a, b in zip(self.ids, prompt):
            if a != b:
                break
            n += 1
        return n


def load_shared(path: str, encoder) -> tuple[SharedPrefix, ...]:
    """The shared-prefix file's entries, tokenized with the edge's `encoder`."""
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SaltConfigError(f"--shared-prefixes-file {path}: {e}") from None
    if not isinstance(entries, list):
        raise SaltConfigError(f"--shared-prefixes-file {path}: expected a JSON list")
    return tuple(_entry(path, i, e, encoder) for i, e in enumerate(entries))


def _entry(path: str, i: int, entry, encoder) -> SharedPrefix:
    where = f"--shared-prefixes-file {path}: entry {i}"
    if not isinstance(entry, dict) or len({"text", "system"} & entry.keys()) != 1 \
            or not set(entry) <= {"text", "system", "tenants"}:
        raise SaltConfigError(f"{where}: expected {{\"text\" or \"system\": T, "
                              "\"tenants\": [names]}")
    tenants = entry.get("tenants")
    if tenants is not None and not (isinstance(tenants, list) and tenants
                                    and all(isinstance(t, str) and t for t in tenants)):
        raise SaltConfigError(f"{where}: 'tenants' must be a non-empty list of names")
    text = entry.get("text", entry.get("system"))
    if not isinstance(text, str) or not text:
        raise SaltConfigError(f"{where}: the prefix must be a non-empty string")
    if "text" in entry:
        ids = encoder.encode_text(text)
    else:
        rendered = encoder.tokenizer.apply_chat_template(
            [{"role": "system", "content": text}], tokenize=False, add_generation_prompt=False)
        ids = encoder.tokenizer.encode(rendered, add_special_tokens=False)
    return SharedPrefix(tuple(ids), frozenset(tenants) if tenants else None)


def _mac(secret: bytes, *parts: str) -> str:
    return hmac.new(secret, "\0".join(parts).encode(), hashlib.sha256).hexdigest()[:32]


class TenantSalts:
    """Each request's cache salt, from its tenant, its own `cache_salt` and its prompt.
    `secret` None: the edge is open (no keys)."""

    def __init__(self, secret: bytes | None, prefixes: Sequence[SharedPrefix] = ()):
        self._secret = secret
        self._prefixes = tuple(prefixes)

    def salt(self, tenant: str, client_salt: str, prompt: Sequence[int]) -> str:
        """The salt the engines and the router see for this request."""
        if self._secret is None:
            return client_salt
        own = _mac(self._secret, "tenant", tenant)
        if client_salt:
            own = _mac(self._secret, "client", own, client_salt)
        best, group = 0, ""
        for p in self._prefixes:
            if p.tenants is None or tenant in p.tenants:
                n = p.common(prompt)
                if n > best:
                    # Salted still (every tenant's, or the group's): never shared with
                    # requests that do not come through this deployment's keys.
                    best = n
                    group = _mac(self._secret, "group", *sorted(p.tenants or ("*",)))
        return shared(best, group, own)


def tenant_salts(cfg, keys_open: bool, encoder) -> TenantSalts:
    """The edge's salts from its config: none when it is open (no keys)."""
    if keys_open:
        return TenantSalts(None)
    prefixes = load_shared(cfg.shared_prefixes_file, encoder) if cfg.shared_prefixes_file else ()
    return TenantSalts(load_secret(cfg.tenant_salt_file), prefixes)
