"""KV-cache transfer between prefill and decode workers."""
