"""Addresses of IPv4, IPv6 and named hosts, as gRPC targets and URLs take them."""
from __future__ import annotations

import pytest

from pdserve.netaddr import dialable, hostport, is_ipv6, loopback, split_hostport, unbracketed


@pytest.mark.parametrize("host,port,address", [
    ("127.0.0.1", 50051, "127.0.0.1:50051"),
    ("worker-0.pdserve", 50061, "worker-0.pdserve:50061"),
    ("::1", 50051, "[::1]:50051"),
    ("[::1]", 50051, "[::1]:50051"),            # already bracketed: not twice
    ("::", 8000, "[::]:8000"),
    ("fd00::2", "5600", "[fd00::2]:5600"),
    ("fe80::1%eth0", 80, "[fe80::1%eth0]:80"),
])
def test_hostport_brackets_ipv6_literals_only(host, port, address):
    assert hostport(host, port) == address


@pytest.mark.parametrize("address,parts", [
    ("127.0.0.1:50051", ("127.0.0.1", 50051)),
    ("worker-0:1", ("worker-0", 1)),
    ("[::1]:50051", ("::1", 50051)),
    ("[fd00::2]:5600", ("fd00::2", 5600)),
])
def test_split_hostport_inverts_hostport(address, parts):
    assert split_hostport(address) == parts
    assert hostport(*parts) == address


@pytest.mark.parametrize("address", ["::1:50051", "[::1]", "[::1]50051", "no-port", ":80",
                                     "host:", "host:http", "[]:80", "host:70000"])
def test_split_hostport_refuses_what_is_not_one_address(address):
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_hostport(address)


def test_the_family_of_a_host():
    assert [is_ipv6(h) for h in ("::1", "[::]", "10.0.0.7", "localhost", "")] == [
        True, True, False, False, False]
    assert unbracketed("[::1]") == "::1" and unbracketed("::1") == "::1"
    assert [loopback(h) for h in ("::", "fd00::2", "0.0.0.0", "edge.local")] == [
        "::1", "::1", "127.0.0.1", "127.0.0.1"]


def test_a_wildcard_is_dialled_on_loopback_of_its_family():
    assert [dialable(h) for h in ("0.0.0.0", "", "::", "[::]")] == [
        "127.0.0.1", "127.0.0.1", "::1", "::1"]
    assert [dialable(h) for h in ("::1", "[fd00::2]", "10.0.0.7")] == [
        "::1", "fd00::2", "10.0.0.7"]
