"""Prefill worker: computes prompts (reusing cached prefixes) and hands off KV under a lease."""
