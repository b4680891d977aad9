"""Decode worker: pulls KV by handle and generates tokens in the running batch."""
