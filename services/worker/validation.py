"""Checks a worker applies to every request before it reaches the engine.

The edge validates user input; these guard the gRPC surface itself, which
internal callers reach directly. A failure is INVALID_ARGUMENT, never a crash.
"""
from __future__ import annotations

import grpc

from pdserve.v1 import common_pb2


async def check_prompt(context, token_ids, max_model_len: int, vocab_size: int,
                       sampling: common_pb2.SamplingParams) -> None:
    """Abort the call with INVALID_ARGUMENT when the request cannot run."""
    problem = None
    if not token_ids:
        problem = "prompt_token_ids is empty"
    elif len(token_ids) >= max_model_len:
        problem = f"prompt has {len(token_ids)} tokens; the model's context is {max_model_len}"
    elif max(token_ids) >= vocab_size:
        problem = f"token id {max(token_ids)} is outside the vocabulary ({vocab_size})"
    elif sampling.max_tokens == 0:
        problem = "sampling.max_tokens must be >= 1"
    elif sampling.temperature < 0 or not 0 <= sampling.top_p <= 1:
        problem = "sampling temperature must be >= 0 and top_p in [0, 1]"
    if problem:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
