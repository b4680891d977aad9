"""Tensor-parallel linears and embeddings (`deepinfer.models.parallel` builds them from a model config).

Per decoder block there is one all-reduce after attention (o_proj) and one after the MLP (down_proj):

    x ─▶ qkv_proj (column: this rank's heads) ─▶ attention ─▶ o_proj (row) ─▶ all-reduce ─▶ ...
    x ─▶ gate_up_proj (column: this rank's columns) ─▶ silu·mul ─▶ down_proj (row) ─▶ all-reduce

Every module keeps its parameters under the names of the single-rank model (`weight`, `bias`), so state-dict
keys are the same at any tp_size. Two ways to fill them:
- `load_part(leaf, part, tensor)`: one Hugging Face tensor, whole (e.g. `k_proj.weight`); the module keeps its
  own slice.
- `load_full(leaf, tensor)`: our own fused tensor of the single-rank model (e.g. the whole `qkv_proj.weight`).
Linears call F.linear, so the runner's batch-invariant linear mode applies to them as well.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.distributed.parallel_state import TensorParallelGroup
from deepinfer.distributed.sharding import ColumnShard, vocab_range


def _check_shape(what: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"shape mismatch for {what}: checkpoint has {tuple(tensor.shape)}, model expects {expected}")


def _param(module: nn.Module, leaf: str) -> torch.Tensor:
    param = getattr(module, leaf, None)
    if not isinstance(param, torch.Tensor):
        raise ValueError(f"{type(module).__name__} has no parameter {leaf!r}")
    return param.data


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's output rows split over the ranks; each rank returns its columns of y, or all of
    them (gathered in rank order) with `gather_output`. A merged linear stacks several HF tensors (`parts`)."""

    def __init__(
        self,
        input_size: int,
        parts: Sequence[ColumnShard],
        bias: bool,
        tp: TensorParallelGroup,
        gather_output: bool = False,
    ) -> None:
        super().__init__()
        if gather_output and len(parts) > 1:
            raise ValueError("gather_output would interleave the parts of a merged linear")
        self.input_size = input_size
        self.parts = tuple(parts)
        self.tp = tp
        self.gather_output = gather_output
        local_rows = sum(p.rows for p in self.parts)
        self.weight = nn.Parameter(torch.empty(local_rows, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(local_rows), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, input_size] -> [T, local rows] (or [T, all rows] with gather_output)."""
        y = F.linear(x, self.weight, self.bias)
        return self.tp.all_gather(y, dim=-1) if self.gather_output else y

    def load_part(self, leaf: str, part: str, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of the whole HF tensor `part` (e.g. "k_proj") into `leaf` (weight or bias)."""
        offset = 0
        for p in self.parts:
            if p.name == part:
                _check_shape(f"{part}.{leaf}", tensor, (p.full_rows, *_param(self, leaf).shape[1:]))
                _param(self, leaf).narrow(0, offset, p.rows).copy_(tensor.narrow(0, p.start, p.rows))
                return
            offset += p.rows
        raise ValueError(f"{part!r} is not a part of this linear ({', '.join(p.name for p in self.parts)})")

    def load_full(self, leaf: str, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of the single-rank model's whole (fused) tensor into `leaf`."""
        _check_shape(leaf, tensor, (sum(p.full_rows for p in self.parts), *_param(self, leaf).shape[1:]))
        for part, full in zip(self.parts, tensor.split([p.full_rows for p in self.parts]), strict=True):
            self.load_part(leaf, part.name, full)


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's input columns split over the ranks: each rank multiplies its slice of x, one
    all-reduce sums the partial products, the bias is added once after it."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        self.local_input_size = input_size // tp.world_size
        if self.local_input_size * tp.world_size != input_size:
            raise ValueError(f"input_size={input_size} is not divisible by tensor_parallel_size={tp.world_size}")
        self.weight = nn.Parameter(torch.empty(output_size, self.local_input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, input_size / tp] (this rank's columns) -> [T, output_size], the same on every rank."""
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def load_part(self, leaf: str, part: str, tensor: torch.Tensor) -> None:
        """Copy this rank's input columns of the whole HF tensor (the bias whole)."""
        if leaf == "bias":
            _check_shape(f"{part}.bias", tensor, (self.output_size,))
            _param(self, leaf).copy_(tensor)
            return
        _check_shape(f"{part}.{leaf}", tensor, (self.output_size, self.input_size))
        start = self.tp.rank * self.local_input_size
        _param(self, leaf).copy_(tensor.narrow(1, start, self.local_input_size))

    def load_full(self, leaf: str, tensor: torch.Tensor) -> None:
        """Same as load_part: a row-parallel linear is never fused."""
        self.load_part(leaf, "", tensor)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over the ranks by token id; ids outside a rank's range embed as zero there and
    one all-reduce assembles every row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.vocab_start, self.num_valid, rows = vocab_range(vocab_size, tp.world_size, tp.rank)
        # Rows past num_valid pad the last ranks' shards to one shape; they stay zero.
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden], the same on every rank."""
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_valid)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(~mine.unsqueeze(-1), 0.0))

    def load_part(self, leaf: str, part: str, tensor: torch.Tensor) -> None:
        """Copy this rank's vocabulary rows of the whole [vocab, hidden] tensor; padding rows become zero."""
        _check_shape(f"{part}.{leaf}", tensor, (self.vocab_size, self.hidden_size))
        weight = _param(self, leaf)
        weight.zero_()
        weight.narrow(0, 0, self.num_valid).copy_(tensor.narrow(0, self.vocab_start, self.num_valid))

    def load_full(self, leaf: str, tensor: torch.Tensor) -> None:
        """Same as load_part (the embedding is never fused)."""
        self.load_part(leaf, "", tensor)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary like the embedding; logits are gathered on every rank."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead projects hidden states: call compute_logits")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        return parallel_logits(hidden, self.weight, self.tp, self.vocab_size)


def parallel_logits(
    hidden: torch.Tensor, weight: torch.Tensor, tp: TensorParallelGroup, vocab_size: int
) -> torch.Tensor:
    """hidden [N, hidden] times this rank's vocabulary rows, gathered over the ranks -> [N, vocab] float32."""
    logits = F.linear(hidden, weight).float()  # [N, rows_per_rank]
    return tp.all_gather(logits, dim=-1)[:, :vocab_size]

