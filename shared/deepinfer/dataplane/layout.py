"""The receiver's guard before a pull: a handle's KV layout must be exactly its own (docs/architecture.md §4)."""

from __future__ import annotations

from deepinfer.protocol.kv import KvHandle, KvLayout


class LayoutMismatch(ValueError):
    """A KvHandle's blocks are laid out differently from the receiver's cache: recompute, never pull."""


def check_layout(handle: KvHandle, own_layout: KvLayout) -> None:
    """Raise LayoutMismatch (naming both layouts) unless handle.layout_id is own_layout's id."""
    own_id = own_layout.layout_id()
    if handle.layout_id != own_id:
        theirs = handle.layout.model_dump(exclude={"v"})
        ours = own_layout.model_dump(exclude={"v"})
        raise LayoutMismatch(
            f"KV layout of {handle.owner_worker_id}'s handle for request {handle.request_id!r} "
            f"({handle.layout_id}: {theirs}) differs from this cache's ({own_id}: {ours})"
        )
