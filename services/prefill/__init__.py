"""Prefill worker: computes prompts, samples the first token, and leases the KV blocks to a decode worker."""
