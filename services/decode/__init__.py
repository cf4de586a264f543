"""Decode workers: pull a prompt's KV (or prefill locally) and stream tokens."""
