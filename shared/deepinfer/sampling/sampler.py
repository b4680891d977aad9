"""On-device sampler: penalties, greedy or counter-based random draw, raw logprobs; no host syncs.

`Sampler.forward` reads only host flags from `SamplingMetadata` to choose its stages; it never calls `.item()`,
`.tolist()` or `.cpu()`, nor branches on tensor values, so the CPU can queue the next step while the GPU runs this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.sampling.metadata import SamplingMetadata
from deepinfer.sampling.penalties import apply_penalties
from deepinfer.sampling.random import exponential_noise_from_keys


@dataclass
class SamplerOutput:
    """The sampled tokens of one step and their logprobs under the model's raw distribution."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, raw logprob of each sampled token
    top_logprob_ids: torch.Tensor | None  # [B, k] int64, k = meta.max_num_logprobs; None when k == 0
    top_logprobs: torch.Tensor | None  # [B, k] float32, descending


class Sampler(torch.nn.Module):
    """Samples one token per row of a [B, V] float32 logits tensor; see `forward` for the order of stages."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Raw logprobs → logit bias → penalties → grammar mask → greedy argmax / (temperature → top-k → top-p → min-p →
        softmax → exponential race with counter-based noise)."""
        logits = logits.float()
        # Raw logprobs, row by row: softmax kernels reduce each row on its own whatever the batch size, where a
        # generic reduction (logsumexp) may split differently per shape and break batch invariance by an ulp.
        raw_logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
        processed = apply_penalties(logits, meta)
        if meta.allowed is not None:  # structured output: only what each row's grammar allows next
            processed = processed.masked_fill(~meta.allowed, float("-inf"))
        if meta.any_random:
            probs = apply_sampling_filters(processed, meta)
            noise = exponential_noise_from_keys(meta.row_keys, logits.shape[-1])
            # argmax(p / E), E ~ Exp(1) i.i.d., picks token v with probability p[v] (exponential race).
            token_ids = probs.div_(noise).argmax(dim=-1)
            if meta.any_greedy:
                token_ids = torch.where(meta.is_greedy, processed.argmax(dim=-1), token_ids)
        else:
            token_ids = processed.argmax(dim=-1)
        logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        top_ids = top_logprobs = None
        if meta.max_num_logprobs > 0:
            top_logprobs, top_ids = raw_logprobs.topk(meta.max_num_logprobs, dim=-1)
        return SamplerOutput(token_ids, logprobs, top_ids, top_logprobs)


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax of float32 logits [B, V] and its raw logprob: the same kernels `Sampler.forward` runs for
    a greedy row without penalties or logit bias, so the same bits (the decode CUDA graphs capture this)."""
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    token_ids = logits.argmax(dim=-1)
    return token_ids, raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)


def apply_sampling_filters(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows draw from: temperature, top-k, top-p, min-p, softmax; [B, V] float32.

    Expects logits after `apply_penalties`. Top-k keeps every token tied with the k-th largest; top-p keeps the
    fewest most likely tokens whose mass reaches top_p (the most likely always stays); min-p keeps tokens with
    probability >= min_p * max probability. Rows with a stage off pass through it unchanged.
    """
    logits = logits / meta.temperature.unsqueeze(1)
    top_values = None
    if meta.need_top_k:
        logits, top_values = _apply_top_k(logits, meta.top_k, meta.max_top_k)
    if meta.need_top_p:
        if top_values is not None and meta.top_p_within_top_k:
            logits = _apply_top_p_in_top_k(logits, top_values, meta.top_p)
        else:
            logits = _apply_top_p(logits, meta.top_p)
    if meta.need_min_p:
        logits = _apply_min_p(logits, meta.min_p)
    return logits.softmax(dim=-1)


def _apply_top_k(
    logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked logits, and each row's top values ([B, max_top_k], descending, -inf past the row's k)."""
    top_values = logits.topk(max_top_k, dim=-1).values
    beyond_k = torch.arange(max_top_k, device=logits.device) >= top_k.unsqueeze(1)  # [B, max_top_k]
    kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))  # [B, 1]
    kth = kth.masked_fill((top_k >= logits.shape[-1]).unsqueeze(1), float("-inf"))  # top-k off: keep all
    return logits.masked_fill(logits < kth, float("-inf")), top_values.masked_fill(beyond_k, float("-inf"))


def _apply_top_p_in_top_k(logits: torch.Tensor, top_values: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # Every top-p row also has top-k, so its renormalised distribution lives in top_values: no full-vocab sort.
    probs = top_values.softmax(dim=-1)  # [B, max_top_k], descending
    mass_above = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    keep = (mass_above < top_p.unsqueeze(1)) & (top_values > float("-inf"))
    keep[:, 0] = True
    threshold = top_values.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)  # smallest kept logit
    threshold = threshold.masked_fill((top_p >= 1).unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1)  # ascending: [B, V]
    cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    # Dropping tokens 0..j (ascending) leaves mass 1 - cumulative[j]; drop while that is still >= top_p.
    drop = cumulative <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # p[v] >= min_p * p_max  <=>  logit[v] >= max_logit + log(min_p): no softmax needed; min_p = 0 gives -inf.
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))
