"""The kvcache store's storage engine: immutable KV blocks by (layout_id, block_hash), RAM then disk, TTL since use.

Torch-free. This part: the on-disk format (`records`), rebuilding from a segment (`scan`), the segment files
(`segments`) and the knobs (`settings`).
"""
