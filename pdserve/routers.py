"""Where the router replicas are: one `--router` value for workers and edges alike.

A value is one HOST:PORT (a single router, or a Service in front of several), a
comma-separated list of them, or `dns:///NAME:PORT`: every address NAME resolves to,
looked up again as replicas come and go (a headless Service's pods). A worker
registers with, and heartbeats to, every replica the value names, so that each
holds the whole pool; an edge dials them as one gRPC channel that keeps to one
replica and moves to another when it goes away (pick_first over the list).
"""
from __future__ import annotations

import asyncio
import socket

from pdserve.netaddr import hostport, is_ipv6, split_hostport

DNS = "dns:///"


def parts(spec: str) -> list[str]:
    """The entries of a `--router` value; ValueError for an empty one or a bad entry."""
    entries = [p.strip() for p in spec.split(",") if p.strip()]
    if not entries:
        raise ValueError(f"--router names no router: {spec!r}")
    for entry in entries:
        split_hostport(entry[len(DNS):] if entry.startswith(DNS) else entry)
    return entries


def is_dynamic(spec: str) -> bool:
    """Whether the replicas `spec` names can change (a name looked up again)."""
    return any(p.startswith(DNS) for p in parts(spec))


async def addresses(spec: str) -> list[str]:
    """Every router address `spec` names now, names resolved (without blocking the
    loop); in the order given, each once."""
    out: list[str] = []
    loop = asyncio.get_running_loop()
    for entry in parts(spec):
        if not entry.startswith(DNS):
            found = [entry]
        else:
            host, port = split_hostport(entry[len(DNS):])
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            found = sorted({hostport(info[4][0], port) for info in infos})
        out += [a for a in found if a not in out]
    return out


def channel_target(spec: str) -> str:
    """The gRPC target an edge dials for `spec`: unchanged for one entry (gRPC resolves
    a name or a dns:/// target itself); for a list, gRPC's ipv4:/ipv6: form, which
    takes IP literals only."""
    entries = parts(spec)
    if len(entries) == 1:
        return entries[0]
    hosts = [split_hostport(e)[0] for e in entries if not e.startswith(DNS)]
    if len(hosts) < len(entries) or not all(_is_ip(h) for h in hosts):
        raise ValueError(f"a --router list takes IP:PORT entries only (use one dns:///NAME:PORT "
                         f"for names), got {spec!r}")
    family = {is_ipv6(h) for h in hosts}
    if len(family) > 1:
        raise ValueError(f"a --router list must be one address family, got {spec!r}")
    return ("ipv6:" if family == {True} else "ipv4:") + ",".join(entries)


def _is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if is_ipv6(host) else socket.AF_INET, host)
        return True
    except OSError:
        return False
