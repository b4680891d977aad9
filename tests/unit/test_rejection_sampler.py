"""Rejection sampling of drafts (deepinfer.sampling.rejection): emitted tokens follow the target distribution.

A statistical test on a 5-token vocabulary: N independent requests each verify k = 2 drafts drawn from the draft
distribution q; the emitted token at each position, among the requests that reach it, must follow p. Each
frequency is checked against Hoeffding's bound |f - p| <= sqrt(ln(2 / d) / (2 n)) with d = DELTA / (number of
checks), so an exact sampler fails the test with probability at most DELTA = 1e-6 (the union bound; the generator
is seeded, so the run itself is deterministic). The distributions are chosen far enough apart that a sampler
emitting the drafts unverified, or resampling from p instead of max(0, p - q), fails by many bounds.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.sampling.rejection import accepted_prefix, rejection_sample

N, V, K = 200_000, 5, 2
DELTA = 1e-6
P = torch.tensor([[0.50, 0.20, 0.15, 0.10, 0.05],
                  [0.05, 0.05, 0.60, 0.20, 0.10],
                  [0.10, 0.30, 0.10, 0.30, 0.20]])  # [K + 1, V]: target at each position (the last: bonus)
Q = torch.tensor([[0.10, 0.50, 0.10, 0.20, 0.10],
                  [0.30, 0.10, 0.30, 0.10, 0.20]])  # [K, V]: draft distribution at each position


def hoeffding(n: int, num_checks: int) -> float:
    return math.sqrt(math.log(2 * num_checks / DELTA) / (2 * n))


def draw(draft_probs: torch.Tensor | None, draft_token_ids: torch.Tensor, generator: torch.Generator):
    uniforms = torch.rand(N, K, generator=generator)
    noise = -torch.rand(N, K + 1, V, generator=generator).clamp_(min=1e-12).log()
    target = P.expand(N, K + 1, V).contiguous()
    return rejection_sample(target, draft_token_ids, draft_probs, uniforms, noise)


def check_positions(token_ids: torch.Tensor, num_emitted: torch.Tensor) -> list[int]:
    """Assert every position's emitted tokens follow P; the number of requests that reached each position."""
    num_checks = (K + 1) * V
    reached = []
    for j in range(K + 1):
        rows = token_ids[num_emitted > j, j]
        n = rows.numel()
        reached.append(n)
        freq = torch.bincount(rows, minlength=V).double() / n
        bound = hoeffding(n, num_checks)
        assert (freq - P[j].double()).abs().max().item() <= bound, (j, freq, P[j], bound)
    return reached


def test_drafts_from_q_emit_tokens_distributed_as_p():
    generator = torch.Generator().manual_seed(0)
    draft_token_ids = torch.multinomial(Q, N, replacement=True, generator=generator).T.contiguous()  # [N, K]
    token_ids, num_emitted = draw(Q.expand(N, K, V).contiguous(), draft_token_ids, generator)
    assert ((num_emitted >= 1) & (num_emitted <= K + 1)).all()
    assert (token_ids[torch.arange(K + 1) >= num_emitted.unsqueeze(1)] == -1).all()
    reached = check_positions(token_ids, num_emitted)
    # Acceptance at position 0 is sum(min(p, q)) (Leviathan et al., Theorem 3.5).
    accept_0 = torch.minimum(P[0], Q[0]).sum().item()
    assert abs(reached[1] / N - accept_0) <= hoeffding(N, 1)
    # A sampler that emitted the drafts unverified would show Q at position 0: far past the bound.
    assert (P[0] - Q[0]).abs().max().item() > 20 * hoeffding(N, (K + 1) * V)


def test_one_hot_drafts_accept_with_p_of_the_draft():
    generator = torch.Generator().manual_seed(1)
    draft_token_ids = torch.tensor([[2, 0]]).expand(N, K).contiguous()  # a drafter with no distribution
    token_ids, num_emitted = draw(None, draft_token_ids, generator)
    reached = check_positions(token_ids, num_emitted)
    assert abs(reached[1] / N - P[0, 2].item()) <= hoeffding(N, 2)
    assert abs(reached[2] / reached[1] - P[1, 0].item()) <= hoeffding(reached[1], 2)


def test_equal_distributions_accept_every_draft():
    generator = torch.Generator().manual_seed(2)
    target = P[:1].expand(4, 2, V).contiguous()
    draft_token_ids = torch.tensor([[0], [1], [3], [4]])
    token_ids, num_emitted = rejection_sample(
        target, draft_token_ids, P[:1].expand(4, 1, V).contiguous(), torch.rand(4, 1, generator=generator),
        -torch.rand(4, 2, V, generator=generator).log())
    assert num_emitted.tolist() == [2, 2, 2, 2]
    assert token_ids[:, 0].tolist() == [0, 1, 3, 4]


@pytest.mark.parametrize(("drafts", "targets", "m"), [
    ([], [7], 0), ([1, 2, 3], [1, 2, 3, 4], 3), ([1, 2, 3], [1, 5, 3, 4], 1), ([1], [2, 1], 0),
])
def test_accepted_prefix(drafts, targets, m):
    assert accepted_prefix(drafts, targets) == m
