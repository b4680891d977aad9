"""A hand-driven paged cache for model parity tests: ragged batches straight through a model's forward."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.kernels import build_attention_metadata


@dataclass
class PagedCache:
    """Per-layer caches (K/V or MLA latent rows, as the model's config says) filled with junk, so every slot a
    step reads must have been written first; blocks are handed out in order from 1 (0 is the padding block)."""

    kv_caches: list[torch.Tensor]
    block_size: int
    next_block: int = 1
    block_tables: dict[int, list[int]] = field(default_factory=dict)

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_blocks: int, block_size: int,
                  num_layers: int | None = None) -> PagedCache:
        """One cache of `num_blocks` blocks per layer (num_layers: e.g. one more for an MTP layer)."""
        c = model.config
        shape = c.kv_cache_shape(num_blocks, block_size)
        return cls([torch.randn(shape) * 10 for _ in range(num_layers or c.num_hidden_layers)], block_size)

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Slots of positions start..end-1 of a sequence, allocating blocks as needed."""
        table = self.block_tables.setdefault(seq_id, [])
        while len(table) * self.block_size < end:
            table.append(self.next_block)
            self.next_block += 1
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]

    def inputs(self, chunks: list[tuple[int, list[int], int]]):
        """(input_ids, positions, metadata) of a ragged batch of (seq_id, new token ids, first position)."""
        input_ids, positions, slot_mapping = [], [], []
        for seq_id, token_ids, start in chunks:
            input_ids += token_ids
            positions += range(start, start + len(token_ids))
            slot_mapping += self.slots(seq_id, start, start + len(token_ids))
        meta = build_attention_metadata(
            query_lens=[len(t) for _, t, _ in chunks],
            seq_lens=[start + len(t) for _, t, start in chunks],
            block_tables=[self.block_tables[seq_id] for seq_id, _, _ in chunks],
            slot_mapping=slot_mapping,
        )
        return torch.tensor(input_ids), torch.tensor(positions), meta

    def step(self, model: torch.nn.Module, chunks: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """One forward over a ragged batch; float32 logits per chunk."""
        input_ids, positions, meta = self.inputs(chunks)
        with torch.no_grad():
            logits = model.compute_logits(model(input_ids, positions, self.kv_caches, meta))
        return list(logits.split([len(t) for _, t, _ in chunks]))


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor, what: str, *, rel_tol: float) -> None:
    """Elementwise error within rel_tol of the largest reference logit."""
    assert ours.shape == ref.shape, f"{what}: shapes {tuple(ours.shape)} vs {tuple(ref.shape)}"
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= rel_tol * scale, f"{what}: max error {err:.3g} > {rel_tol} * max|logit| {scale:.3g}"


def random_prompt(length: int, seed: int, vocab_size: int) -> list[int]:
    """Random token ids, avoiding the special tokens 0..3."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab_size, (length,), generator=generator).tolist()
