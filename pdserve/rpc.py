"""gRPC plumbing every pdserve service shares: servers with health, channels.

Servers expose the standard `grpc.health.v1` service; shutdown first flips it
to NOT_SERVING so callers stop picking this process, then drains in-flight
calls for `grace` seconds (grpc examples: async graceful shutdown). A worker
flips it first and waits for its own calls before it stops (`drain`, `stop`).
"""
from __future__ import annotations

import asyncio
import contextvars
import json
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve import telemetry
from pdserve.netaddr import hostport

# Keepalive: detect a dead peer in ~20 s instead of waiting on TCP timeouts;
# long token streams stay open for minutes, so pings must be allowed without
# active calls as well.
_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# so_reuseport off: a second server told an address in use must fail to start,
# not silently share the port with the first (the kernel would split calls between them).
_SERVER_OPTIONS = _KEEPALIVE + [("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                                ("grpc.so_reuseport", 0)]

# Retry only what is safe to retry: UNAVAILABLE means the call never reached
# a handler. RESOURCE_EXHAUSTED is overload and must not be retried blindly.
_SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{"service": "pdserve.v1.Router"}, {"service": "grpc.health.v1.Health"}],
        "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
    }]
})


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The status a number on the wire stands for (UNKNOWN for one gRPC has not)."""
    return _STATUS_CODES.get(number, grpc.StatusCode.UNKNOWN)


def call_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a failed call raises, made on this side: for a call answered in this
    process, or one request's status on a call it shares, so that the caller handles
    it as the failure of a call of its own."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Server:
    """A grpc.aio server with the health service, bound to one address."""

    def __init__(self, host: str, port: int, add_servicers: Callable[[grpc.aio.Server], None],
                 service_names: list[str]):
        self.server = grpc.aio.server(options=_SERVER_OPTIONS,
                                     interceptors=telemetry.server_interceptors())
        add_servicers(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = ["", *service_names]
        self.port = self.server.add_insecure_port(hostport(host, port))
        if self.port == 0:
            raise OSError(f"cannot bind gRPC server to {hostport(host, port)}")

    async def start(self) -> None:
        """Start serving and report SERVING."""
        await self.server.start()
        for name in self.service_names:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def drain(self) -> None:
        """Report NOT_SERVING, still serving: callers stop picking this process
        while the calls it has run on."""
        for name in self.service_names:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING first, then drain in-flight calls for `grace` seconds."""
        await self.drain()
        await self.server.stop(grace)


# Reconnect: a peer that went away is dialled again at least every second. gRPC's
# default backoff grows to 2 minutes, and until its next attempt the channel fails
# every call at once: a worker restarted on its port would be refused for that long.
_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


def channel(address: str, receive_window: int = 0) -> grpc.aio.Channel:
    """An insecure channel with keepalive, quick reconnects and the retry policy above;
    calls carry the caller's trace when tracing is on. `receive_window`: each call's
    HTTP/2 receive window in bytes, fixed (0: gRPC's, which grows with the measured
    bandwidth-delay product). A fixed small window is backpressure: a server streaming
    to a reader that has fallen behind stops at that many unread bytes, and what it
    makes meanwhile goes out together once the reader catches up."""
    window = ([("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", receive_window)]
              if receive_window > 0 else [])
    return grpc.aio.insecure_channel(
        address, options=_KEEPALIVE + _RECONNECT + window + [
            ("grpc.service_config", _SERVICE_CONFIG), ("grpc.enable_retries", 1)],
        interceptors=telemetry.client_interceptors() or None)


class OpenCall:
    """A streaming call that outlives the request that opened it, and so belongs to no
    request's trace: fed from a queue (`_sent`; None ends it), its answers read by a task
    of its own (`read()`, a coroutine), both started here; `close()` ends all three."""

    def __init__(self, method, read) -> None:
        self._requests: asyncio.Queue = asyncio.Queue()
        quiet = contextvars.Context()
        self._call = quiet.run(method, self._sent())
        self._reader = asyncio.get_running_loop().create_task(read(), context=quiet)

    async def _sent(self):
        while (request := await self._requests.get()) is not None:
            yield request

    async def close(self) -> None:
        self._requests.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
