"""A worker's vLLM engine (`AsyncLLM`), built from pdserve's config.

Prefill and decode workers each own exactly one engine; vLLM's engine-protocol
servicer (`engine_protocol.py`) runs requests on it. Token ids in, token ids
out; everything HTTP/OpenAI shaped stays at the edge.
"""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from pdserve.config import EngineConfig, KVTransferConfig
from pdserve.transfer.connector import LEASE_EXTENSION, engine_kv_config
from pdserve.transfer.metrics import record_connector_stats

log = logging.getLogger(__name__)


def kv_events_path(pid: int | None = None) -> str:
    """The Unix socket this process's engine publishes its KV-cache events on.

    vLLM's publisher binds only wildcard TCP addresses (all interfaces) and ipc/inproc
    ones; `tcp://127.0.0.1:PORT` makes it *connect*, and then the servicer's
    subscriber, which connects too, never hears an event. A socket file keeps the
    feed on this machine without opening a port. The gRPC servicer relays the
    events to the router (`SubscribeKvEvents`). `pid`: the worker process (this one)."""
    return f"{tempfile.gettempdir()}/pdserve-kv-events-{pid or os.getpid()}"


def engine_args(cfg: EngineConfig, role: str, kv: KVTransferConfig | None) -> dict:
    """`AsyncEngineArgs`' keyword arguments for `cfg`, all but the KV-event publisher
    (`kv_events_config`, a vLLM object the engine adds): no vLLM import, no engine."""
    return dict(
        model=cfg.model,
        served_model_name=[cfg.name],
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        enforce_eager=cfg.enforce_eager,
        block_size=cfg.block_size,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        enable_chunked_prefill=cfg.enable_chunked_prefill,
        max_num_seqs=cfg.max_num_seqs,
        seed=cfg.seed,
        tensor_parallel_size=cfg.tensor_parallel_size,
        # Prefix caching on both roles: a prefill engine computes only a
        # later turn's new tokens, and a decode engine keeps the blocks of
        # earlier turns, so a P/D pull moves only the blocks it lacks.
        enable_prefix_caching=True,
        kv_transfer_config=engine_kv_config(role, kv) if kv else None,
        # Lease control beside vLLM's model workers (transfer/leases.py).
        worker_extension_cls=LEASE_EXTENSION if kv else "",
        **({"kv_cache_memory_bytes": cfg.kv_cache_bytes} if cfg.device == "cpu"
           else {"gpu_memory_utilization": cfg.gpu_memory_utilization}),
    )


class VllmEngine:
    """One in-process vLLM v1 engine (`AsyncLLM`) configured for a worker role."""

    def __init__(self, cfg: EngineConfig, role: str, kv: KVTransferConfig | None):
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from .salted_blocks import install
        install()           # an engine core forked from here inherits it (else: the plugin)
        self.kv_events_path = kv_events_path()
        # Stored/evicted blocks are published for the router's prefix index (on
        # this machine only, see kv_events_path).
        args = AsyncEngineArgs(
            **engine_args(cfg, role, kv),
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq",
                endpoint=f"ipc://{self.kv_events_path}"))
        self.cfg = cfg
        self.llm = AsyncLLM.from_engine_args(args, stat_loggers=[_scheduler_snapshot()])
        log.info("engine ready: model=%s role=%s dtype=%s", cfg.name, role, cfg.dtype)

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (idempotent)."""
        await self.llm.abort(request_id)

    def shutdown(self) -> None:
        """Stop the engine core process (idempotent)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            Path(self.kv_events_path).unlink(missing_ok=True)   # ZMQ leaves it behind
            llm.shutdown()
            # NOTE: dropping the last reference here runs AsyncLLM.__del__ (which
            # shuts down again) while modules are alive, not at interpreter exit.
            del llm


def _scheduler_snapshot():
    """A stat logger that keeps each engine step's `SchedulerStats` and logs
    nothing. vLLM's servicer reads the engine's load (running, waiting, KV usage:
    GetLoads and the load record on the KV-event stream) from such a snapshot,
    and vLLM creates its own logging one only when its logger is at INFO; pdserve
    runs vLLM at WARNING, which left every reported load at zero. It also feeds
    the connector's transfer statistics to the worker's `pdserve:kv_*` series."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SchedulerSnapshot(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index
            self.last_scheduler_stats = None

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                   engine_idx: int = 0):
            if scheduler_stats is not None:
                self.last_scheduler_stats = scheduler_stats
                if scheduler_stats.kv_connector_stats:
                    record_connector_stats(scheduler_stats.kv_connector_stats)

        def log_engine_initialized(self):
            pass

    return SchedulerSnapshot
