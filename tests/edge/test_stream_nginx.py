"""Streaming through a real nginx reverse proxy (Debian's), with nginx's default
response buffering left on: the edge's `X-Accel-Buffering: no` alone must make
tokens arrive one by one, as they are generated, not in bursts. Resume works
through it too."""
from __future__ import annotations

import json
import shutil
import time

import aiohttp
import pytest

from pdserve.bench.edge_paths import nginx_conf
from pdserve.bench.synthetic import read_stamps
from support import Proc, free_port, parse_sse
from synthetic_stack import edge_stack

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if shutil.os.path.exists("/usr/sbin/nginx")
                                  else None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (make test "
                                "installs it when run as root: apt-get install nginx-light)")


@pytest.fixture
async def proxied(model_dir, tmp_path):
    async with edge_stack(model_dir, rate=20.0) as stack:
        port = free_port()
        conf = nginx_conf(tmp_path, port, int(stack.url.rsplit(":", 1)[1]), 4096)
        conf = conf.replace("proxy_buffering off;", "")          # nginx's default: on
        assert "proxy_buffering" not in conf
        (tmp_path / "nginx.conf").write_text(conf)
        proc = Proc([NGINX, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"),
                     "-g", "daemon off;"], name="nginx")
        proc.wait_listening(port)
        try:
            yield stack, f"http://127.0.0.1:{port}"
        finally:
            proc.stop(timeout=10)


async def test_tokens_arrive_one_by_one_through_nginx(proxied):
    stack, url = proxied
    reads, arrived = [], []
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/completions", json=stack.body(30)) as r:
            assert r.status == 200 and r.headers["x-pdserve-stream-id"]
            sid = r.headers["x-pdserve-stream-id"]
            async for piece in r.content.iter_any():
                now = time.monotonic_ns() // 1000
                events = parse_sse(piece.decode())
                reads.append(len(events))
                arrived += [(now, s) for _, d in events if d != "[DONE]"
                            for s in read_stamps(json.loads(d)["choices"][0]["text"])]
        # 30 tokens, 50 ms apart: each read holds one event, not a burst of them.
        assert len(arrived) == 30
        assert sum(1 for n in reads if n == 1) >= 0.8 * len(reads), reads
        late_ms = sorted((now - sent) / 1000 for now, sent in arrived)
        print(f"\nthrough nginx: token send->arrival p50 {late_ms[15]:.2f} ms, "
              f"max {late_ms[-1]:.2f} ms")
        assert late_ms[15] < 25, late_ms
        # Resuming through the proxy: the Last-Event-ID header reaches the edge.
        async with http.get(f"{url}/v1/streams/{sid}", headers={"Last-Event-ID": "20"}) as r:
            events = parse_sse(await r.text())
        assert events[0][0] == 21 and events[-1][1] == "[DONE]"
