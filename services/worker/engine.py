"""A worker's vLLM engine (`AsyncLLM`), built from pdserve's config.

Prefill and decode workers each own exactly one engine; vLLM's engine-protocol
servicer (`engine_protocol.py`) runs requests on it. Token ids in, token ids
out; everything HTTP/OpenAI shaped stays at the edge.
"""
from __future__ import annotations

import logging

from pdserve.config import EngineConfig, KVTransferConfig
from transfer.connector import engine_kv_config

log = logging.getLogger(__name__)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmEngine:
    """One in-process vLLM v1 engine (`AsyncLLM`) configured for a worker role."""

    def __init__(self, cfg: EngineConfig, role: str, kv: KVTransferConfig | None,
                 kv_events_port: int = 0):
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=cfg.model,
            served_model_name=[cfg.name],
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            enforce_eager=cfg.enforce_eager,
            max_num_seqs=cfg.max_num_seqs,
            seed=cfg.seed,
            tensor_parallel_size=cfg.tensor_parallel_size,
            # Prefix caching on the prefill engines: a later turn computes only its
            # new tokens. NOTE: off on decode engines for now: with it on, two
            # concurrent requests pulling the same prompt's blocks over NIXL gave
            # wrong tokens (tests/e2e/test_disaggregated_path.py, the concurrent
            # streams test, fails). Stored/evicted blocks are published for the
            # router's prefix index (loopback only).
            enable_prefix_caching=role == "prefill",
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq",
                endpoint=f"tcp://127.0.0.1:{kv_events_port or _free_port()}"),
            kv_transfer_config=engine_kv_config(role, kv) if kv else None,
            **({"kv_cache_memory_bytes": cfg.kv_cache_bytes} if cfg.device == "cpu"
               else {"gpu_memory_utilization": cfg.gpu_memory_utilization}),
        )
        self.cfg = cfg
        self.llm = AsyncLLM.from_engine_args(args)
        log.info("engine ready: model=%s role=%s dtype=%s", cfg.name, role, cfg.dtype)

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (idempotent)."""
        await self.llm.abort(request_id)

    def shutdown(self) -> None:
        """Stop the engine core process (idempotent)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()
            # NOTE: dropping the last reference here runs AsyncLLM.__del__ (which
            # shuts down again) while modules are alive, not at interpreter exit.
            del llm
