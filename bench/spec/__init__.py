"""Speculative decoding probes."""
