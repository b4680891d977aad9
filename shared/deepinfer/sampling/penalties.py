"""Logit bias and repetition / presence / frequency penalties, applied to every row (greedy ones included)."""

from __future__ import annotations

import torch

from deepinfer.sampling.metadata import SamplingMetadata


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Logit bias, then penalties (vLLM's order); returns a new [B, V] tensor and leaves `logits` as it was.

    repetition (tokens seen in prompt or output): positive logits divided by it, negative ones multiplied;
    frequency / presence (output tokens only): subtract penalty * count, and penalty * (count > 0).
    Rows with neutral values come out bit-identical.
    """
    if meta.logit_bias is not None:
        logits = logits + meta.logit_bias
    if not meta.need_penalties:
        return logits
    assert meta.prompt_mask is not None and meta.output_counts is not None
    counts = meta.output_counts.to(logits.dtype)  # [B, V]
    seen = meta.prompt_mask | (meta.output_counts > 0)
    repetition = meta.repetition_penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    logits = logits - meta.frequency_penalty.unsqueeze(1) * counts
    return logits - meta.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
