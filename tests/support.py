"""Helpers for tests that run real processes: free ports, child processes with logs,
raw HTTP exchanges."""
from __future__ import annotations

import contextlib
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve import launch
from pdserve.bench.deployments import free_port, free_port_run, metric_sum  # noqa: F401 (one source)
from pdserve.launch import Child, ChildFailed
from pdserve.netaddr import split_hostport

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "tiny-llama"


def ipv6_loopback() -> bool:
    """Whether this machine can listen on ::1 (a container may have no IPv6 at all)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@dataclass
class RawAnswer:
    version: str                        # as the server wrote it: "HTTP/1.1"
    status: int
    headers: dict[str, str]             # names lower-cased
    body: bytes


def raw_exchange(url: str, data: bytes, timeout: float = 5) -> RawAnswer | None:
    """Send bytes as they are on a fresh connection to `url` (http://host:port); the
    answer's status line, headers and (Content-Length) body, or None when the server
    closed the connection without one or is still waiting for the rest. Parsed by
    hand: aiohttp answers in the request's HTTP version ("HTTP/2.0 400"), which
    http.client refuses."""
    got = b""
    with socket.create_connection(split_hostport(url.removeprefix("http://")),
                                  timeout=timeout) as sock:
        sock.sendall(data)
        try:
            while b"\r\n\r\n" not in got:
                chunk = sock.recv(65536)
                if not chunk:
                    return None
                got += chunk
            head, body = got.split(b"\r\n\r\n", 1)
            status_line, *fields = head.decode("latin-1").split("\r\n")
            version, status = re.fullmatch(r"(HTTP/\S+) (\d{3}) .*", status_line).groups()
            headers = {k.strip().lower(): v.strip() for k, v in (f.split(":", 1) for f in fields)}
            length = int(headers.get("content-length", 0))
            while len(body) < length:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                body += chunk
        except (ConnectionResetError, TimeoutError):
            return None
    return RawAnswer(version, int(status), headers, body[:length])


@contextlib.contextmanager
def _as_test_failure():
    """A child that failed a wait fails the test as an assert does (AssertionError, which
    some callers catch to retry)."""
    try:
        yield
    except ChildFailed as e:
        raise AssertionError(str(e)) from None


class Proc(Child):
    """A child process run from the repository's root, its output kept as lines readable
    while it runs (pdserve.launch.Child); a wait that fails raises AssertionError."""

    def __init__(self, cmd: list[str], env: dict | None = None, name: str = ""):
        super().__init__(cmd, env, name=name, output="lines", cwd=ROOT)

    def wait_for(self, text: str, timeout: float, since: int = 0,
                 fatal: str | None = None) -> None:
        with _as_test_failure():
            super().wait_for(text, timeout, since, fatal)

    def wait_listening(self, port: int, timeout: float = 10) -> None:
        with _as_test_failure():
            super().wait_listening(port, timeout)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, wait; SIGKILL the session if it does not stop (and fail). Returns the
        exit code. What it leaves behind when it stops in time is left, for a test to see."""
        with _as_test_failure():
            return super().stop(grace=timeout)


def stop_all(procs: list[Proc], timeout: float = 60) -> None:
    """SIGTERM every one at once, then wait for each (as Proc.stop): processes that
    shut down slowly (a vLLM engine takes seconds) do so side by side."""
    late = launch.stop_all(procs, timeout)
    assert not late, "; ".join(late)


def c_part(part: str):
    """The C module of a native part (pdserve.native), for a test of its C path: one
    not built fails the test under PDSERVE_NATIVE=require (`make test`), and is
    skipped, saying why, otherwise."""
    import pytest

    from pdserve import native
    try:
        return native.c_module(part)
    except native.NativeMissing as e:
        if native.mode() == "require":
            raise
        pytest.skip(str(e))


def pdserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", *args]


def up_cmd(ports: dict[str, int], model_dir, kv: int, metrics: int, *flags: str) -> list[str]:
    """`pdserve up` on `ports` (edge, grpc, router, prefill, decode: the first of each
    pool), its workers' NIXL side channels and metrics counting up from `kv` and
    `metrics`, with `flags` more."""
    return pdserve_cmd("up", "--port", str(ports["edge"]), "--grpc-port", str(ports["grpc"]),
                       "--router-port", str(ports["router"]),
                       "--prefill-port", str(ports["prefill"]),
                       "--decode-port", str(ports["decode"]), "--kv-port", str(kv),
                       "--model", str(model_dir), "--worker-metrics-port", str(metrics), *flags)


# The request header that asks a POST /v1/completions or /v1/chat/completions for the
# resumable SSE framing (`id:` per event, `retry:`, keepalive comments); without it the
# edge answers in OpenAI's plain framing (`data:` lines only; services/edge/sse.py).
RESUMABLE = {"x-pdserve-sse": "resumable"}


def parse_sse(raw: str) -> list[tuple[int | None, str]]:
    """(id, data) per event; comments and retry lines skipped. Plain framing: id None
    (the n-th data line is event n)."""
    events = []
    for block in raw.split("\n\n"):
        ident, data = None, None
        for line in block.split("\n"):
            if line.startswith("id: "):
                ident = int(line[4:])
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            events.append((ident, data))
    return events


def sse_data(raw: str) -> list[str]:
    """The data of each event, whichever the framing."""
    return [data for _, data in parse_sse(raw)]


async def assert_logged_in_order(http, base_url: str, sid: str,
                                  events: list[tuple[int | None, str]]) -> None:
    """`events`, read in OpenAI's plain framing (no ids), are the stream log's events
    each once and in order: the n-th data line is event n of the numbered replay
    (`GET /v1/streams/{sid}`), as a plain client that resumes relies on."""
    assert [i for i, _ in events] == [None] * len(events)
    async with http.get(f"{base_url}/v1/streams/{sid}") as r:
        assert r.status == 200, await r.text()
        replay = parse_sse(await r.text())
    assert replay == [(n, data) for n, (_, data) in enumerate(events, 1)]


def alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running (a zombie has ended)."""
    import psutil
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def http_status(url: str) -> int:
    """GET's status code; 0 while nothing listens (yet)."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def wait_http(url: str, proc: Proc, timeout: float) -> None:
    """Block until GET `url` is 200; fail with `proc`'s log tail when it exits or the
    time runs out."""
    with _as_test_failure():
        launch.wait_healthy([url], [proc], timeout)
