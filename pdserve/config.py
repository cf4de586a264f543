"""Configuration of every pdserve process, as frozen dataclasses.

`pdserve.cli` is the one place that turns flags and environment into these; no
other module reads `os.environ`. Each dataclass validates itself so a bad value
fails at start-up with the field's name, not deep inside a request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve import routers
from pdserve.netaddr import split_hostport


def _check_port(name: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"{name} must be a TCP port (0-65535), got {port}")


def _is_hostport(address: str) -> bool:
    try:
        split_hostport(address)
    except ValueError:
        return False
    return True


def _check_positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


# The edge's tool-call parsers by name ("auto": by the model's chat template; "none").
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "none")
# The edge's HTTP/2 receive window on calls to workers (EdgeConfig.decode_window_bytes).
DECODE_WINDOW_BYTES = 8192


# An engine knob left unset (None) takes its device's value. CPU: a quick start and exact
# numbers on a small box (block and batch as vLLM's CPU platform picks them); CUDA: what
# `vllm serve` picks on an H100.
ENGINE_DEFAULTS: dict[str, dict[str, object]] = {
    "cpu": {"dtype": "float32",               # exact, and faster than bfloat16 on CPU
            "enforce_eager": True,            # torch.compile costs ~30 s at start on CPU
            "block_size": 128,                # vLLM's CPU attention wants multiples of 32
            "max_num_batched_tokens": 2048,
            "enable_chunked_prefill": True},
    "cuda": {"dtype": "bfloat16",
             "enforce_eager": False,          # CUDA graphs: decode steps without launch gaps
             "block_size": 16,
             "max_num_batched_tokens": 8192,  # larger prefill chunks keep a GPU busy
             "enable_chunked_prefill": True},
}


def engine_defaults(device: str) -> dict[str, object]:
    """The engine knobs' values on `device` ("cpu" | "cuda") when not given."""
    return dict(ENGINE_DEFAULTS[device])


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How a worker builds its vLLM engine. A knob left None takes its device's
    value (ENGINE_DEFAULTS) at construction."""

    model: str
    served_model_name: str = ""
    device: str = "cpu"                  # "cpu" | "cuda"
    dtype: str | None = None
    max_model_len: int = 2048
    kv_cache_bytes: int = 1 << 30        # CPU needs an explicit KV size
    gpu_memory_utilization: float = 0.9  # CUDA: the share for weights and KV
    tensor_parallel_size: int = 1
    enforce_eager: bool | None = None    # False: CUDA graphs (and torch.compile)
    block_size: int | None = None        # tokens per KV block
    max_num_batched_tokens: int | None = None    # tokens one engine step computes
    enable_chunked_prefill: bool | None = None   # a long prompt over several steps
    max_num_seqs: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a path or a model name")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        defaults = engine_defaults(self.device)
        if self.enable_chunked_prefill is False:
            # As vLLM does: unchunked, one step must hold the longest prompt.
            defaults["max_num_batched_tokens"] = max(defaults["max_num_batched_tokens"],
                                                     self.max_model_len)
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)   # frozen: resolved once, here
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"dtype must be float32|bfloat16|float16|auto, got {self.dtype!r}")
        _check_positive("max_model_len", self.max_model_len)
        _check_positive("kv_cache_bytes", self.kv_cache_bytes)
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        _check_positive("block_size", self.block_size)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens must be >= max_num_seqs "
                             f"({self.max_num_seqs}), got {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens must be >= max_model_len "
                             f"({self.max_model_len}) without chunked prefill, "
                             f"got {self.max_num_batched_tokens}")

    @property
    def name(self) -> str:
        """The model name clients use (`model` in requests)."""
        return self.served_model_name or self.model


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """How KV blocks move between a prefill and a decode worker (see transfer/)."""

    connector: str = "nixl"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    # Blocks no decoder claimed are freed after this. A decoder that has the request
    # queued renews the lease (vLLM's heartbeats, every lease/6 s), and a claim
    # extends it: only a decoder or an edge that died lets it run out.
    lease_seconds: int = 6
    buffer_device: str = "cpu"           # "cpu" on CPU boxes, "cuda" on GPUs
    # Who moves the blocks: "pull" (the decode engine READs them from the prefill
    # engine) or "push" (the prefill engine WRITEs them into blocks the decode
    # engine allocated). Both ends of a transfer must agree. Pull is the default: push was
    # at most 6% sooner and is not proven under faults
    # (docs/design/2026-12-01-pull-not-push.md).
    mode: str = "pull"

    def __post_init__(self) -> None:
        if self.connector not in ("nixl",):
            raise ValueError(f"kv connector must be 'nixl', got {self.connector!r}")
        if self.mode not in ("pull", "push"):
            raise ValueError(f"kv mode must be 'pull' or 'push', got {self.mode!r}")
        _check_port("kv side_channel_port", self.side_channel_port)
        _check_positive("kv lease_seconds", self.lease_seconds)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """A prefill or decode worker: one gRPC server owning one engine."""

    role: str                            # "prefill" | "decode"
    engine: EngineConfig
    kv: KVTransferConfig = field(default_factory=KVTransferConfig)
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""             # address others dial; defaults to host
    router: str = "127.0.0.1:50051"
    worker_id: str = ""
    heartbeat_seconds: float = 2.0
    metrics_port: int = 0                # the engine's vllm:* series over HTTP; 0 = off
    drain_seconds: float = 30.0          # SIGTERM: Generate calls in flight get this long
    cluster_token_file: str = ""         # the token Register shows (pdserve/cluster_token.py)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        routers.parts(self.router)           # ValueError naming a bad entry
        _check_port("port", self.port)
        _check_port("metrics_port", self.metrics_port)
        _check_positive("heartbeat_seconds", self.heartbeat_seconds)
        if self.drain_seconds < 0:
            raise ValueError(f"drain_seconds must be >= 0, got {self.drain_seconds}")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The router: worker registry and placement policy."""

    host: str = "127.0.0.1"
    port: int = 50051
    # Prompts shorter than this are prefilled on the decode worker: moving
    # their KV costs more than recomputing it.
    local_prefill_below_tokens: int = 32
    worker_timeout_seconds: float = 6.0  # no heartbeat for this long = not serving
    # Engines that do not register (stock `vllm ... --grpc`): ("prefill"|"decode", host:port).
    static_workers: tuple[tuple[str, str], ...] = ()
    balance: float = 1.25                # no decode worker over this x the mean load ...
    balance_slack: int = 2               # ... or this many requests over it, if more
    local_cached_fraction: float = 0.8   # decode worker holds this much of the prompt: local
    prefill_saturated: int = 2           # requests in flight that make a prefill worker full; 0 off
    metrics_port: int = 0                # its pdserve:router_* series over HTTP; 0 = off
    cluster_token_file: str = ""         # Register/Deregister must show its token; "" open

    def __post_init__(self) -> None:
        _check_port("port", self.port)
        _check_port("metrics_port", self.metrics_port)
        if self.local_prefill_below_tokens < 0:
            raise ValueError("local_prefill_below_tokens must be >= 0")
        if self.balance < 1:
            raise ValueError(f"balance must be >= 1, got {self.balance}")
        if self.balance_slack < 0:
            raise ValueError(f"balance_slack must be >= 0, got {self.balance_slack}")
        for role, address in self.static_workers:
            if role not in ("prefill", "decode") or not _is_hostport(address):
                raise ValueError(f"static worker must be a prefill/decode HOST:PORT "
                                 f"([IPV6]:PORT), got {role} {address!r}")
        _check_positive("worker_timeout_seconds", self.worker_timeout_seconds)


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    """The HTTP edge: OpenAI API, SSE streaming, health and metrics."""

    model: str                           # model dir/name: the tokenizer comes from here
    served_model_name: str = ""
    max_model_len: int = 2048
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50081               # the internal Inference API
    # /metrics on a port of its own (0: on `port`, beside the API), so that a
    # NetworkPolicy can open it to the monitoring namespace alone.
    metrics_port: int = 0
    router: str = "127.0.0.1:50051"
    # Set: the router runs in the edge's process (`--router embedded`), placing on its
    # loop and serving pdserve.v1.Router on its host:port for workers to register with.
    embedded_router: RouterConfig | None = None
    min_prefill_workers: int = 1         # /health is 503 until this many serve
    min_decode_workers: int = 1
    request_timeout_seconds: float = 600.0
    # Streams (services/edge/streams.py): where their logs live, how long a
    # dropped generation waits for its reader, how much each log keeps.
    api_keys_file: str = ""              # KEY TENANT PRIORITY [rps=N] [tpm=N] per line; "" open
    # The secret each tenant's cache salt is keyed with (services/edge/tenant_salt.py):
    # needed with keys, the same on every edge of a deployment.
    tenant_salt_file: str = ""
    shared_prefixes_file: str = ""       # prompt prefixes tenants share (JSON; "" none)
    max_request_bytes: int = 1 << 20     # a larger body is 413
    # Admission (services/edge/admission.py): what may wait for room in the pool.
    admission: bool = True               # False: admit everything at once (a baseline)
    admission_queue: int = 256
    admission_wait_seconds: float = 10.0
    drain_seconds: float = 30.0          # SIGTERM: streams in flight get this long to finish
    stream_store: str = "memory"         # memory | redis://HOST:PORT
    stream_resume_seconds: float = 5.0
    stream_ttl_seconds: float = 120.0
    stream_max_events: int = 4096
    stream_stall_seconds: float = 10.0   # a reader blocked this long is cut off
    sse_keepalive_seconds: float = 15.0
    # Responses (/v1/responses) kept for GET and previous_response_id, in the stream store.
    response_ttl_seconds: float = 3600.0
    # Faults (services/edge/moves.py): a failing worker costs a retry, not a stream.
    prefill_timeout_seconds: float = 30.0   # a slower prefill is tried on another worker
    prefill_attempts: int = 2               # prefill workers tried before local prefill
    decode_stall_seconds: float = 5.0       # a decode silent this long moves elsewhere
    decode_first_token_seconds: float = 30.0  # ... before its first token
    max_migrations: int = 3                 # moves per generation before it fails
    decode_exclude_seconds: float = 10.0    # a worker that failed a generation: skipped this long
    decode_place_wait_seconds: float = 30.0  # a move waits this long for a decode worker to serve
    # How decode legs read tokens: past a few open legs, one shared call per worker that
    # offers pdserve.v1.BatchedGenerate (batched; a stock worker gets per-request calls),
    # or one vLLM `Generate` call each (per-request).
    decode_calls: str = "batched"
    # The HTTP/2 receive window of each call to a worker, fixed, in bytes (0: gRPC's own,
    # which grows with the link's bandwidth-delay product). Small, it is backpressure on a
    # worker's shared call: when the edge's loop falls behind (a burst of new requests),
    # the worker's outputs wait there and come in fewer, larger messages, each of which
    # costs the edge a loop turn (docs/design/2026-12-06-receive-window.md).
    decode_window_bytes: int = DECODE_WINDOW_BYTES
    # Whose token a disaggregated request's client gets first: the prefill's, as soon as
    # the prefill answers (the decode worker then goes on after it, where it can: see
    # docs/design/2026-12-05-first-token-from-the-prefill.md), or the decode engine's,
    # after the KV handover (a steadier first gap).
    first_token: str = "prefill"
    # How tool_choice "auto" reads calls out of the model's text: "auto" picks the
    # parser the model's chat template implies (services/edge/tool_parsers.py).
    tool_call_parser: str = "auto"

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a path or a model name")
        if self.api_keys_file and not self.tenant_salt_file:
            raise ValueError("tenant_salt_file: an edge with API keys needs the deployment's "
                             "salt secret (--tenant-salt-file or PDSERVE_TENANT_SALT_FILE), "
                             "which keeps tenants' KV caches apart")
        if self.shared_prefixes_file and not self.api_keys_file:
            raise ValueError("shared_prefixes_file: shared prefixes need API keys (an open "
                             "edge shares every prefix already)")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {list(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.first_token not in ("prefill", "decode"):
            raise ValueError(f"first_token must be prefill or decode, got {self.first_token!r}")
        if self.stream_store != "memory" and not self.stream_store.startswith("redis://"):
            raise ValueError(f"stream_store must be memory or redis://HOST:PORT, "
                             f"got {self.stream_store!r}")
        for name in ("stream_resume_seconds", "stream_ttl_seconds", "stream_stall_seconds",
                     "sse_keepalive_seconds", "stream_max_events", "admission_wait_seconds",
                     "response_ttl_seconds",
                     "max_request_bytes", "drain_seconds", "prefill_timeout_seconds",
                     "prefill_attempts", "decode_stall_seconds", "decode_first_token_seconds",
                     "decode_exclude_seconds", "decode_place_wait_seconds"):
            _check_positive(name, getattr(self, name))
        _check_port("port", self.port)
        _check_port("grpc_port", self.grpc_port)
        _check_port("metrics_port", self.metrics_port)
        if self.metrics_port and self.metrics_port in (self.port, self.grpc_port):
            raise ValueError(f"metrics_port {self.metrics_port} is the edge's HTTP or gRPC port")
        _check_positive("max_model_len", self.max_model_len)
        if self.min_prefill_workers < 0 or self.min_decode_workers < 1:
            raise ValueError("min_prefill_workers must be >= 0 and min_decode_workers >= 1")
        _check_positive("request_timeout_seconds", self.request_timeout_seconds)
        if self.max_migrations < 0:
            raise ValueError("max_migrations must be >= 0")
        if self.decode_window_bytes < 0:
            raise ValueError("decode_window_bytes must be >= 0 (0: gRPC's own windows)")
        if self.embedded_router is None:
            routers.channel_target(self.router)      # ValueError naming a bad entry
        if self.decode_calls not in ("per-request", "batched"):
            raise ValueError(f"decode_calls must be per-request or batched, "
                             f"got {self.decode_calls!r}")

    @property
    def name(self) -> str:
        """The model name clients use (`model` in requests)."""
        return self.served_model_name or self.model
