"""Probes of the gateway: bursts, per-request and per-token CPU, admission, hostile clients."""
