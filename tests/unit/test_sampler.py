"""Sampler against float64 NumPy references: filters, penalties, logprobs, counter-based draws, no host syncs."""

import ast
import inspect
import textwrap
from collections import Counter

import numpy as np
import pytest
import torch

from deepinfer.sampling import penalties as penalties_module
from deepinfer.sampling import random as random_module
from deepinfer.sampling import sampler as sampler_module
from deepinfer.sampling.metadata import SamplingMetadata
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.penalties import apply_penalties
from deepinfer.sampling.sampler import Sampler, apply_sampling_filters


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _build(params, vocab_size, *, positions=None, seeds=None, prompts=None, outputs=None, device="cpu", **kw):
    num_rows = len(params)
    seeds = seeds or [p.seed if p.seed is not None else 1000 + i for i, p in enumerate(params)]
    return SamplingMetadata.build(
        params, positions or list(range(num_rows)), seeds, prompts or [[]] * num_rows, outputs or [[]] * num_rows,
        vocab_size, device, **kw,
    )


def _softmax(z: np.ndarray, keep: np.ndarray) -> np.ndarray:
    e = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    return e / e.sum()


def _ref_filtered(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, float]:
    """Float64 reference of temperature → top-k → top-p → min-p; returns probs and the distance to a boundary."""
    z = logits.astype(np.float64) / p.temperature
    keep = np.ones(z.shape, dtype=bool)
    margin = np.inf
    if p.top_k > 0:
        keep &= z >= np.sort(z)[::-1][min(p.top_k, z.size) - 1]
    probs = _softmax(z, keep)
    if p.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        mass_above = np.cumsum(probs[order]) - probs[order]  # mass of the strictly more likely tokens
        keep[order[mass_above >= p.top_p]] = False  # keep a token while the ones above it fall short of top_p
        margin = min(margin, np.abs(mass_above[probs[order] > 0] - p.top_p).min())
        probs = _softmax(z, keep)
    if p.min_p > 0:
        ratio = probs / probs.max()
        margin = min(margin, np.abs(ratio[keep] - p.min_p).min())
        keep &= ratio >= p.min_p
        probs = _softmax(z, keep)
    return probs, margin


_FILTER_CASES = [
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=20, top_p=0.7),
    dict(temperature=0.6, top_k=30, top_p=0.9, min_p=0.05),
    dict(temperature=1.1),
    dict(temperature=0.8, top_p=0.3, min_p=0.2),
    dict(temperature=0.5, top_k=1000),  # k >= V: off
    dict(temperature=0.0, top_k=3),  # greedy row mixed in
]


# Every top-p row also has top-k: top-p runs on the top-k values instead of a full sort.
_FILTER_CASES_TOP_P_IN_TOP_K = [
    dict(temperature=0.9, top_k=20, top_p=0.7),
    dict(temperature=0.6, top_k=30, top_p=0.9, min_p=0.05),
    dict(temperature=1.2, top_k=8),
    dict(temperature=1.1, min_p=0.1),
    dict(temperature=0.7, top_k=60, top_p=0.5),
    dict(temperature=1.0),
    dict(temperature=0.0, top_p=0.5),
]


def _filter_batch(cases: list[dict], vocab_size: int, seed: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    """Random logits and params, re-drawn until no row sits within 1e-4 of a mask boundary."""
    rng = np.random.default_rng(seed)
    while True:
        logits = torch.from_numpy(rng.normal(0, 2, (len(cases), vocab_size)).astype(np.float32))
        params = [SamplingParams(**case) for case in cases]
        margins = [_ref_filtered(row.numpy(), p)[1] for row, p in zip(logits, params, strict=True) if not p.is_greedy]
        if min(margins) > 1e-4:
            return logits, params


@pytest.mark.parametrize("vocab_size", [64, 1000])
@pytest.mark.parametrize("top_p_within_top_k", [False, True])
def test_filters_match_float64_reference_exactly_in_support(vocab_size: int, top_p_within_top_k: bool) -> None:
    cases = _FILTER_CASES_TOP_P_IN_TOP_K if top_p_within_top_k else _FILTER_CASES
    logits, params = _filter_batch(cases, vocab_size, seed=vocab_size)
    meta = _build(params, vocab_size)
    assert meta.need_top_k and meta.need_top_p and meta.need_min_p and meta.any_greedy
    assert meta.top_p_within_top_k == top_p_within_top_k
    probs = apply_sampling_filters(logits, meta).double().numpy()
    for row, p in enumerate(params):
        if p.is_greedy:
            continue
        ref, _ = _ref_filtered(logits[row].numpy(), p)
        assert np.array_equal(probs[row] > 0, ref > 0), f"row {row}: allowed set differs"
        np.testing.assert_allclose(probs[row], ref, rtol=1e-5, atol=1e-7)


def test_sampled_frequencies_follow_filtered_distribution() -> None:
    vocab_size, num_draws = 10, 4000
    row = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.5, 0.3, 0.0, -0.5, -1.0, 3.0])
    p = SamplingParams(temperature=0.8, top_k=7, top_p=0.95, seed=7)
    ref, margin = _ref_filtered(row.numpy(), p)
    assert margin > 1e-3
    meta = _build([p] * num_draws, vocab_size, positions=list(range(num_draws)), seeds=[7] * num_draws)
    tokens = Sampler()(row.expand(num_draws, vocab_size).contiguous(), meta).token_ids.numpy()
    counts = np.bincount(tokens, minlength=vocab_size)
    assert counts[ref == 0].sum() == 0
    expected = ref[ref > 0] * num_draws
    chi2 = ((counts[ref > 0] - expected) ** 2 / expected).sum()
    assert chi2 < 30  # df <= 6; 30 is far beyond the 0.1% point, a wrong draw rule gives hundreds


def _ref_penalised(logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    z = logits.astype(np.float64).copy()
    for token_id, bias in (p.logit_bias or {}).items():
        z[token_id] += bias
    for token_id in set(prompt) | set(output):
        z[token_id] = z[token_id] / p.repetition_penalty if z[token_id] > 0 else z[token_id] * p.repetition_penalty
    for token_id, count in Counter(output).items():
        z[token_id] -= p.frequency_penalty * count + p.presence_penalty
    return z


def test_penalties_and_bias_match_reference() -> None:
    vocab_size = 12
    rng = np.random.default_rng(3)
    logits = torch.from_numpy(rng.normal(0, 2, (6, vocab_size)).astype(np.float32))
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-0.5, temperature=0),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=0.3, presence_penalty=1.5),
        SamplingParams(),
        SamplingParams(logit_bias={1: 2.5, 4: -1.0}, repetition_penalty=1.1),
    ]
    prompts = [[0, 1, 2, 3], [0, 1], [5, 6], [1, 2, 2, 9], [0, 1, 2], [1, 4, 7]]
    outputs = [[4, 4], [3, 3, 3, 8], [6, 7, 7], [2, 10, 10, 11], [5, 5], [4, 11]]
    meta = _build(params, vocab_size, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits, meta).double().numpy()
    for row, p in enumerate(params):
        ref = _ref_penalised(logits[row].numpy(), p, prompts[row], outputs[row])
        np.testing.assert_allclose(got[row], ref, rtol=1e-6, atol=1e-6)
    assert np.array_equal(got[4], logits[4].double().numpy())  # neutral row untouched


def test_logit_bias_forces_and_bans_tokens() -> None:
    vocab_size, num_rows = 50, 40
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(0))
    forced = SamplingParams(temperature=1.5, logit_bias={17: 100.0})
    out = Sampler()(logits, _build([forced] * num_rows, vocab_size, seeds=list(range(num_rows))))
    assert out.token_ids.tolist() == [17] * num_rows
    banned_ids = {int(t) for t in logits.argmax(-1)}
    banned = SamplingParams(temperature=0.3, logit_bias={t: -100.0 for t in banned_ids})
    out = Sampler()(logits, _build([banned] * num_rows, vocab_size, seeds=list(range(num_rows))))
    assert not banned_ids & set(out.token_ids.tolist())


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    vocab_size = 10
    logits = torch.zeros(4, vocab_size)
    logits[:, 2] = 20.0  # EOS
    logits[:, 5] = 19.0  # a stop token id
    params = [
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5], ignore_eos=True),
        SamplingParams(temperature=0, min_tokens=3),
    ]
    outputs = [[1], [1, 1, 1], [1], [1, 1]]
    meta = _build(params, vocab_size, outputs=outputs, eos_token_ids=[2])
    tokens = Sampler()(logits, meta).token_ids.tolist()
    assert tokens[0] not in (2, 5) and tokens[1] == 2 and tokens[2] == 2 and tokens[3] == 5


def _ref_logprobs(logits: torch.Tensor) -> np.ndarray:
    z = logits.double().numpy()
    return z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)


def test_logprobs_are_raw_normalised_and_sorted() -> None:
    vocab_size = 16
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(1)) * 3
    params = [
        SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, logprobs=20),
        SamplingParams(temperature=0, logit_bias={0: 30.0}, logprobs=0),
        SamplingParams(temperature=1.2, top_p=0.5),
    ]
    meta = _build(params, vocab_size, prompts=[[0, 1, 2], [], []], outputs=[[3], [], []])
    assert meta.max_num_logprobs == vocab_size
    out = Sampler()(logits, meta)
    ref = _ref_logprobs(logits)
    assert out.top_logprobs is not None and out.top_logprob_ids is not None
    top = out.top_logprobs.double()
    assert torch.allclose(torch.logsumexp(top, dim=-1).exp(), torch.ones(3, dtype=torch.float64), atol=1e-5)
    assert bool((top[:, :-1] >= top[:, 1:]).all())
    np.testing.assert_array_equal(out.top_logprob_ids.numpy(), np.argsort(-ref, axis=-1, kind="stable"))
    np.testing.assert_allclose(top.numpy(), np.sort(ref, axis=-1)[:, ::-1], atol=1e-5)
    sampled = out.token_ids.numpy()
    assert sampled[1] == 0  # the bias moved the greedy pick, the logprob stays the raw one
    np.testing.assert_allclose(out.logprobs.double().numpy(), ref[np.arange(3), sampled], atol=1e-5)


def test_logprobs_zero_gives_only_the_sampled_tokens() -> None:
    vocab_size = 40
    logits = torch.randn(2, vocab_size, generator=torch.Generator().manual_seed(2))
    out = Sampler()(logits, _build([SamplingParams(logprobs=0), SamplingParams()], vocab_size))
    assert out.top_logprobs is None and out.top_logprob_ids is None
    ref = _ref_logprobs(logits)
    np.testing.assert_allclose(out.logprobs.numpy(), ref[[0, 1], out.token_ids.numpy()], atol=1e-5)
    out = Sampler()(logits, _build([SamplingParams(logprobs=0), SamplingParams(logprobs=2)], vocab_size))
    assert out.top_logprobs is not None and out.top_logprobs.shape == (2, 2)


def test_same_seed_and_position_give_same_token_in_any_batch() -> None:
    vocab_size, num_steps = 300, 40
    gen = torch.Generator().manual_seed(4)
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    others = [
        SamplingParams(temperature=0), SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, seed=1),
        SamplingParams(logit_bias={3: 5.0}, seed=2), SamplingParams(top_k=3, min_p=0.2, seed=3),
        SamplingParams(temperature=2.0, seed=1234), SamplingParams(top_p=0.5, seed=5), SamplingParams(seed=6),
        SamplingParams(top_k=1, seed=7),
    ]
    sampler = Sampler()
    for position in range(100, 100 + num_steps):
        row = torch.randn(1, vocab_size, generator=gen) * 2
        alone = sampler(row, _build([target], vocab_size, positions=[position]))
        params = others[:5] + [target] + others[5:]
        batch_logits = torch.randn(9, vocab_size, generator=gen) * 2
        batch_logits[5] = row[0]
        positions = [position + 7 * i for i in range(9)]
        positions[5] = position
        prompts = [[i, i + 1] for i in range(9)]
        outputs = [[i + 2] * i for i in range(9)]
        batched = sampler(batch_logits, _build(params, vocab_size, positions=positions, prompts=prompts,
                                               outputs=outputs))
        assert batched.token_ids[5] == alone.token_ids[0]
        assert batched.logprobs[5] == alone.logprobs[0]


def test_different_seeds_or_positions_draw_differently() -> None:
    vocab_size, num_steps = 1000, 32
    logits = torch.zeros(num_steps, vocab_size)
    p = SamplingParams()
    positions = list(range(num_steps))

    def draw(seed: int, offset: int = 0) -> list[int]:
        meta = _build([p] * num_steps, vocab_size, seeds=[seed] * num_steps, positions=[x + offset for x in positions])
        return Sampler()(logits, meta).token_ids.tolist()

    a, b, shifted = draw(1), draw(2), draw(1, offset=1)
    assert a == draw(1)
    assert sum(x != y for x, y in zip(a, b, strict=True)) >= num_steps - 3
    assert shifted[:-1] == a[1:]  # the draw is a function of the absolute position only
    assert len(set(a)) >= num_steps - 3  # uniform logits: no token repeats much


def test_greedy_rows_take_argmax_after_penalties_among_random_rows() -> None:
    vocab_size = 30
    logits = torch.randn(6, vocab_size, generator=torch.Generator().manual_seed(5))
    raw_best = logits.argmax(-1).tolist()
    params = [
        SamplingParams(temperature=0, repetition_penalty=2.0), SamplingParams(seed=1),
        SamplingParams(top_k=1, temperature=0.7), SamplingParams(seed=2, top_k=4),
        SamplingParams(temperature=0), SamplingParams(seed=3, min_p=0.3),
    ]
    prompts = [[raw_best[0]], [], [], [], [], []]
    meta = _build(params, vocab_size, prompts=prompts)
    assert meta.any_greedy and meta.any_random and not meta.all_greedy
    out = Sampler()(logits, meta)
    expected = apply_penalties(logits, meta).argmax(-1)
    for row in (0, 2, 4):
        assert out.token_ids[row] == expected[row]
    assert out.token_ids[0] != raw_best[0]  # the penalty moved row 0's argmax
    probs = apply_sampling_filters(apply_penalties(logits, meta), meta)
    for row in (1, 3, 5):
        assert probs[row, out.token_ids[row]] > 0


def test_all_greedy_batch_needs_no_random_stage() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(6))
    meta = _build([SamplingParams(temperature=0, top_p=0.5, top_k=4)] * 3, 20)
    assert meta.all_greedy and not (meta.any_random or meta.need_top_k or meta.need_top_p or meta.need_min_p)
    assert Sampler()(logits, meta).token_ids.tolist() == logits.argmax(-1).tolist()


def test_build_rejects_mismatched_rows_and_out_of_vocab_ids() -> None:
    p = SamplingParams(repetition_penalty=1.1)
    with pytest.raises(ValueError, match="positions"):
        SamplingMetadata.build([p], [0, 1], [1], [[]], [[]], 10, "cpu")
    with pytest.raises(ValueError, match="token id"):
        SamplingMetadata.build([p], [0], [1], [[3, 10]], [[]], 10, "cpu")
    with pytest.raises(ValueError, match="token id"):
        SamplingMetadata.build([SamplingParams(logit_bias={12: 1.0})], [0], [1], [[]], [[]], 10, "cpu")


_SYNCING_METHODS = {"item", "tolist", "cpu", "numpy", "nonzero", "synchronize"}


def _host_syncs(fn) -> list[str]:
    """Calls in `fn` that would read a device value on the host (a smoke check; the gpu test is the real one)."""
    found = []
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute) and node.func.attr in _SYNCING_METHODS:
            found.append(node.func.attr)
        casts = isinstance(node.func, ast.Name) and node.func.id in {"int", "float", "bool"}
        if casts and not all(isinstance(arg, ast.Constant) for arg in node.args):
            found.append(node.func.id)
    return found


def test_hot_path_source_has_no_host_reads() -> None:
    functions = [
        Sampler.forward, sampler_module.apply_sampling_filters, sampler_module._apply_top_k,
        sampler_module._apply_top_p, sampler_module._apply_min_p, penalties_module.apply_penalties,
        random_module.exponential_noise, random_module.uniform_noise, random_module.random_bits,
        random_module.row_keys, random_module.mix64,
    ]
    assert {fn.__name__: _host_syncs(fn) for fn in functions} == {fn.__name__: [] for fn in functions}


def _gpu_batch(vocab_size: int, device: str):
    params = [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=1, logprobs=5),
        SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.4),
        SamplingParams(presence_penalty=0.5, logit_bias={5: 3.0}, seed=3, min_tokens=4, stop_token_ids=[9]),
        SamplingParams(seed=2**64 - 1),
    ]
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8]]
    outputs = [[10, 11], [12, 12], [], [13]]
    return _build(params, vocab_size, positions=[5, 6, 7, 8], prompts=prompts, outputs=outputs, device=device,
                  eos_token_ids=[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_forward_makes_no_host_sync_on_cuda() -> None:
    vocab_size = 32_000
    logits = torch.randn(4, vocab_size, device="cuda")
    meta = _gpu_batch(vocab_size, "cuda")
    sampler = Sampler()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu_out = sampler(logits.cpu(), _gpu_batch(vocab_size, "cpu"))
    assert out.token_ids.cpu().tolist() == cpu_out.token_ids.tolist()
    torch.testing.assert_close(out.logprobs.cpu(), cpu_out.logprobs, atol=1e-5, rtol=0)
