"""The command line's flags: a table per command (`pdserve up`, `router`, `prefill` and
`decode`, `edge`, ...) and the groups they share. The defaults are the config objects'
(pdserve.config); pdserve.cli turns what was parsed into those objects."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from pdserve.config import (ENGINE_DEFAULTS, TOOL_CALL_PARSERS, EdgeConfig, KVTransferConfig,
                            RouterConfig)
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
    g.add_argument("--device", choices=["cpu", "cuda"], default=_env("PDSERVE_DEVICE", "cpu"),
                   help="cpu or cuda: which column of docs/engine-flags.md the engine "
                        "defaults take")
    g.add_argument("--dtype", default="", help=_by_device("dtype"))
    g.add_argument("--max-model-len", type=int, default=2048, help="longest prompt plus output")
    g.add_argument("--kv-cache-gb", type=float, default=1.0,
                   help="KV cache size in GiB on cpu (default: 1; on cuda "
                        "--gpu-memory-utilization sizes it)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory for weights and KV cache on cuda "
                        "(default: 0.9; unused on cpu)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs (or CPU ranks) per engine")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="requests one engine runs at once: the decode pool's capacity, "
                        "which admission reads")
    g.add_argument("--seed", type=int, default=0, help="random seed")
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
    _add_file_flags(p, (("--cluster-token-file", "PDSERVE_CLUSTER_TOKEN_FILE",
                         "a file holding the cluster token (e.g. a mounted Secret) that workers "
                         "show when they register: a Register without it is refused "
                         "(UNAUTHENTICATED); empty: no token"),))
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
    """The edge's own flags (on `edge`, and passed through by `up`); the defaults are
    EdgeConfig's."""
    d = EdgeConfig(model="-")
    g = p.add_argument_group("admission and streams (edge)")
    _add_admission_flags(g, d)
    _add_stream_flags(g, d)
    g = p.add_argument_group("faults (edge)")
    _add_config_flags(g, d, _FAULT_FLAGS)
    _add_decode_path_flags(g, d)


# The edge's files of secrets and tenants: (flag, environment variable, help).
_TENANT_FILES = (
    ("--api-keys-file", "PDSERVE_API_KEYS_FILE",
     "API keys, one `KEY TENANT high|normal|low [rps=N] [tpm=N]` per line (none: the API is "
     "open to whoever reaches the port)"),
    ("--tenant-salt-file", "PDSERVE_TENANT_SALT_FILE",
     "the secret (>= 16 bytes) each tenant's KV-cache salt is keyed with; required with "
     "--api-keys-file, the same on every edge (`up` makes one when not given)"),
    ("--shared-prefixes-file", "PDSERVE_SHARED_PREFIXES_FILE",
     'prompt prefixes (system prompts) whose KV tenants share, JSON: [{"system" or "text": T, '
     '"tenants": [names]}] (docs/tenant-isolation.md)'),
)


def _add_file_flags(g, rows) -> None:
    """A flag per (flag, environment variable, help) of `rows`: a file's path, by default
    the variable's value, else none."""
    for flag, env, help in rows:
        g.add_argument(flag, default=_env(env, ""), help=help)


def _add_admission_flags(g: argparse._ArgumentGroup, d: EdgeConfig) -> None:
    _add_file_flags(g, _TENANT_FILES)
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


def _add_stream_flags(g: argparse._ArgumentGroup, d: EdgeConfig) -> None:
    g.add_argument("--stream-store", default=_env("PDSERVE_STREAM_STORE", d.stream_store),
                   help="where stream logs live: memory, or redis://HOST:PORT (shared by "
                        "edge replicas, so a client can resume on another one)")
    _add_config_flags(g, d, _STREAM_FLAGS)


# Flags whose default is EdgeConfig's field of the same name: (flag, type, help).
_STREAM_FLAGS = (
    ("--stream-resume-seconds", float, "a generation whose readers all dropped (no cancel) "
                                       "runs on this long for one to resume, then is aborted"),
    ("--stream-ttl-seconds", float, "a finished stream's log is kept this long"),
    ("--stream-max-events", int, "a stream's log keeps its last this many events"),
    ("--stream-stall-seconds", float, "a reader whose writes are blocked this long is cut off"),
    ("--sse-keepalive-seconds", float, "an idle SSE stream gets a comment line this often"),
    ("--response-ttl-seconds", float, "a /v1/responses response is kept this long (for GET "
                                      "and previous_response_id), where stream logs live"),
)
_FAULT_FLAGS = (
    ("--prefill-timeout-seconds", float, "a prefill leg slower than this is aborted and tried "
                                         "on another prefill worker"),
    ("--prefill-attempts", int, "prefill workers tried for one request before the decode "
                                "worker prefills locally"),
    ("--decode-stall-seconds", float, "a decode worker that sends no token for this long is "
                                      "left: the generation moves to another one"),
    ("--decode-first-token-seconds", float, "the same, before a decode leg's first token"),
    ("--max-migrations", int, "moves to another decode worker per generation before it fails"),
)


def _add_config_flags(g: argparse._ArgumentGroup, d, table) -> None:
    """A flag per row of `table`, its default `d`'s field of the flag's name."""
    for flag, kind, help in table:
        g.add_argument(flag, type=kind, default=getattr(d, flag[2:].replace("-", "_")),
                       help=help)


def _add_decode_path_flags(g: argparse._ArgumentGroup, d: EdgeConfig) -> None:
    _add_env_flag(g, d, "--decode-calls", "PDSERVE_DECODE_CALLS",
                  choices=["per-request", "batched"], help=(
        "how decode tokens travel: batched, past a few open legs one shared call per pdserve "
        "worker, each message every output of one turn (a stock worker gets per-request "
        "calls), or per-request: a vLLM Generate call per leg"))
    _add_env_flag(g, d, "--decode-window-bytes", "PDSERVE_DECODE_WINDOW_BYTES",
                  type=int, help=(
        "each call to a worker's HTTP/2 receive window, fixed (0: gRPC's, which grows): a "
        "worker streaming to an edge that fell behind waits at this many unread bytes, and "
        "sends what it made meanwhile together"))
    _add_env_flag(g, d, "--tool-call-parser", "PDSERVE_TOOL_CALL_PARSER",
                  choices=list(TOOL_CALL_PARSERS), help=(
        "how tool_choice auto reads calls in the model's output: auto (by the model's chat "
        "template: Hermes <tool_call> or Llama 3 JSON), a parser by name, or none "
        "(tool_choice auto is then a 400)"))
    _add_env_flag(g, d, "--first-token", "PDSERVE_FIRST_TOKEN",
                  choices=["prefill", "decode"], help=(
        "on the disaggregated path, the client's first token: the prefill worker's, sent "
        "when the prefill answers (the decode worker goes on after it, where it can), or "
        "the decode engine's, after the KV handover (no gap after the first token)"))


def _add_env_flag(g: argparse._ArgumentGroup, d, flag: str, env: str, **kw) -> None:
    """A flag whose default is the environment's `env`, else `d`'s field of the flag's
    name (--first-token: d.first_token)."""
    g.add_argument(flag, default=_env(env, getattr(d, flag[2:].replace("-", "_"))), **kw)


def _add_kv_flags(p: argparse.ArgumentParser, port_help: str, mode_help: str) -> None:
    """The KV transfer's flags (a worker's own; on `up`, every worker's); the defaults
    are KVTransferConfig's."""
    d = KVTransferConfig()
    p.add_argument("--kv-port", type=int, default=5600, help=port_help)
    p.add_argument("--kv-lease-seconds", type=int, default=d.lease_seconds,
                   help="free a prefill's blocks no decoder claimed after this long")
    p.add_argument("--kv-transfer-mode", choices=("pull", "push"), default=d.mode,
                   help=mode_help)


def add_common(p: argparse.ArgumentParser) -> None:
    """The flags of every command, given before it: `pdserve --log-level DEBUG edge ...`."""
    p.add_argument("--log-level", default=_env("PDSERVE_LOG_LEVEL", "INFO"),
                   help="Python logging level")
    p.add_argument("--log-format", choices=["text", "json"],
                   default=_env("PDSERVE_LOG_FORMAT", "text"),
                   help="json: one object a line, with the trace id of the request it is about")


def add_up(sub: argparse._SubParsersAction) -> None:
    """`pdserve up`: the whole stack, passing the engine's, the placement's and the
    edge's flags on to its children."""
    up = sub.add_parser("up", help="start router, prefill, decode and edge on this machine")
    up.add_argument("--host", type=unbracketed, default=_env("PDSERVE_HOST", "127.0.0.1"),
                    help="edge bind address (`::`: every IPv6 and IPv4 address); the router "
                         "and workers bind loopback of its family (127.0.0.1 or ::1)")
    up.add_argument("--port", type=int, default=int(_env("PDSERVE_PORT", "8000")), help="edge port")
    up.add_argument("--grpc-port", type=int, default=50081,
                    help="edge's internal Inference gRPC API")
    up.add_argument("--router-port", type=int, default=50051,
                    help="the router's gRPC port (with --routers N, the first replica's; the "
                         "next ones count up)")
    up.add_argument("--routers", type=int, default=1,
                    help="router replicas, each holding the whole pool: every worker "
                         "registers with each, the edge dials them as one list and moves to "
                         "another when the one it uses goes away")
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
    _add_kv_flags(up, "NIXL side-channel port of the first worker (the others count up)",
                  "pull: the decode engine READs the prompt's blocks; push: the prefill "
                  "engine WRITEs them (every worker of the stack alike)")
    up.add_argument("--prefill-cpus", default="", help="cores for the prefill engine (cpu)")
    up.add_argument("--decode-cpus", default="", help="cores for the decode engine (cpu)")
    up.add_argument("--gateway-cpus", default="",
                    help="cores for the edge and router (default: any)")
    up.add_argument("--worker-metrics-port", type=int, default=0,
                    help="serve each worker's vllm:* and pdserve:kv_* metrics, prefill first, "
                         "counting up from here (0: off)")
    up.add_argument("--router-metrics-port", type=int, default=0,
                    help="serve the router's pdserve:router_* metrics here, replicas "
                         "counting up (0: off)")
    up.add_argument("--edge-metrics-port", type=int, default=0,
                    help="serve the edge's /metrics here instead of on --port (0: on --port)")
    up.add_argument("--prefill-gpus", default="0", help="CUDA_VISIBLE_DEVICES of prefill (cuda)")
    up.add_argument("--decode-gpus", default="1", help="CUDA_VISIBLE_DEVICES of decode (cuda)")
    _add_engine_flags(up)
    _add_placement_flags(up)
    _add_edge_flags(up)


def add_router(sub: argparse._SubParsersAction) -> None:
    """`pdserve router`."""
    r = sub.add_parser("router", help="run the router")
    r.add_argument("--host", type=unbracketed, default="127.0.0.1", help="bind address")
    r.add_argument("--port", type=int, default=50051, help="gRPC port")
    r.add_argument("--cpus", default="", help="cores to run on (default: any)")
    r.add_argument("--metrics-port", type=int, default=0,
                   help="serve the router's pdserve:router_* metrics over HTTP on this port "
                        "(0: off)")
    _add_router_flags(r)


def add_worker(sub: argparse._SubParsersAction, role: str) -> None:
    """`pdserve prefill` and `pdserve decode`."""
    w = sub.add_parser(role, help=f"run a {role} worker")
    w.add_argument("--host", type=unbracketed, default="127.0.0.1", help="bind address")
    w.add_argument("--port", type=int, default=0, help="gRPC port (0: any free one)")
    w.add_argument("--advertise-host", type=unbracketed, default="",
                   help="address others dial (default --host)")
    w.add_argument("--router", default="127.0.0.1:50051",
                   help="the router's HOST:PORT; several replicas as a comma-separated "
                        "list or dns:///NAME:PORT (every address NAME resolves to): the "
                        "worker registers with each")
    _add_file_flags(w, (("--cluster-token-file", "PDSERVE_CLUSTER_TOKEN_FILE",
                         "a file holding the cluster token this worker shows when it registers "
                         "(the routers' --cluster-token-file); empty: none"),))
    w.add_argument("--worker-id", default="",
                   help="id the router knows the worker by (default: ROLE-HOSTNAME-PORT)")
    _add_kv_flags(w, "NIXL side-channel port",
                  "pull: the decode engine READs the blocks; push: the prefill "
                  "engine WRITEs them (prefill and decode workers must agree)")
    w.add_argument("--cpus", default="", help="cores for the engine's threads (cpu)")
    w.add_argument("--metrics-port", type=int, default=0,
                   help="serve the engine's vllm:* Prometheus metrics on this port (0: off)")
    w.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM: leave the router at once; Generate calls in flight "
                        "get this long to finish (a second signal cuts it short)")
    _add_engine_flags(w)


def add_edge(sub: argparse._SubParsersAction) -> None:
    """`pdserve edge`."""
    e = sub.add_parser("edge", help="run the HTTP edge")
    e.add_argument("--host", type=unbracketed, default=_env("PDSERVE_HOST", "127.0.0.1"),
                   help="bind address (`::`: every IPv6 and IPv4 address)")
    e.add_argument("--port", type=int, default=int(_env("PDSERVE_PORT", "8000")), help="HTTP port")
    e.add_argument("--grpc-port", type=int, default=50081, help="internal Inference gRPC API")
    e.add_argument("--metrics-port", type=int, default=0,
                   help="serve /metrics on this port (on --host) instead of --port, which then "
                        "answers it 404 (0: /metrics on --port, beside the API)")
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
    e.add_argument("--model", default=_env("PDSERVE_MODEL", ""),
                   help="model dir or name: tokenizer, chat template, the name in "
                        "/v1/models (default: the tiny model)")
    e.add_argument("--served-model-name", default="", help="name clients use (default: --model)")
    e.add_argument("--max-model-len", type=int, default=2048,
                   help="longest prompt plus output; a longer request is 400")
    e.add_argument("--min-prefill-workers", type=int, default=1,
                   help="/health is 503 below this many serving prefill workers")
    e.add_argument("--min-decode-workers", type=int, default=1,
                   help="/health is 503 below this many serving decode workers")
    e.add_argument("--cpus", default="", help="cores to run on (default: any)")
    _add_edge_flags(e)
    _add_router_flags(e)


def add_harness(sub: argparse._SubParsersAction) -> None:
    """`build-model`, and the harness's `chaos`, `bench` and `plan`, which parse their own
    flags."""
    b = sub.add_parser("build-model", help="build the tiny offline model if absent")
    b.add_argument("--out", default=str(DEFAULT_MODEL_DIR), help="where the model is written")
    b.add_argument("--seed", type=int, default=0, help="seed of the random weights")

    chaos = sub.add_parser("chaos", add_help=False,
                           help="kill real workers under streaming load; check no stream "
                                "is lost (`pdserve chaos --seed 1 --duration 60 --json`)")
    chaos.add_argument("args", nargs=argparse.REMAINDER)
    bench = sub.add_parser("bench", add_help=False,
                           help="serve: vLLM's serving benchmark; compare: P/D vs colocated")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    plan = sub.add_parser("plan", add_help=False,
                          help="profile: measure the engine's costs for the planner "
                               "(`pdserve plan profile --quick`)")
    plan.add_argument("args", nargs=argparse.REMAINDER)
