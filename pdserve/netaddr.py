"""Host and port as one address string, for IPv4, IPv6 and names alike.

A gRPC target or a URL needs an IPv6 literal in brackets ("[::1]:50051",
"http://[::1]:8000"); a socket's bind takes it bare ("::1"). A host with a colon
is an IPv6 literal: neither a name nor an IPv4 address has one.
"""
from __future__ import annotations

# Hosts that mean every address: a process on this machine reaches them on loopback.
_WILDCARDS = ("", "0.0.0.0", "::")


def unbracketed(host: str) -> str:
    """`host` as a socket binds it: "[::1]" -> "::1"; others unchanged."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_ipv6(host: str) -> bool:
    """Whether `host` (bare or bracketed) is an IPv6 literal."""
    return ":" in unbracketed(host)


def hostport(host: str, port: int | str) -> str:
    """"HOST:PORT" as gRPC and URLs take it: an IPv6 literal bracketed once."""
    bare = unbracketed(host)
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def split_hostport(address: str) -> tuple[str, int]:
    """"HOST:PORT" or "[IPV6]:PORT" -> (bare host, port). Raises ValueError for anything
    else, an IPv6 literal without brackets included (where would its port begin?)."""
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
    else:
        host, sep, port = address.rpartition(":")
        if ":" in host:
            sep = ""
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT or [IPV6]:PORT, got {address!r}")
    return host, int(port)


def loopback(host: str) -> str:
    """This machine's loopback address in the family of `host`."""
    return "::1" if is_ipv6(host) else "127.0.0.1"


def dialable(host: str) -> str:
    """Where a process on this machine reaches a server bound to `host` (bare)."""
    bare = unbracketed(host)
    return loopback(bare) if bare in _WILDCARDS else bare
