"""KV cache store shard: content-addressed KV blocks in RAM then disk, 72 h TTL."""
