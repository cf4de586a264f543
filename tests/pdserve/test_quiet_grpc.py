"""A pdserve process logs no gRPC C-core INFO line at the default level: here the one a
client writes on every peer's shutdown with calls open (`Got goaway ... Cancelling all
calls`), which `make test` and `pdserve up` printed."""
from __future__ import annotations

import os
import re
import subprocess
import sys

C_CORE_LINE = re.compile(r"^[IWE]\d{4} .*\.cc:\d+\]", re.MULTILINE)

# A server stopped with no grace while a client's stream is open: the client gets GOAWAY.
GOAWAY = """
import asyncio
from pdserve.cli import _grpc_log_env
_grpc_log_env()                       # as pdserve.cli.main does, before grpc is imported
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

async def main():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        await call.read()
        await server.stop(None)
        try:
            await call.read()
        except grpc.aio.AioRpcError as e:
            print(e.code().name)
        await asyncio.sleep(0.3)      # the client's transport reads the GOAWAY meanwhile

asyncio.run(main())
"""


def _goaway(verbosity: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    if verbosity is not None:
        env["GRPC_VERBOSITY"] = verbosity
    return subprocess.run([sys.executable, "-c", GOAWAY], env=env, capture_output=True,
                          text=True, timeout=60, check=True)


def test_a_peers_goaway_is_not_logged_by_default():
    out = _goaway(None)
    assert out.stdout.strip() == "UNAVAILABLE"
    assert not C_CORE_LINE.search(out.stderr), out.stderr


def test_an_operator_who_asks_for_grpcs_info_lines_gets_them():
    """(gRPC then warns, in such a line, that INFO is no level for production; whether
    the GOAWAY's own line comes before the process ends is a race.)"""
    out = _goaway("INFO")
    assert C_CORE_LINE.search(out.stderr), out.stderr
