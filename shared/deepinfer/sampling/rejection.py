"""Verification of draft tokens: the longest accepted prefix, and standard rejection sampling.

A request verifies k draft tokens d_0 .. d_{k-1} in one forward of k + 1 query positions; row j's target
distribution p_j is the model's next-token distribution after the context and d_0 .. d_{j-1}:

    fed        | last | d_0 | d_1 | ... | d_{k-1} |
    target     | p_0  | p_1 | p_2 | ... | p_k     |     p_k: the bonus position, reached when every draft is kept
    emitted    | d_0 .. d_{m-1} accepted, then one token from row m: m + 1 tokens (1 <= m + 1 <= k + 1)

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023): accept d_j with probability min(1, p_j(d_j) / q_j(d_j));
at the first rejection emit a token drawn from norm(max(0, p_j - q_j)) and stop; after k acceptances emit a bonus
token drawn from p_k. Every emitted token is then distributed as the target's, whatever q is.

A drafter without a distribution (n-gram lookup) has q_j = one-hot(d_j): accept with probability p_j(d_j), resample
from p_j with d_j removed. The engine realises exactly that by coupling (`accepted_prefix`): it draws t_j ~ p_j at
every row with the sampler's own noise for that (seed, position), as a non-speculative step would, and keeps d_j
while d_j == t_j. P(t_j == d_j) = p_j(d_j), and given t_j != d_j, t_j is p_j restricted to the other tokens,
renormalised = norm(max(0, p_j - one-hot(d_j))). So greedy and seeded requests emit the very tokens a
non-speculative run emits. `rejection_sample` is the general form, for drafters that have q.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accepted_prefix(draft_token_ids: Sequence[int], target_token_ids: Sequence[int]) -> int:
    """m: how many leading drafts equal the target's tokens of their rows (len(target) = len(draft) + 1); the
    request then emits target_token_ids[: m + 1]."""
    m = 0
    for draft, target in zip(draft_token_ids, target_token_ids, strict=False):
        if draft != target:
            break
        m += 1
    return m


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard rejection sampling of N requests' k drafts each (module docstring), on the device, no host sync.

    target_probs [N, k + 1, V] float32 (rows normalised), draft_token_ids [N, k] int64, draft_probs [N, k, V] or
    None (one-hot drafts), uniforms [N, k] in (0, 1) for the accept tests, noise [N, k + 1, V] Exp(1) draws for
    the resample and bonus draws (argmax(w / noise) draws from norm(w): the exponential race).
    Returns (token_ids [N, k + 1] int64, -1 past each request's emitted tokens; num_emitted [N] int64).
    """
    num_requests, k = draft_token_ids.shape
    p_draft = target_probs[:, :k].gather(2, draft_token_ids.unsqueeze(2)).squeeze(2)  # [N, k]
    if draft_probs is None:
        accept = uniforms < p_draft  # q = 1 at the draft
    else:
        q_draft = draft_probs.gather(2, draft_token_ids.unsqueeze(2)).squeeze(2)
        accept = uniforms * q_draft < p_draft  # u < p / q, without dividing by a q of 0
    # m = index of the first rejection (k when none): the count of leading accepts.
    num_accepted = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)  # [N]
    # The distribution row m draws from: norm(max(0, p - q)) at a rejection, p_k for the bonus.
    residual = target_probs.clone()
    if draft_probs is None:
        residual[:, :k].scatter_(2, draft_token_ids.unsqueeze(2), 0.0)
    else:
        residual[:, :k] = (target_probs[:, :k] - draft_probs).clamp_(min=0.0)
    # A residual of all zeros (p == q): any draw from p is exact, since rejection then has probability 0.
    empty = residual.sum(dim=2, keepdim=True) <= 0
    residual = torch.where(empty, target_probs, residual)
    drawn = (residual / noise).argmax(dim=2)  # [N, k + 1]: each row's draw, used only at row m
    padded = torch.cat([draft_token_ids, draft_token_ids.new_zeros(num_requests, 1)], dim=1)
    positions = torch.arange(k + 1, device=draft_token_ids.device)
    m = num_accepted.unsqueeze(1)
    token_ids = torch.where(positions < m, padded, drawn)
    token_ids = token_ids.masked_fill(positions > m, -1)
    return token_ids, num_accepted + 1
