"""Probes of the KV tiers: device pool, host tier, kvcache store, shared memory, write-behind."""
