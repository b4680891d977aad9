"""A model config on one tensor-parallel rank: its heads, its config view, and the projections built for it.

`deepinfer.distributed` holds the parallel modules and the index arithmetic over plain ints; this module
applies them to a `ModelConfig`. Each factory returns a plain `nn.Linear` / `nn.Embedding` on one rank and
the parallel module otherwise, so the single-rank model is exactly what it was without tensor parallelism.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from deepinfer.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from deepinfer.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from deepinfer.distributed.sharding import ColumnShard, HeadShard, divide, even_shards, head_shard
from deepinfer.models.config import ModelConfig


def config_head_shard(config: ModelConfig, tp_size: int, rank: int) -> HeadShard:
    """`head_shard` of a model config."""
    return head_shard(config.num_attention_heads, config.num_kv_heads, tp_size, rank)


def qkv_shards(config: ModelConfig, tp_size: int, rank: int) -> tuple[ColumnShard, ...]:
    """q/k/v slices of the fused qkv_proj on this rank (rows are heads * head_dim)."""
    heads, d = config_head_shard(config, tp_size, rank), config.head_dim
    q_rows, kv_rows = config.num_attention_heads * d, config.num_kv_heads * d
    return (
        ColumnShard("q_proj", q_rows, heads.q_start * d, heads.num_q_heads * d),
        ColumnShard("k_proj", kv_rows, heads.kv_start * d, heads.num_kv_heads * d),
        ColumnShard("v_proj", kv_rows, heads.kv_start * d, heads.num_kv_heads * d),
    )


def shard_config(config: ModelConfig, tp_size: int, rank: int = 0) -> ModelConfig:
    """The geometry one rank holds: its query heads, KV heads (the cache's head count) and MLP columns;
    vocabulary and hidden size stay whole. Sizes the rank's KV cache and activations."""
    if tp_size == 1:
        return config
    heads = config_head_shard(config, tp_size, rank)
    return replace(
        config,
        num_attention_heads=heads.num_q_heads,
        num_key_value_heads=heads.num_kv_heads,
        intermediate_size=divide(config.intermediate_size, tp_size, "intermediate_size"),
    )


# -- factories: a plain nn.Linear / nn.Embedding on one rank, the parallel module otherwise ---------------------
def qkv_projection(config: ModelConfig, bias: bool, tp: TensorParallelGroup = SINGLE_RANK) -> nn.Module:
    """The fused q/k/v projection holding this rank's heads."""
    parts = qkv_shards(config, tp.world_size, tp.rank)
    if tp.world_size == 1:
        return nn.Linear(config.hidden_size, sum(p.rows for p in parts), bias=bias)
    return ColumnParallelLinear(config.hidden_size, parts, bias, tp)


def o_projection(config: ModelConfig, bias: bool, tp: TensorParallelGroup = SINGLE_RANK) -> nn.Module:
    """The attention output projection (row-parallel: one all-reduce)."""
    q_size = config.num_attention_heads * config.head_dim
    if tp.world_size == 1:
        return nn.Linear(q_size, config.hidden_size, bias=bias)
    return RowParallelLinear(q_size, config.hidden_size, bias, tp)


def gate_up_projection(config: ModelConfig, tp: TensorParallelGroup = SINGLE_RANK) -> nn.Module:
    """The fused gate/up projection holding this rank's MLP columns."""
    if tp.world_size == 1:
        return nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
    parts = even_shards(("gate_proj", "up_proj"), config.intermediate_size, tp.world_size, tp.rank)
    return ColumnParallelLinear(config.hidden_size, parts, False, tp)


def down_projection(config: ModelConfig, tp: TensorParallelGroup = SINGLE_RANK) -> nn.Module:
    """The MLP output projection (row-parallel: one all-reduce)."""
    if tp.world_size == 1:
        return nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
    return RowParallelLinear(config.intermediate_size, config.hidden_size, False, tp)


def token_embedding(config: ModelConfig, tp: TensorParallelGroup = SINGLE_RANK) -> nn.Module:
    """The input embedding, split by vocabulary over the ranks."""
    if tp.world_size == 1:
        return uninitialized_embedding(config.vocab_size, config.hidden_size)
    return VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)


def uninitialized_embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """An nn.Embedding whose weight is left uninitialised, as VocabParallelEmbedding's: the checkpoint fills it.
    Its default init (normal_) on the meta device, where models are built, imports torch._dynamo: ~1 s of CPU
    in every worker's start, for a value that is then overwritten."""
    return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))


def lm_head(config: ModelConfig, tp: TensorParallelGroup = SINGLE_RANK) -> nn.Module:
    """The untied output projection, split by vocabulary over the ranks."""
    if tp.world_size == 1:
        return nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    return ParallelLMHead(config.vocab_size, config.hidden_size, tp)
