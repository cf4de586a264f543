"""A worker's vLLM engine: build it from config, run one request, abort one.

Prefill and decode workers each own exactly one `LLMEngine`. It speaks token
ids in and token ids (+ detokenized text) out; everything HTTP/OpenAI shaped
stays at the edge.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from pdserve.config import EngineConfig, KVTransferConfig
from pdserve.v1 import common_pb2
from transfer.connector import engine_kv_config

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStep:
    """What one engine iteration produced for one request (a delta)."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None       # "stop" | "length" | "abort" | None
    stop_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int           # local prefix hits + KV pulled from prefill
    kv_transfer_params: dict[str, Any] | None


def sampling_from_proto(p: common_pb2.SamplingParams, *, max_tokens: int | None = None,
                        kv_transfer_params: dict[str, Any] | None = None):
    """vLLM SamplingParams from the wire form (validated at the edge)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=p.top_k if p.top_k > 0 else 0,
        max_tokens=max_tokens if max_tokens is not None else (p.max_tokens or 16),
        seed=p.seed if p.HasField("seed") else None,
        stop=list(p.stop) or None,
        stop_token_ids=list(p.stop_token_ids) or None,
        ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra,
    )


class VllmEngine:
    """One in-process vLLM v1 engine (`AsyncLLM`) configured for a worker role."""

    def __init__(self, cfg: EngineConfig, role: str, kv: KVTransferConfig | None):
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
            # NOTE: prefix caching stays off on a P/D pair: a decode engine
            # would otherwise hash blocks it received, not blocks it computed.
            enable_prefix_caching=False,
            kv_transfer_config=engine_kv_config(role, kv) if kv else None,
            **({"kv_cache_memory_bytes": cfg.kv_cache_bytes} if cfg.device == "cpu"
               else {"gpu_memory_utilization": cfg.gpu_memory_utilization}),
        )
        self.cfg = cfg
        self.llm = AsyncLLM.from_engine_args(args)
        log.info("engine ready: model=%s role=%s dtype=%s", cfg.name, role, cfg.dtype)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling) -> AsyncIterator[EngineStep]:
        """Run one request; yields deltas until it finishes. Cancelling aborts it."""
        from vllm.inputs import TokensPrompt

        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt_token_ids),
                                           sampling, request_id):
            c = out.outputs[0]
            yield EngineStep(
                token_ids=list(c.token_ids), text=c.text, finished=out.finished,
                finish_reason=c.finish_reason if out.finished else None,
                stop_reason=c.stop_reason if isinstance(c.stop_reason, str) else None,
                num_prompt_tokens=len(prompt_token_ids),
                num_cached_tokens=out.num_cached_tokens or 0,
                kv_transfer_params=out.kv_transfer_params,
            )

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
