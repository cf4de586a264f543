"""The processes `pdserve bench edge` measures, each started when asked and stopped by
`stop()`: the synthetic source (gRPC and HTTP faces), nginx in a temporary prefix, the floor
relay, and pdserve's edge with its router (or the router inside it)."""
from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

from .deployments import free_port, processes

NGINX = "/usr/sbin/nginx"


class Deployment:
    """The source, nginx and the edge stack, each started when asked, all stopped by stop()."""

    def __init__(self, model: str, rate: float, tmp: Path):
        self.model, self.rate, self.tmp = model, rate, tmp
        self._children = processes
        self.source = self.nginx = self.floor = None
        self.edges: dict[str, tuple] = {}       # path name -> (router, edge) processes
        self.ports: dict[str, int] = {}

    def start_source(self) -> None:
        self.ports |= {"grpc": free_port(), "http": free_port()}
        self.source = self._children("edge-source")
        self.source.start([sys.executable, "-m", "pdserve.bench.synthetic", "--model",
                           self.model, "--port", str(self.ports["grpc"]), "--http-port",
                           str(self.ports["http"]), "--rate", str(self.rate)], {})
        self.source.wait_healthy([f"http://127.0.0.1:{self.ports['http']}/health"])

    def start_nginx(self, nofile: int, workers: int) -> None:
        port = self.ports["nginx"] = free_port()
        prefix = self.tmp / "nginx"
        prefix.mkdir(exist_ok=True)
        conf = prefix / "nginx.conf"
        conf.write_text(nginx_conf(prefix, port, self.ports["http"], nofile, workers))
        self.nginx = self._children("edge-nginx")
        self.nginx.start([NGINX, "-p", str(prefix), "-c", str(conf), "-e",
                          str(prefix / "error.log"), "-g", "daemon off;"], {})
        self.nginx.wait_healthy([f"http://127.0.0.1:{port}/health"])

    def start_floor(self) -> None:
        port = self.ports["floor"] = free_port()
        self.floor = self._children("edge-floor")
        self.floor.start([sys.executable, "-m", "pdserve.bench.edge_floor", "--model", self.model,
                          "--port", str(port), "--decode-worker",
                          f"127.0.0.1:{self.ports['grpc']}"], {})
        self.floor.wait_healthy([f"http://127.0.0.1:{port}/health"])

    def start_edge(self, name: str, env: dict | None = None, flags: tuple = (),
                   embedded: bool = False) -> None:
        """A router and an edge (with `flags`) for path `name` (its port: ports[name]);
        `embedded`: the router runs in the edge's process."""
        port, router_port, grpc_port = free_port(), free_port(), free_port()
        self.ports[name] = port
        cli = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING"]
        source = f"127.0.0.1:{self.ports['grpc']}"
        edge = self._children(f"{name}-edge")
        if embedded:
            self.edges[name] = (None, edge)
            flags = ("--router", "embedded", "--router-port", str(router_port),
                     "--decode-worker", source, *flags)
        else:
            router = self._children(f"{name}-router")
            self.edges[name] = (router, edge)
            router.start([*cli, "router", "--port", str(router_port), "--decode-worker", source],
                         env or {})
            flags = ("--router", f"127.0.0.1:{router_port}", *flags)
        edge.start([*cli, "edge", "--port", str(port), "--grpc-port", str(grpc_port),
                    "--model", self.model, "--min-prefill-workers", "0", *flags], env or {})
        edge.wait_healthy([f"http://127.0.0.1:{port}/health"])

    @staticmethod
    def pids(children) -> list[int]:
        """A started process and its descendants (nginx: master and workers)."""
        import psutil
        out = []
        for p in children.children:
            try:
                out += [p.pid] + [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return out

    def log_summary(self, name: str, lines: int = 40) -> str:
        """What a path's processes logged (nginx: its error log), each message once with
        its count, timestamps and numbers aside, in order of first appearance."""
        if name == "nginx":
            logs = [self.tmp / "nginx" / "error.log"]
        else:
            procs = ([self.source] if name == "direct" else [self.floor] if name == "floor"
                     else list(self.edges.get(name, ())))
            logs = [child.log for c in procs if c for child in c.children]
        seen: Counter = Counter()
        for log in logs:
            if log.exists():
                for line in log.read_text(errors="replace").splitlines():
                    seen[re.sub(r"[0-9]+", "N", line)] += 1
        return "\n".join(f"{n:>7} x {msg[:300]}" for msg, n in list(seen.items())[:lines])

    def stop_nginx(self) -> None:
        if self.nginx:
            self.nginx.stop()
            self.nginx = None

    def stop_floor(self) -> None:
        if self.floor:
            self.floor.stop()
            self.floor = None

    def stop_edge(self, name: str) -> None:
        for c in self.edges.pop(name, ()):
            if c is not None:
                c.stop()

    def stop(self) -> None:
        for name in list(self.edges):
            self.stop_edge(name)
        self.stop_nginx()
        self.stop_floor()
        if self.source:
            self.source.stop()
            self.source = None


def nginx_workers(streams: int, nofile: int) -> int:
    """nginx's workers: one, unless its open-file limit cannot hold two sockets per stream
    (a worker's limit is the process's; without CAP_SYS_RESOURCE it cannot go past the hard
    limit), then as few as can."""
    return max(1, -(-(2 * streams + 128) // max(1024, nofile - 64)))


def nginx_conf(prefix: Path, port: int, upstream: int, nofile: int, workers: int = 1) -> str:
    """`workers` workers (the kernel spreads connections: `reuseport`) proxying to the
    source on loopback, unbuffered, HTTP/1.1 upstream; every path nginx writes lies under
    `prefix`."""
    temps = "\n".join(f"    {k}_temp_path {prefix / k};"
                      for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return f"""worker_processes {workers};
worker_rlimit_nofile {nofile};
pid {prefix / 'nginx.pid'};
error_log {prefix / 'error.log'} warn;
events {{
    worker_connections {max(1024, nofile - 64)};
    multi_accept on;
}}
http {{
    access_log off;
{temps}
    upstream source {{
        server 127.0.0.1:{upstream};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096 reuseport;
        location / {{
            proxy_pass http://source;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 3600s;
            proxy_send_timeout 3600s;
        }}
    }}
}}
"""
