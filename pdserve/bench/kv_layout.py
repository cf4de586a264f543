"""How a model's KV cache lies in memory, as vLLM's NIXL connector posts it.

The connector registers one region per layer and cache (K and V), each an
array of fixed-size blocks, and moves a request's blocks with one descriptor
per block per region: `layers x 2 x blocks` descriptors of `block_bytes` each.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV-cache geometry of one model."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_tokens: int = 16          # vLLM's GPU default

    @property
    def regions(self) -> int:
        """Registered regions: a K and a V cache per layer."""
        return 2 * self.layers

    @property
    def block_bytes(self) -> int:
        """One block of one region: what one descriptor moves."""
        return self.block_tokens * self.kv_heads * self.head_dim * self.dtype_bytes

    def blocks(self, tokens: int) -> int:
        """Blocks a prompt of `tokens` fills (whole blocks only travel)."""
        return max(1, tokens // self.block_tokens)

    def bytes(self, tokens: int) -> int:
        """Bytes of KV cache for `tokens` tokens, every layer, K and V."""
        return self.regions * self.blocks(tokens) * self.block_bytes

    def describe(self) -> dict:
        return {"name": self.name, "layers": self.layers, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "dtype_bytes": self.dtype_bytes,
                "block_tokens": self.block_tokens, "block_bytes": self.block_bytes}


LAYOUTS = {
    # Llama-3.1-8B in bf16: 128 KiB of KV per token.
    "llama-3.1-8b": KVLayout("llama-3.1-8b", layers=32, kv_heads=8, head_dim=128, dtype_bytes=2),
    # Llama-3.1-70B in bf16 (80 layers): 320 KiB per token.
    "llama-3.1-70b": KVLayout("llama-3.1-70b", layers=80, kv_heads=8, head_dim=128,
                              dtype_bytes=2),
    # pdserve's generated test model in fp32, with vLLM's CPU block size.
    "tiny": KVLayout("tiny", layers=4, kv_heads=2, head_dim=64, dtype_bytes=4, block_tokens=128),
}
