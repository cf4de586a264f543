"""A worker stopped with SIGTERM, at the default log level, logs nothing an operator
must read past: no asyncio task left with an exception nobody read (its KV-event
stream, closed under the router that follows it, ended vLLM's relay), and no line
of gRPC's C core (`I1206 12:00:00.000000 123 chttp2_transport.cc:1403] ...`), in
its log or the router's."""
from __future__ import annotations

import re
import time

from support import Proc, free_port, pdserve_cmd, stop_all

C_CORE_LINE = re.compile(r"^[IWE]\d{4} .*\.cc:\d+\]")


def test_a_worker_stopped_by_sigterm_leaves_no_unread_task_error_and_no_grpc_core_line(
        model_dir, monkeypatch):
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)     # as an operator starts it
    router_port = free_port()
    router = Proc(pdserve_cmd("router", "--port", str(router_port)), name="router")
    procs = [router]
    try:
        router.wait_listening(router_port, timeout=60)
        worker = Proc(pdserve_cmd("decode", "--port", str(free_port()),
                                  "--router", f"127.0.0.1:{router_port}",
                                  "--kv-port", str(free_port()), "--worker-id", "decode-0",
                                  "--model", str(model_dir), "--drain-seconds", "1"),
                      name="decode")
        procs.append(worker)
        # The router follows the worker's KV events: the stream SIGTERM then closes.
        router.wait_for("following the KV events of decode-0", timeout=300, fatal="Traceback")
        time.sleep(2)                                # the worker's relay has subscribed
        assert worker.stop(timeout=90) == 0, "\n".join(worker.lines[-40:])
        assert router.stop(timeout=30) == 0, "\n".join(router.lines[-40:])
    finally:
        stop_all(procs)
    lines = [f"[{p.name}] {line}" for p in procs for line in p.lines]
    assert not [x for x in lines if "exception was never retrieved" in x], "\n".join(lines)
    assert not [x for x in lines if C_CORE_LINE.match(x.split("] ", 1)[1])], "\n".join(lines)
