"""API keys: who may use the edge, as which tenant, at which priority, within which limits.

The keys file (`--api-keys-file`, or `PDSERVE_API_KEYS_FILE`; e.g. a mounted
Kubernetes secret) has one key per line:

    KEY TENANT PRIORITY [rps=N] [tpm=N]

PRIORITY is `high`, `normal` or `low`; `rps` caps requests per second and
`tpm` tokens per minute (prompt + max output) for that key (absent: no cap).
`#` starts a comment. No file, or a file with no keys: the edge is open.

A presented key is found by its SHA-256 digest, so the lookup takes the same
time whatever the key shares with a real one; keys themselves are never kept
in memory after loading, nor logged — a key is named by its `key_id`, the
first 12 hex digits of its digest.

A stream's read token lets a client that cannot send headers (a browser's
EventSource) follow one stream: `GET /v1/streams/{id}?token=T`. It is
`KEY_ID.MAC`, MAC being an HMAC-SHA256 of the stream id under the key's
digest, so every replica that loads the same keys file verifies it without shared
state; it reads that stream only (cancelling still takes the key), and it ends
with the stream or the key.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

PRIORITIES = {"high": 0, "normal": 1, "low": 2}


class KeyError_(Exception):
    """The keys file is malformed (the message names the line, never the key)."""


@dataclass(frozen=True, slots=True)
class APIKey:
    key_id: str
    tenant: str
    priority: int                       # 0 = high
    rps: float | None = None
    tpm: float | None = None


OPEN = APIKey(key_id="", tenant="", priority=PRIORITIES["normal"])


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class KeyRing:
    """The configured keys, by digest."""

    def __init__(self, keys: dict[bytes, APIKey]):
        self._keys = keys
        self._digests = {key.key_id: digest for digest, key in keys.items()}

    @property
    def open(self) -> bool:
        return not self._keys

    @classmethod
    def load(cls, path: str | Path | None) -> "KeyRing":
        if not path:
            return cls({})
        keys: dict[bytes, APIKey] = {}
        for n, raw in enumerate(Path(path).read_text().splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) < 3 or fields[2] not in PRIORITIES:
                raise KeyError_(f"{path}:{n}: expected `KEY TENANT high|normal|low [rps=N] "
                                "[tpm=N]`")
            limits = {}
            for opt in fields[3:]:
                name, _, value = opt.partition("=")
                try:
                    limits[name] = float(value)
                except ValueError:
                    raise KeyError_(f"{path}:{n}: bad limit {name!r}") from None
                if name not in ("rps", "tpm") or limits[name] <= 0:
                    raise KeyError_(f"{path}:{n}: limits are rps=N and tpm=N, N > 0")
            digest = _digest(fields[0])
            if digest in keys:
                raise KeyError_(f"{path}:{n}: a key is listed twice")
            keys[digest] = APIKey(key_id=digest.hex()[:12], tenant=fields[1],
                                  priority=PRIORITIES[fields[2]], **limits)
        return cls(keys)

    def find(self, presented: str) -> APIKey | None:
        """The key `presented` is, or None. Open: everyone is OPEN."""
        if self.open:
            return OPEN
        # A lookup by digest: what the presented key shares with a real one
        # tells the comparison nothing (see the module docstring).
        return self._keys.get(_digest(presented))

    def from_header(self, authorization: str | None) -> APIKey | None:
        """The key an `Authorization: Bearer KEY` header carries, or None."""
        if self.open:
            return OPEN
        scheme, _, presented = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            return None
        return self.find(presented.strip())

    def stream_token(self, key: APIKey, stream_id: str) -> str | None:
        """The token that reads `key`'s stream `stream_id` (None when the edge is open)."""
        digest = self._digests.get(key.key_id)
        return None if digest is None else f"{key.key_id}.{_mac(digest, stream_id)}"

    def from_stream_token(self, token: str, stream_id: str) -> APIKey | None:
        """The key whose token for `stream_id` this is, or None."""
        key_id, _, mac = token.partition(".")
        digest = self._digests.get(key_id)
        if digest is None or not hmac.compare_digest(mac.encode(),
                                                     _mac(digest, stream_id).encode()):
            return None
        return self._keys[digest]


def _mac(digest: bytes, stream_id: str) -> str:
    mac = hmac.digest(digest, b"pdserve stream read\0" + stream_id.encode(), "sha256")
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
