"""The shared secret a worker shows when it joins a pool (Register, Deregister).

A router started with a token (`--cluster-token-file`, PDSERVE_CLUSTER_TOKEN_FILE:
a file, e.g. a mounted Secret) refuses a Register or Deregister without it with
UNAUTHENTICATED, so that a pod outside the release cannot join the pool or take a
worker out of it. The token travels in call metadata and is never logged.
"""
from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

METADATA_KEY = "x-pdserve-cluster-token"


def read_token(path: str) -> str:
    """The token in the file at `path` (surrounding whitespace dropped); "" for no path.
    ValueError for an empty file: a deployment that meant a token must not run open."""
    if not path:
        return ""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"cluster token file {path} is empty")
    return token


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """What a call carries to show `token` (nothing when there is none)."""
    return ((METADATA_KEY, token),) if token else ()


def shown(context, token: str) -> bool:
    """Whether the call behind `context` carries `token`; any call does when `token`
    is "" (no token configured)."""
    if not token:
        return True
    given = dict(context.invocation_metadata() or ()).get(METADATA_KEY, "")
    return hmac.compare_digest(given.encode(), token.encode())


def write_token(directory: str) -> str:
    """A new random token in a file only this user reads, under `directory`; its path."""
    path = Path(directory) / "cluster-token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    return str(path)
