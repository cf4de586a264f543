"""Prefill workers: compute a prompt's KV and first token, lease the blocks."""
