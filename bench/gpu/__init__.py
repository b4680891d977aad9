"""Probes of the engine on one GPU: prefill/decode vs transformers, graphs, MoE tiles, step host time."""
