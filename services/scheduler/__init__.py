"""Scheduler: routes requests to (prefill, decode) pairs from a global KV-block index."""
