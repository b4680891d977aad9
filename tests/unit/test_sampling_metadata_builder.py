"""SamplingMetadataBuilder gives, field by field, what the per-step rebuild from every row's params gave (kept in
deepinfer.testing.sampling_reference), over random mixed batches, changing compositions, reused staging memory of
every size, and the SampledTokenBuffer's staged index copies."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine.async_step import SampledTokenBuffer
from deepinfer.sampling.metadata import SamplingMetadata, SamplingMetadataBuilder
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.sampler import Sampler, greedy_tokens
from deepinfer.sampling.staging import HostStaging
from deepinfer.testing.sampling_reference import (
    metadata_differences,
    random_params,
    random_step,
    reference_build,
)

VOCAB = 97


def check(meta: SamplingMetadata, step) -> None:
    want = reference_build(*step.args(), "cpu", **step.kwargs())
    assert metadata_differences(meta, want) == []


@pytest.mark.parametrize("seed", range(6))
def test_builder_matches_reference_on_random_mixed_batches(seed):
    # Requests come and go, batches keep or change their composition and order, outputs grow past min_tokens.
    rng = random.Random(seed)
    builder = SamplingMetadataBuilder("cpu")
    pool = [random_params(rng, VOCAB) for _ in range(24)]
    batch = rng.sample(pool, 8)
    for _ in range(40):
        change = rng.random()
        if change < 0.2:
            batch = rng.sample(pool, rng.randrange(0, len(pool)))
        elif change < 0.3:
            pool[rng.randrange(len(pool))] = random_params(rng, VOCAB)  # a request left, another came
            batch = [p for p in batch if p in pool or rng.random() < 0.5]
        elif change < 0.35:
            rng.shuffle(batch)
        step = random_step(rng, batch, VOCAB, [3, 5], grammar=rng.random() < 0.2)
        check(builder.build(*step.args(), **step.kwargs()), step)


def test_one_off_build_matches_reference():
    rng = random.Random(11)
    step = random_step(rng, [random_params(rng, VOCAB) for _ in range(32)], VOCAB, [1], grammar=True)
    check(SamplingMetadata.build(*step.args(), "cpu", **step.kwargs()), step)


def test_staging_reused_across_steps_of_different_sizes():
    # Each step's tensors are its own: later steps (smaller, larger: the staging slots grow) never change them.
    rng = random.Random(5)
    builder = SamplingMetadataBuilder("cpu")
    built = []
    for size in (64, 3, 256, 1, 0, 64, 300, 64, 2):
        step = random_step(rng, [random_params(rng, VOCAB) for _ in range(size)], VOCAB, [2])
        built.append((builder.build(*step.args(), **step.kwargs()), step))
        check(*built[-1])
    for meta, step in built:
        check(meta, step)


def test_same_batch_new_positions_and_output_lengths():
    # A composition seen before reuses its constants; positions, seeds and min_tokens bans still follow the step.
    params = [SamplingParams(temperature=0.7, min_tokens=2, stop_token_ids=[9], seed=1),
              SamplingParams(temperature=0, logit_bias={4: 2.5}, seed=2**64 - 1)]
    builder = SamplingMetadataBuilder("cpu")
    for num_out in range(4):
        step = random_step(random.Random(num_out), params, VOCAB, [3])
        step.output_token_ids = [[7] * num_out, [8] * num_out]
        meta = builder.build(*step.args(), **step.kwargs())
        check(meta, step)
        assert (meta.logit_bias[0, 9] == float("-inf")) == (num_out < 2)


def test_vocab_or_eos_change_rederives_rows():
    params = [SamplingParams(temperature=0.5, top_k=80, min_tokens=3, seed=4)]
    builder = SamplingMetadataBuilder("cpu")
    for vocab, eos in ((VOCAB, [3]), (VOCAB, [6]), (50, [6])):
        step = random_step(random.Random(0), params, vocab, eos)
        step.output_token_ids = [[]]
        meta = builder.build(*step.args(), **step.kwargs())
        check(meta, step)
        assert meta.logit_bias[0, eos[0]] == float("-inf")


def test_cached_rows_are_bounded_and_survive_a_prune():
    rng = random.Random(2)
    builder = SamplingMetadataBuilder("cpu", max_cached_rows=10)
    keep = [random_params(rng, VOCAB) for _ in range(4)]
    for _ in range(6):
        step = random_step(rng, keep + [random_params(rng, VOCAB) for _ in range(3)], VOCAB, [])
        check(builder.build(*step.args(), **step.kwargs()), step)
        assert len(builder._rows) <= 10 + 7


def test_builder_rejects_ragged_inputs_and_bad_ids_like_the_reference():
    builder = SamplingMetadataBuilder("cpu")
    with pytest.raises(ValueError, match="positions has 2 rows"):
        builder.build([SamplingParams()], [0, 1], [1], [[]], [[]], 10)
    with pytest.raises(ValueError, match="outside"):
        builder.build([SamplingParams(logit_bias={12: 1.0}, seed=1)], [0], [1], [[]], [[]], 10)


def test_host_staging_rows_and_growth():
    staging = HostStaging("cpu", num_slots=2)
    first = staging.int64_rows([[1, 2, 3], [4, 5, 6]])
    big = staging.int64_rows([list(range(5000))])
    third = staging.int64_rows(([-(2**63), 2**63 - 1],))  # reuses the first slot
    assert first.tolist() == [[1, 2, 3], [4, 5, 6]] and first.dtype == torch.int64
    assert big.shape == (1, 5000) and big[0, -1] == 4999
    assert third.tolist() == [[-(2**63), 2**63 - 1]]
    assert staging.int64_rows(([],)).shape == (1, 0)


def test_sampled_token_buffer_record_and_fill_across_sizes():
    rng = random.Random(3)
    buffer, mirror = SampledTokenBuffer(4, torch.device("cpu")), [0] * 4
    for _ in range(30):
        num_rows = max(len(mirror), rng.randrange(1, 40))
        mirror += [0] * (num_rows - len(mirror))
        rows = rng.sample(range(num_rows), rng.randrange(1, num_rows + 1))
        tokens = [rng.randrange(1000) for _ in rows]
        buffer.record(rows, torch.tensor(tokens), num_rows)
        for row, token in zip(rows, tokens, strict=True):
            mirror[row] = token
        input_ids = torch.full((50,), -1, dtype=torch.int64)
        placeholders = rng.sample(range(50), rng.randrange(1, 10))
        read = [rng.randrange(num_rows) for _ in placeholders]
        buffer.fill(input_ids, placeholders, read)
        want = [-1] * 50
        for index, row in zip(placeholders, read, strict=True):
            want[index] = mirror[row]
        assert input_ids.tolist() == want


def test_logprobs_capped_at_a_small_vocab():
    params = [SamplingParams(temperature=0, logprobs=20, seed=1), SamplingParams(logprobs=3, seed=2)]
    step = random_step(random.Random(4), params, 8, [])
    meta = SamplingMetadataBuilder("cpu").build(*step.args(), **step.kwargs())
    check(meta, step)
    assert meta.max_num_logprobs == 8


@pytest.mark.parametrize("seed", range(3))
def test_seeds_none_reads_each_params_seed_like_the_reference(seed):
    # The engine passes seeds=None: the seeds (int64, uint64, negative) come from the params, per composition.
    rng = random.Random(seed)
    builder = SamplingMetadataBuilder("cpu")
    pool = [random_params(rng, VOCAB) for _ in range(40)]
    for i in range(12):
        batch = pool[:20] if i % 3 else rng.sample(pool, rng.randrange(1, 40))
        step = random_step(rng, batch, VOCAB, [3])
        args = list(step.args())
        args[2] = None
        check(builder.build(*args, **step.kwargs()), step)


def test_seeds_none_needs_every_params_seed():
    builder = SamplingMetadataBuilder("cpu")
    with pytest.raises(ValueError, match="no seed"):
        builder.build([SamplingParams(seed=1), SamplingParams()], [0, 0], None, [[1], [1]], [[], []], 10)


@pytest.mark.parametrize(
    ("extra", "plain"),
    [({}, True), ({"logprobs": 0}, True), ({"seed": 3}, True), ({"stop_token_ids": [5]}, True),
     ({"temperature": 0.7}, False), ({"presence_penalty": 0.5}, False), ({"repetition_penalty": 1.1}, False),
     ({"logit_bias": {3: 2.0}}, False), ({"min_tokens": 4}, False), ({"logprobs": 2}, False)],
)
def test_plain_greedy_only_where_the_sampler_takes_the_argmax(extra, plain):
    builder = SamplingMetadataBuilder("cpu")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    params = [greedy, SamplingParams(**{"temperature": 0, "max_tokens": 8, **extra}), greedy]
    assert builder.plain_greedy(params, VOCAB, eos_token_ids=[1]) is plain
    assert builder.plain_greedy([greedy], VOCAB) is True


@pytest.mark.parametrize("seed", range(4))
def test_plain_greedy_batches_sample_what_greedy_tokens_gives(seed):
    # Where plain_greedy holds, the sampler's tokens and logprobs are greedy_tokens' bit for bit (the decode CUDA
    # graphs compute those instead of running the sampler).
    rng = random.Random(seed)
    builder = SamplingMetadataBuilder("cpu")
    sampler = Sampler()
    pool = [random_params(rng, VOCAB) for _ in range(12)] + [SamplingParams(temperature=0, max_tokens=8)] * 12
    checked = 0
    for _ in range(40):
        batch = rng.sample(pool, rng.randrange(1, 6))
        if not builder.plain_greedy(batch, VOCAB, eos_token_ids=[1]):
            continue
        n = len(batch)
        meta = builder.build(batch, positions=[3] * n, seeds=[1] * n, prompt_token_ids=[[2]] * n,
                             output_token_ids=[[4]] * n, vocab_size=VOCAB, eos_token_ids=[1])
        logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        out = sampler(logits, meta)
        token_ids, logprobs = greedy_tokens(logits)
        assert torch.equal(out.token_ids, token_ids) and torch.equal(out.logprobs, logprobs)
        assert out.top_logprob_ids is None
        checked += 1
    assert checked >= 3
