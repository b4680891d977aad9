"""kvcache: one shard of the content-addressed KV store (RAM, then disk), served on the data plane."""
