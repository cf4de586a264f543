"""`pdserve`: the one place where flags and environment become configuration.

Subcommands:
  up        start the whole stack on this machine (router, prefill, decode, edge)
  router    run the router
  prefill   run a prefill worker
  decode    run a decode worker
  edge      run the HTTP edge
  build-model  build the tiny offline test model
  bench     load and side-by-side benchmarks (`pdserve bench compare --quick`)
  chaos     kill workers under streaming load; no stream may be lost
  plan      measure the engine for deployment planning (`pdserve plan profile --quick`)
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pdserve import telemetry
from pdserve.config import EdgeConfig, EngineConfig, KVTransferConfig, RouterConfig, WorkerConfig
from pdserve.flags import (DEFAULT_MODEL_DIR, EDGE_FLAGS, add_common, add_edge, add_harness,
                           add_router, add_up, add_worker)


def _engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model or str(DEFAULT_MODEL_DIR.resolve()), served_model_name=a.served_model_name,
        device=a.device, dtype=a.dtype or None,
        max_model_len=a.max_model_len, kv_cache_bytes=int(a.kv_cache_gb * (1 << 30)),
        gpu_memory_utilization=a.gpu_memory_utilization,
        tensor_parallel_size=a.tensor_parallel_size, max_num_seqs=a.max_num_seqs, seed=a.seed,
        enforce_eager=a.enforce_eager, block_size=a.block_size,
        max_num_batched_tokens=a.max_num_batched_tokens,
        enable_chunked_prefill=a.enable_chunked_prefill)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p)
    sub = p.add_subparsers(dest="command", required=True)
    add_up(sub)
    add_router(sub)
    for role in ("prefill", "decode"):
        add_worker(sub, role)
    add_edge(sub)
    add_harness(sub)
    return p


def parse_cpus(spec: str) -> set[int]:
    """'0,2-3' -> {0, 2, 3}."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _pin(cpus: str) -> None:
    """Run this process (and every thread it starts later) on `cpus` ('' = anywhere)."""
    if cpus:
        os.sched_setaffinity(0, parse_cpus(cpus))


def _engine_env(cfg: WorkerConfig, cpus: str) -> None:
    """vLLM and UCX read these from the process environment, before vllm is imported."""
    from pdserve.transfer.connector import engine_kv_env

    env = engine_kv_env(cfg.kv)
    # An operator's UCX device (a pod's eth0, between pods) and address family win;
    # loopback fits one machine.
    for name in ("UCX_NET_DEVICES", "UCX_TCP_AF_PRIO"):
        env[name] = os.environ.get(name, env[name])
    os.environ.update(env)
    if cfg.engine.device == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, cfg.engine.kv_cache_bytes >> 30))
        if cpus:
            # Two engines on one box must not share cores. vLLM binds only its
            # OpenMP threads (and on a 1-thread team not even the main one), so
            # pin the whole worker process tree: engine core, model runner, NIXL.
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpus
            _pin(cpus)
        if cfg.engine.tensor_parallel_size == 1:
            # The model runs in the engine core's process. vLLM's CPU platform
            # otherwise always adds a worker process behind the engine core, fed
            # through shared-memory queues: one more vllm import at start-up
            # (~20 s of a stack's start on two cores) and one more process hop and
            # wake-up on every engine step. AsyncLLM keeps its engine core process.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


# gRPC's sockets, in a gateway process (edge, router), are polled by the thread that
# waits on grpc.aio's completion queue (gRPC's iomgr), not by EventEngine's own I/O
# threads. With EventEngine every streamed message wakes three threads in turn (an
# I/O thread reads it, grpc.aio's poller thread takes the completion, the event loop
# runs it); without it, two. On this VM a wake-up is what a streamed token costs:
# the edge's CPU per request at 1 req/s read 0.82-0.90x, paired
# (docs/design/2026-12-03-grpc-iomgr-in-the-gateways.md). An operator's own
# GRPC_EXPERIMENTS is kept; a gRPC that no longer knows these names logs that once and
# runs its default.
GATEWAY_GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


# gRPC's C core logs INFO lines to stderr by default (`I1206 ... chttp2_transport.cc:1403]
# ... Got goaway`, whenever a peer stops with calls open: every shutdown). They are no
# operator's business; its errors still show. An operator's own GRPC_VERBOSITY (DEBUG, to
# follow a call) is kept. Read once, when grpc is imported; children inherit it.
GRPC_VERBOSITY = "ERROR"


def _grpc_log_env() -> None:
    """Before grpc is imported, in every pdserve process (`up`'s children inherit it)."""
    os.environ.setdefault("GRPC_VERBOSITY", GRPC_VERBOSITY)


def _gateway_grpc_env() -> None:
    """Before grpc is imported: gRPC reads its experiments once, at start-up."""
    os.environ.setdefault("GRPC_EXPERIMENTS", GATEWAY_GRPC_EXPERIMENTS)


def _tracing(command: str) -> None:
    """Tracing from the OTEL_* environment: after pinning (the exporter's thread keeps
    the process's cores) and before any gRPC server or channel exists."""
    telemetry.setup(f"pdserve-{command}")


def _run(coro) -> None:
    import uvloop

    uvloop.run(coro)


def _router_config(a: argparse.Namespace, host: str, port: int,
                   metrics_port: int = 0) -> RouterConfig:
    return RouterConfig(host=host, port=port,
                        local_prefill_below_tokens=a.local_prefill_below,
                        worker_timeout_seconds=a.worker_timeout, balance=a.balance,
                        balance_slack=a.balance_slack,
                        local_cached_fraction=a.local_cached_fraction,
                        prefill_saturated=a.prefill_saturated, metrics_port=metrics_port,
                        cluster_token_file=a.cluster_token_file,
                        static_workers=tuple([("prefill", w) for w in a.prefill_worker]
                                             + [("decode", w) for w in a.decode_worker]))


def _config(a: argparse.Namespace):
    """The validated config for `a.command` (raises ValueError naming the field)."""
    if a.command == "router":
        return _router_config(a, a.host, a.port, a.metrics_port)
    if a.command in ("prefill", "decode"):
        return WorkerConfig(role=a.command, engine=_engine_config(a),
                            # NIXL's handshake stays on vLLM's side channel, bound to the
                            # address peers dial (the advertised one), nowhere else.
                            kv=KVTransferConfig(side_channel_host=a.advertise_host or a.host,
                                                side_channel_port=a.kv_port,
                                                lease_seconds=a.kv_lease_seconds,
                                                mode=a.kv_transfer_mode,
                                                buffer_device=a.device),
                            host=a.host, port=a.port, advertise_host=a.advertise_host,
                            router=a.router, worker_id=a.worker_id, metrics_port=a.metrics_port,
                            drain_seconds=a.drain_seconds,
                            cluster_token_file=a.cluster_token_file)
    if a.command == "edge":
        if a.router != "embedded" and (a.prefill_worker or a.decode_worker):
            raise ValueError("--prefill-worker/--decode-worker name engines for a router "
                             "this edge runs: they need --router embedded")
        return EdgeConfig(model=a.model or str(DEFAULT_MODEL_DIR.resolve()),
                          served_model_name=a.served_model_name, max_model_len=a.max_model_len,
                          host=a.host, port=a.port, grpc_port=a.grpc_port,
                          metrics_port=a.metrics_port, router=a.router,
                          embedded_router=(_router_config(a, a.router_host, a.router_port)
                                           if a.router == "embedded" else None),
                          min_prefill_workers=a.min_prefill_workers,
                          min_decode_workers=a.min_decode_workers,
                          **{name: getattr(a, name) for name in EDGE_FLAGS})
    if a.command == "up":
        _check_up(a)
        return _engine_config(a)
    return None


def _check_up(a: argparse.Namespace) -> None:
    """`up`'s pools and their ports, which count up from each first one."""
    if not 1 <= a.prefill_workers <= 16 or not 1 <= a.decode_workers <= 16:
        raise ValueError("--prefill-workers and --decode-workers must be in 1..16")
    if a.prefill_port < a.decode_port < a.prefill_port + a.prefill_workers:
        raise ValueError("prefill ports run into --decode-port: move one of them")
    if not 1 <= a.routers <= 16 or (a.routers > 1 and a.router_in_edge):
        raise ValueError("--routers must be in 1..16, and 1 with --router-in-edge")
    workers = {*range(a.prefill_port, a.prefill_port + a.prefill_workers),
               *range(a.decode_port, a.decode_port + a.decode_workers)}
    if workers & set(range(a.router_port, a.router_port + a.routers)):
        raise ValueError("router ports run into the workers' ports: move --router-port")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _grpc_log_env()
    if argv[:1] == ["chaos"]:           # its flags are its own (argparse's REMAINDER
        from pdserve.bench.chaos import main as chaos_main    # cannot start with an option)
        sys.exit(chaos_main(argv[1:]))
    a = _parser().parse_args(argv)
    telemetry.configure_logging(a.command, a.log_level, a.log_format)
    try:
        cfg = _config(a)
    except ValueError as e:
        print(f"pdserve {a.command}: {e}", file=sys.stderr)  # names the field; no traceback
        sys.exit(2)
    if a.command == "bench":
        from pdserve.bench.cli import main as bench_main
        sys.exit(bench_main(a.args))
    if a.command == "plan":
        from pdserve.bench.plan.cli import main as plan_main
        sys.exit(plan_main(a.args))
    if a.command == "build-model":
        from pdserve.tiny_model import ensure_tiny_model
        print(ensure_tiny_model(Path(a.out), seed=a.seed))
    elif a.command == "router":
        _pin(a.cpus)
        _gateway_grpc_env()
        _tracing(a.command)
        from pdserve.services.router.server import serve
        _run(serve(cfg))
    elif a.command in ("prefill", "decode"):
        _engine_env(cfg, a.cpus)
        _tracing(a.command)
        from pdserve.services.worker.engine_watch import EXIT_ENGINE_DEAD, EngineDied
        from pdserve.services.worker.main import serve_worker
        try:
            _run(serve_worker(cfg))
        except EngineDied as e:
            # At once: vLLM's exit handlers would wait on an engine that is gone.
            logging.getLogger("pdserve.worker").error("%s; exiting", e)
            logging.shutdown()
            os._exit(EXIT_ENGINE_DEAD)
    elif a.command == "edge":
        _pin(a.cpus)
        _gateway_grpc_env()
        _tracing(a.command)
        from pdserve.services.edge.server import serve
        _run(serve(cfg))
    elif a.command == "up":
        from pdserve.supervisor import run_stack
        sys.exit(run_stack(a, cfg))


if __name__ == "__main__":
    main()
