"""KV block identity shared by every service: `deepinfer.kvcache.hashing` (torch-free)."""
