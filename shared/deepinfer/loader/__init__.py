"""Checkpoint loaders: `hf` (safetensors directories), `gguf`, `dummy` (random weights) and `shard` (one
tensor-parallel rank's slice of either).

Importing this package imports neither torch nor numpy; each loader module is imported on its own.
"""
