"""Checkpoint loaders: `deepinfer.loader.hf` (safetensors directories) and `deepinfer.loader.gguf`.

Importing this package imports neither torch nor numpy; each loader module is imported on its own.
"""
