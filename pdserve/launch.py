"""Child processes, started and stopped one way for `pdserve up` (the supervisor), the
benchmark harness and the tests.

Each child runs in its own session, so that what it starts (a worker's engine processes)
can be found and stopped with it. Stopping is SIGTERM (to the child alone unless told to
signal its whole session: a pdserve worker drains its calls, then stops its own engine,
which a signal of its own would cut short), a grace, then SIGKILL of the session. A
child's output goes where asked: the parent's own streams, lines kept in memory and
readable while it runs, or a temporary file.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterable, Literal

Output = Literal["inherit", "lines", "file"]


class ChildFailed(RuntimeError):
    """A child exited, or did not get where it was waited for in time; the message ends
    with the tail of its output."""


class Child:
    """One process in its own session.

    `output`: "inherit" (the parent's stdout and stderr), "lines" (kept in `lines`, read by
    a thread) or "file" (a temporary file, removed by `close`). `signal_session`: SIGTERM
    goes to the child's whole session, not the child alone. `cores`: the CPU cores it may
    run on. `env` adds to this process's environment; a value None removes that name."""

    def __init__(self, cmd: list[str], env: dict[str, str | None] | None = None, *,
                 name: str = "", output: Output = "inherit", cwd: str | Path | None = None,
                 cores: Iterable[int] | None = None, signal_session: bool = False):
        self.name = name or cmd[0]
        self.signal_session = signal_session
        self.log: Path | None = None
        self._lines: list[str] = []
        self._terminated = False
        cores = set(cores) if cores else None
        streams: dict = {}
        if output == "lines":
            streams = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        elif output == "file":
            fd, path = tempfile.mkstemp(prefix=f"pdserve-{self.name}-", suffix=".log")
            self.log = Path(path)
            streams = dict(stdout=fd, stderr=subprocess.STDOUT)
        try:
            self.popen = subprocess.Popen(
                cmd, env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None},
                cwd=cwd, start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
                **streams)
        finally:
            if output == "file":
                os.close(streams["stdout"])
        if output == "lines":
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self._lines.append(line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def lines(self) -> list[str]:
        """What it has written so far, a line each (nothing when its output is inherited)."""
        if self.log is not None:
            return self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return self._lines

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.lines[-n:])

    def running(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        """SIGTERM, once: a second one cuts a pdserve process's drain short."""
        if self.running() and not self._terminated:
            self._terminated = True
            if self.signal_session:
                _signal_session(self.popen.pid, signal.SIGTERM)
            else:
                self.popen.send_signal(signal.SIGTERM)

    def kill_session(self) -> None:
        """SIGKILL whatever is left of its session (the child, or what it left behind)."""
        _signal_session(self.popen.pid, signal.SIGKILL)

    def stop(self, grace: float = 60, sweep: bool = False) -> int:
        """SIGTERM, wait up to `grace`; its exit code. Raises ChildFailed, once its session
        is killed, when it did not stop in time. `sweep`: kill the rest of its session
        even when it stopped in time."""
        late = stop_all([self], grace, sweep=sweep)
        if late:
            raise ChildFailed(late[0])
        return self.popen.returncode

    def close(self) -> None:
        """Remove its output file, if it has one."""
        if self.log is not None:
            self.log.unlink(missing_ok=True)

    def wait_for(self, text: str, timeout: float, since: int = 0,
                 fatal: str | None = None) -> None:
        """Block until a line (from line `since` on) contains `text`; raise ChildFailed
        with its output's tail otherwise, at once when a line contains `fatal` or it exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.lines[since:]
            if any(text in line for line in lines):
                return
            if (fatal and any(fatal in line for line in lines)) or not self.running():
                break
            time.sleep(0.2)
        raise ChildFailed(f"{self.name}: no {text!r} within {timeout}s "
                          f"(exit {self.popen.poll()}). Log tail:\n{self.tail()}")

    def wait_listening(self, port: int, timeout: float = 10) -> None:
        """Block until something accepts connections on 127.0.0.1:`port`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.running():
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise ChildFailed(f"{self.name}: nothing listens on :{port}. Log tail:\n"
                          + self.tail(30))

    def descendants(self) -> list[int]:
        """PIDs of every process it started, and they started, still there."""
        import psutil
        try:
            return [p.pid for p in psutil.Process(self.popen.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []


def _signal_session(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def stop_all(children: Iterable[Child], grace: float, sweep: bool = False) -> list[str]:
    """SIGTERM every child at once, then wait for each until `grace` has passed since:
    children that shut down slowly (a vLLM engine takes seconds) do so side by side. The
    session of one still running then is SIGKILLed, and with `sweep` that of every one
    (what an exited child left behind). Returns a line per child that was late."""
    children = list(children)
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace
    late = []
    for child in children:
        try:
            child.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            late.append(f"{child.name} did not stop within {grace:g}s of SIGTERM")
            child.kill_session()
        if sweep:
            child.kill_session()
        child.popen.wait()
    return late


def healthy(url: str) -> bool:
    """True when `url` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(urls: list[str], children: Iterable[Child], timeout: float,
                 label: str = "") -> None:
    """Block until every URL of `urls` answers 200; raise ChildFailed, with the children's
    output, when one of them exits first or the time runs out."""
    children = list(children)
    label = label or ", ".join(c.name for c in children)
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending:
        for child in children:
            if not child.running():
                raise ChildFailed(f"{label}: {child.name} exited ({child.popen.returncode}):\n"
                                  + child.tail(60))
        pending = [u for u in pending if not healthy(u)]
        if pending and time.monotonic() > deadline:
            raise ChildFailed(f"{label}: {pending} not healthy in {timeout:g}s:\n"
                              + "\n".join(c.tail(60) for c in children))
        if pending:
            time.sleep(0.2)


class Group:
    """Children started together and stopped together (a deployment under measurement),
    their output in temporary files, SIGTERM to each one's whole session."""

    def __init__(self, label: str, ready_s: float = 600, grace: float = 90):
        self.label, self.ready_s, self.grace = label, ready_s, grace
        self.children: list[Child] = []

    def start(self, cmd: list[str], env: dict[str, str] | None = None,
              cores: Iterable[int] | None = None, cwd: str | None = None) -> Child:
        child = Child(cmd, env, name=self.label, output="file", cwd=cwd, cores=cores,
                      signal_session=True)
        self.children.append(child)
        return child

    def wait_healthy(self, urls: list[str]) -> None:
        """Block until every URL answers 200, up to `ready_s` (see `wait_healthy`)."""
        wait_healthy(urls, self.children, self.ready_s, self.label)

    def pids(self) -> list[int]:
        return [c.pid for c in self.children]

    def stop(self) -> None:
        stop_all(self.children, self.grace, sweep=True)
        for child in self.children:
            child.close()
        self.children.clear()
