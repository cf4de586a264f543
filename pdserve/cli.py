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
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pdserve import telemetry
from pdserve.config import (ENGINE_DEFAULTS, TOOL_CALL_PARSERS, EdgeConfig, EngineConfig,
                            KVTransferConfig, RouterConfig, WorkerConfig)
from pdserve.netaddr import unbracketed

DEFAULT_MODEL_DIR = Path("models/tiny-llama")


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


# The engine's by-device knobs, which `up` passes to its workers as resolved for its
# --device: every engine of the stack alike (a KV block moves between them).
ENGINE_FLAGS = ("enforce_eager", "block_size", "max_num_batched_tokens",
                "enable_chunked_prefill")


def _by_device(knob: str, show=str) -> str:
    """A device-dependent default, as help says it."""
    cpu, cuda = (show(ENGINE_DEFAULTS[d][knob]) for d in ("cpu", "cuda"))
    return f"default: {cpu} on cpu, {cuda} on cuda" if cpu != cuda else f"default: {cpu}"


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine's knobs. One left unset (None) takes its --device's value
    (pdserve.config.ENGINE_DEFAULTS), which the help names."""
    g = p.add_argument_group("engine (vLLM)")
    g.add_argument("--model", default=_env("PDSERVE_MODEL", ""),
                   help=f"model dir or name (default: the tiny model at {DEFAULT_MODEL_DIR})")
    g.add_argument("--served-model-name", default="", help="name clients use (default: --model)")
    g.add_argument("--device", choices=["cpu", "cuda"], default=_env("PDSERVE_DEVICE", "cpu"))
    g.add_argument("--dtype", default="", help=_by_device("dtype"))
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--kv-cache-gb", type=float, default=1.0,
                   help="KV cache size in GiB on cpu (default: 1; on cuda "
                        "--gpu-memory-utilization sizes it)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory for weights and KV cache on cuda "
                        "(default: 0.9; unused on cpu)")
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="run the model eagerly; --no-enforce-eager: CUDA graphs and "
                        "torch.compile (" + _by_device(
                            "enforce_eager", lambda eager: "eager" if eager else "CUDA graphs")
                        + ")")
    g.add_argument("--block-size", type=int, default=None,
                   help=f"tokens per KV cache block ({_by_device('block_size')})")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens one engine step computes, prompts' and decodes' together "
                        f"({_by_device('max_num_batched_tokens')}; without chunked prefill "
                        "at least --max-model-len)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="split a long prompt over several engine steps, beside decodes ("
                        + _by_device("enable_chunked_prefill",
                                     lambda on: "on" if on else "off") + ")")


# The router's placement flags, which `up` passes to its router unchanged.
PLACEMENT_FLAGS = ("local_prefill_below", "balance", "balance_slack", "local_cached_fraction",
                   "prefill_saturated")


def _add_placement_flags(p: argparse.ArgumentParser) -> None:
    """The router's placement policy (on `router`, and passed through by `up`); the
    defaults are RouterConfig's."""
    g = p.add_argument_group("placement (router)")
    d = RouterConfig()
    g.add_argument("--local-prefill-below", type=int,
                   default=d.local_prefill_below_tokens,
                   help="prefill on the decode worker when fewer tokens than this are uncached")
    g.add_argument("--balance", type=float, default=d.balance,
                   help="bounded load: no decode worker takes more than this x the mean ...")
    g.add_argument("--balance-slack", type=int, default=d.balance_slack,
                   help="... or than this many requests over the mean, if that is more (a "
                        "few requests of imbalance cost less than a session's lost prefix)")
    g.add_argument("--local-cached-fraction", type=float,
                   default=d.local_cached_fraction,
                   help="prefill on the decode worker when it holds this much of the prompt "
                        "(1: never for that reason)")
    g.add_argument("--prefill-saturated", type=int, default=d.prefill_saturated,
                   help="a prefill worker with this many requests in flight (as its engine's "
                        "event stream reports them) takes no more: the decode worker prefills "
                        "(0: off)")


def _add_router_flags(p: argparse.ArgumentParser) -> None:
    """What a router is told beside its placement policy (on `router`, and on an edge
    that runs its own: `--router embedded`)."""
    _add_placement_flags(p)
    p.add_argument("--worker-timeout", type=float, default=RouterConfig().worker_timeout_seconds,
                   help="a worker silent this long is not offered requests")
    p.add_argument("--cluster-token-file", default=_env("PDSERVE_CLUSTER_TOKEN_FILE", ""),
                   help="a file holding the cluster token (e.g. a mounted Secret) that workers "
                        "show when they register: a Register without it is refused "
                        "(UNAUTHENTICATED); empty: no token")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-worker", action="append", default=[], metavar="HOST:PORT",
                       help=f"a {role} engine that does not register (any server of vLLM's "
                            f"engine protocol, e.g. `vllm serve --grpc`); repeatable")


# The edge's admission and stream flags, which `up` passes to its edge unchanged.
EDGE_FLAGS = ("api_keys_file", "tenant_salt_file", "shared_prefixes_file", "max_request_bytes",
              "admission", "admission_queue", "admission_wait_seconds", "drain_seconds",
              "stream_store", "stream_resume_seconds", "stream_ttl_seconds",
              "stream_max_events", "stream_stall_seconds", "sse_keepalive_seconds",
              "response_ttl_seconds",
              "prefill_timeout_seconds", "prefill_attempts", "decode_stall_seconds",
              "decode_first_token_seconds", "max_migrations", "decode_calls",
              "decode_window_bytes", "first_token", "tool_call_parser")


def _add_edge_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("admission and streams (edge)")
    d = EdgeConfig(model="-")
    g.add_argument("--api-keys-file", default=_env("PDSERVE_API_KEYS_FILE", ""),
                   help="API keys, one `KEY TENANT high|normal|low [rps=N] [tpm=N]` per line "
                        "(none: the API is open to whoever reaches the port)")
    g.add_argument("--tenant-salt-file", default=_env("PDSERVE_TENANT_SALT_FILE", ""),
                   help="the secret (>= 16 bytes) each tenant's KV-cache salt is keyed with; "
                        "required with --api-keys-file, the same on every edge (`up` makes "
                        "one when not given)")
    g.add_argument("--shared-prefixes-file", default=_env("PDSERVE_SHARED_PREFIXES_FILE", ""),
                   help="prompt prefixes (system prompts) whose KV tenants share, JSON: "
                        '[{"system" or "text": T, "tenants": [names]}] (docs/tenant-isolation.md)')
    g.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="a request body larger than this is refused (413)")
    g.add_argument("--admission", action=argparse.BooleanOptionalAction, default=d.admission,
                   help="queue and shed by the decode pool's room (--no-admission: send "
                        "everything on, the baseline)")
    g.add_argument("--admission-queue", type=int, default=d.admission_queue,
                   help="requests that may wait for room in the decode pool; more get 503")
    g.add_argument("--admission-wait-seconds", type=float, default=d.admission_wait_seconds,
                   help="the queueing allowance of the TTFT SLO: a request expected to "
                        "wait longer for room gets 503 on arrival, one still waiting after "
                        "this long gets it then")
    g.add_argument("--drain-seconds", type=float, default=d.drain_seconds,
                   help="on SIGTERM: /health fails and nothing new is admitted at once; "
                        "streams in flight get this long to finish (under `up`, every "
                        "worker's drain too)")
    g.add_argument("--stream-store", default=_env("PDSERVE_STREAM_STORE", d.stream_store),
                   help="where stream logs live: memory, or redis://HOST:PORT (shared by "
                        "edge replicas, so a client can resume on another one)")
    g.add_argument("--stream-resume-seconds", type=float, default=d.stream_resume_seconds,
                   help="a generation whose readers all dropped (no cancel) runs on this "
                        "long for one to resume, then is aborted")
    g.add_argument("--stream-ttl-seconds", type=float, default=d.stream_ttl_seconds,
                   help="a finished stream's log is kept this long")
    g.add_argument("--stream-max-events", type=int, default=d.stream_max_events,
                   help="a stream's log keeps its last this many events")
    g.add_argument("--stream-stall-seconds", type=float, default=d.stream_stall_seconds,
                   help="a reader whose writes are blocked this long is cut off")
    g.add_argument("--sse-keepalive-seconds", type=float, default=d.sse_keepalive_seconds,
                   help="an idle SSE stream gets a comment line this often")
    g.add_argument("--response-ttl-seconds", type=float, default=d.response_ttl_seconds,
                   help="a /v1/responses response is kept this long (for GET and "
                        "previous_response_id), where stream logs live")
    g = p.add_argument_group("faults (edge)")
    g.add_argument("--prefill-timeout-seconds", type=float, default=d.prefill_timeout_seconds,
                   help="a prefill leg slower than this is aborted and tried on another "
                        "prefill worker")
    g.add_argument("--prefill-attempts", type=int, default=d.prefill_attempts,
                   help="prefill workers tried for one request before the decode worker "
                        "prefills locally")
    g.add_argument("--decode-stall-seconds", type=float, default=d.decode_stall_seconds,
                   help="a decode worker that sends no token for this long is left: the "
                        "generation moves to another one")
    g.add_argument("--decode-first-token-seconds", type=float,
                   default=d.decode_first_token_seconds,
                   help="the same, before a decode leg's first token")
    g.add_argument("--max-migrations", type=int, default=d.max_migrations,
                   help="moves to another decode worker per generation before it fails")
    g.add_argument("--decode-calls", choices=["per-request", "batched"],
                   default=_env("PDSERVE_DECODE_CALLS", d.decode_calls),
                   help="how decode tokens travel: batched, past a few open legs one shared "
                        "call per pdserve worker, each message every output of one turn (a "
                        "stock worker gets per-request calls), or per-request: a vLLM "
                        "Generate call per leg")
    g.add_argument("--decode-window-bytes", type=int,
                   default=_env("PDSERVE_DECODE_WINDOW_BYTES", d.decode_window_bytes),
                   help="each call to a worker's HTTP/2 receive window, fixed (0: gRPC's, "
                        "which grows): a worker streaming to an edge that fell behind waits "
                        "at this many unread bytes, and sends what it made meanwhile together")
    g.add_argument("--tool-call-parser", choices=list(TOOL_CALL_PARSERS),
                   default=_env("PDSERVE_TOOL_CALL_PARSER", d.tool_call_parser),
                   help="how tool_choice auto reads calls in the model's output: auto (by "
                        "the model's chat template: Hermes <tool_call> or Llama 3 JSON), a "
                        "parser by name, or none (tool_choice auto is then a 400)")
    g.add_argument("--first-token", choices=["prefill", "decode"],
                   default=_env("PDSERVE_FIRST_TOKEN", d.first_token),
                   help="on the disaggregated path, the client's first token: the prefill "
                        "worker's, sent when the prefill answers (the decode worker goes on "
                        "after it, where it can), or the decode engine's, after the KV "
                        "handover (no gap after the first token)")


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
    p.add_argument("--log-level", default=_env("PDSERVE_LOG_LEVEL", "INFO"))
    p.add_argument("--log-format", choices=["text", "json"],
                   default=_env("PDSERVE_LOG_FORMAT", "text"),
                   help="json: one object a line, with the trace id of the request it is about")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start router, prefill, decode and edge on this machine")
    up.add_argument("--host", type=unbracketed, default=_env("PDSERVE_HOST", "127.0.0.1"),
                    help="edge bind address (`::`: every IPv6 and IPv4 address); the router "
                         "and workers bind loopback of its family (127.0.0.1 or ::1)")
    up.add_argument("--port", type=int, default=int(_env("PDSERVE_PORT", "8000")), help="edge port")
    up.add_argument("--grpc-port", type=int, default=50081,
                    help="edge's internal Inference gRPC API")
    up.add_argument("--router-port", type=int, default=50051)
    up.add_argument("--router-in-edge", action=argparse.BooleanOptionalAction, default=False,
                    help="run the router inside the edge process (no router process: the "
                         "edge serves the Router service on --router-port; the router's "
                         "series on the edge's /metrics, --router-metrics-port unused)")
    up.add_argument("--prefill-workers", type=int, default=1, help="prefill pool size")
    up.add_argument("--decode-workers", type=int, default=1, help="decode pool size")
    up.add_argument("--prefill-port", type=int, default=50061,
                    help="first prefill worker's gRPC port (the next ones count up)")
    up.add_argument("--decode-port", type=int, default=50071,
                    help="first decode worker's gRPC port (the next ones count up)")
    up.add_argument("--kv-port", type=int, default=5600,
                    help="NIXL side-channel port of the first worker (the others count up)")
    up.add_argument("--kv-lease-seconds", type=int, default=KVTransferConfig().lease_seconds,
                    help="free a prefill's blocks no decoder claimed after this long")
    up.add_argument("--kv-transfer-mode", choices=("pull", "push"),
                    default=KVTransferConfig().mode,
                    help="pull: the decode engine READs the prompt's blocks; push: the prefill "
                         "engine WRITEs them (every worker of the stack alike)")
    up.add_argument("--prefill-cpus", default="", help="cores for the prefill engine (cpu)")
    up.add_argument("--decode-cpus", default="", help="cores for the decode engine (cpu)")
    up.add_argument("--gateway-cpus", default="",
                    help="cores for the edge and router (default: any)")
    up.add_argument("--worker-metrics-port", type=int, default=0,
                    help="serve each worker's vllm:* and pdserve:kv_* metrics, prefill first, "
                         "counting up from here (0: off)")
    up.add_argument("--router-metrics-port", type=int, default=0,
                    help="serve the router's pdserve:router_* metrics here (0: off)")
    up.add_argument("--prefill-gpus", default="0", help="CUDA_VISIBLE_DEVICES of prefill (cuda)")
    up.add_argument("--decode-gpus", default="1", help="CUDA_VISIBLE_DEVICES of decode (cuda)")
    _add_engine_flags(up)
    _add_placement_flags(up)
    _add_edge_flags(up)

    r = sub.add_parser("router", help="run the router")
    r.add_argument("--host", type=unbracketed, default="127.0.0.1")
    r.add_argument("--port", type=int, default=50051)
    r.add_argument("--cpus", default="", help="cores to run on (default: any)")
    r.add_argument("--metrics-port", type=int, default=0,
                   help="serve the router's pdserve:router_* metrics over HTTP on this port "
                        "(0: off)")
    _add_router_flags(r)

    for role in ("prefill", "decode"):
        w = sub.add_parser(role, help=f"run a {role} worker")
        w.add_argument("--host", type=unbracketed, default="127.0.0.1")
        w.add_argument("--port", type=int, default=0)
        w.add_argument("--advertise-host", type=unbracketed, default="",
                       help="address others dial (default --host)")
        w.add_argument("--router", default="127.0.0.1:50051",
                       help="the router's HOST:PORT; several replicas as a comma-separated "
                            "list or dns:///NAME:PORT (every address NAME resolves to): the "
                            "worker registers with each")
        w.add_argument("--cluster-token-file", default=_env("PDSERVE_CLUSTER_TOKEN_FILE", ""),
                       help="a file holding the cluster token this worker shows when it "
                            "registers (the routers' --cluster-token-file); empty: none")
        w.add_argument("--worker-id", default="")
        w.add_argument("--kv-port", type=int, default=5600, help="NIXL side-channel port")
        w.add_argument("--kv-lease-seconds", type=int, default=KVTransferConfig().lease_seconds,
                       help="free a prefill's blocks no decoder claimed after this long")
        w.add_argument("--kv-transfer-mode", choices=("pull", "push"),
                       default=KVTransferConfig().mode,
                       help="pull: the decode engine READs the blocks; push: the prefill "
                            "engine WRITEs them (prefill and decode workers must agree)")
        w.add_argument("--cpus", default="", help="cores for the engine's threads (cpu)")
        w.add_argument("--metrics-port", type=int, default=0,
                       help="serve the engine's vllm:* Prometheus metrics on this port (0: off)")
        w.add_argument("--drain-seconds", type=float, default=30.0,
                       help="on SIGTERM: leave the router at once; Generate calls in flight "
                            "get this long to finish (a second signal cuts it short)")
        _add_engine_flags(w)

    e = sub.add_parser("edge", help="run the HTTP edge")
    e.add_argument("--host", type=unbracketed, default=_env("PDSERVE_HOST", "127.0.0.1"),
                   help="bind address (`::`: every IPv6 and IPv4 address)")
    e.add_argument("--port", type=int, default=int(_env("PDSERVE_PORT", "8000")))
    e.add_argument("--grpc-port", type=int, default=50081, help="internal Inference gRPC API")
    e.add_argument("--router", default="127.0.0.1:50051",
                   help="the router's HOST:PORT (replicas: IP:PORT,IP:PORT or "
                        "dns:///NAME:PORT, one used at a time), or `embedded`: run it in "
                        "this process, "
                        "serving the Router service on --router-host:--router-port for "
                        "workers to register with (the placement flags below apply)")
    e.add_argument("--router-host", type=unbracketed, default="127.0.0.1",
                   help="with --router embedded: where the Router service binds")
    e.add_argument("--router-port", type=int, default=RouterConfig().port,
                   help="with --router embedded: the Router service's port")
    e.add_argument("--model", default=_env("PDSERVE_MODEL", ""))
    e.add_argument("--served-model-name", default="")
    e.add_argument("--max-model-len", type=int, default=2048)
    e.add_argument("--min-prefill-workers", type=int, default=1)
    e.add_argument("--min-decode-workers", type=int, default=1)
    e.add_argument("--cpus", default="", help="cores to run on (default: any)")
    _add_edge_flags(e)
    _add_router_flags(e)

    b = sub.add_parser("build-model", help="build the tiny offline model if absent")
    b.add_argument("--out", default=str(DEFAULT_MODEL_DIR))
    b.add_argument("--seed", type=int, default=0)

    chaos = sub.add_parser("chaos", add_help=False,
                           help="kill real workers under streaming load; check no stream "
                                "is lost (`pdserve chaos --seed 1 --duration 60 --json`)")
    chaos.add_argument("args", nargs=argparse.REMAINDER)
    bench = sub.add_parser("bench", add_help=False,
                           help="serve: vLLM's serving benchmark; compare: P/D vs colocated")
    bench.add_argument("args", nargs=argparse.REMAINDER)
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
                          host=a.host, port=a.port, grpc_port=a.grpc_port, router=a.router,
                          embedded_router=(_router_config(a, a.router_host, a.router_port)
                                           if a.router == "embedded" else None),
                          min_prefill_workers=a.min_prefill_workers,
                          min_decode_workers=a.min_decode_workers,
                          **{name: getattr(a, name) for name in EDGE_FLAGS})
    if a.command == "up":
        if not 1 <= a.prefill_workers <= 16 or not 1 <= a.decode_workers <= 16:
            raise ValueError("--prefill-workers and --decode-workers must be in 1..16")
        if a.prefill_port < a.decode_port < a.prefill_port + a.prefill_workers:
            raise ValueError("prefill ports run into --decode-port: move one of them")
        return _engine_config(a)
    return None


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
