"""Multi-process tensor-parallel execution: spawn ranks 1..N-1, load every rank's shard, drive them from rank 0.

Sits above `deepinfer.loader` (the ranks load their shards) and below `deepinfer.engine` (whose EngineCore
starts it); the primitives it runs on (process group, parallel layers) are in `deepinfer.distributed`.
"""
