"""Sampling metadata and sampled-token indices staged through reused pinned memory on CUDA: every step's tensors
equal the reference build's, also when the stream is held back so copies are still queued while later steps write
(the ring must wait for them), and the sampler draws the same tokens from either metadata. Sampled tensors come
back through the reused pinned landing ring (SampleLanding) exactly, read one launch late as the engine does."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from deepinfer.engine.async_step import PendingSample, SampledTokenBuffer, SampleLanding  # noqa: E402
from deepinfer.engine.request import Request  # noqa: E402
from deepinfer.sampling.metadata import SamplingMetadataBuilder  # noqa: E402
from deepinfer.sampling.params import SamplingParams  # noqa: E402
from deepinfer.sampling.sampler import Sampler, SamplerOutput  # noqa: E402
from deepinfer.testing.sampling_reference import (  # noqa: E402
    metadata_differences,
    random_params,
    random_step,
    reference_build,
)

VOCAB = 1000
_DELAY_CYCLES = 2_000_000  # ~1 ms of GPU time queued before each copy


def test_staged_metadata_equals_reference_while_copies_queue():
    rng = random.Random(0)
    device = torch.device("cuda")
    builder = SamplingMetadataBuilder(device)
    assert builder.staging.pinned
    built = []
    pool = [random_params(rng, VOCAB) for _ in range(300)]
    for i in range(40):
        size = rng.choice([1, 3, 64, 64, 64, 256, 300])
        batch = pool[:size] if i % 3 else rng.sample(pool, size)
        step = random_step(rng, batch, VOCAB, [2, 7], grammar=rng.random() < 0.2)
        torch.cuda._sleep(_DELAY_CYCLES)  # the copy below stays queued while the next steps write
        built.append((builder.build(*step.args(), **step.kwargs()), step))
    torch.cuda.synchronize()
    sampler = Sampler()
    for meta, step in built:
        want = reference_build(*step.args(), "cpu", **step.kwargs())
        assert metadata_differences(meta, want) == []
        logits = torch.randn(len(step.params_list), VOCAB, device=device)
        want_device = reference_build(*step.args(), device, **step.kwargs())
        got, ref = sampler(logits, meta), sampler(logits, want_device)
        assert torch.equal(got.token_ids, ref.token_ids) and torch.equal(got.logprobs, ref.logprobs)


def test_sampled_token_buffer_on_cuda_while_copies_queue():
    rng = random.Random(1)
    device = torch.device("cuda")
    buffer, mirror = SampledTokenBuffer(8, device), [0] * 8
    for _ in range(50):
        num_rows = max(len(mirror), rng.randrange(1, 300))
        mirror += [0] * (num_rows - len(mirror))
        rows = rng.sample(range(num_rows), rng.randrange(1, num_rows + 1))
        tokens = [rng.randrange(50_000) for _ in rows]
        torch.cuda._sleep(_DELAY_CYCLES)
        buffer.record(rows, torch.tensor(tokens, device=device), num_rows)
        for row, token in zip(rows, tokens, strict=True):
            mirror[row] = token
        input_ids = torch.full((400,), -1, dtype=torch.int64, device=device)
        placeholders = rng.sample(range(400), rng.randrange(1, 300))
        read = [rng.randrange(num_rows) for _ in placeholders]
        buffer.fill(input_ids, placeholders, read)
        want = [-1] * 400
        for index, row in zip(placeholders, read, strict=True):
            want[index] = mirror[row]
        assert input_ids.tolist() == want


def test_sample_landing_on_cuda_reads_each_step_after_the_next_launch():
    # As EngineCore runs it: step N+1's copies are queued before step N is read, and step N's copies are still
    # queued behind held-back GPU work when result() is called, so it must wait for them (no sync before it).
    rng = random.Random(2)
    device = torch.device("cuda")
    landing = SampleLanding(pinned=True)
    previous = None
    for step in range(41):
        num_rows, k = rng.choice([1, 3, 64, 256]), rng.choice([0, 0, 2, 5])
        torch.cuda._sleep(_DELAY_CYCLES)  # the tensors below are written after the host has moved on
        ids = torch.randint(0, 50_000, (num_rows,), device=device)
        logprobs = -torch.rand(num_rows, device=device)
        top = torch.randint(0, 50_000, (num_rows, k), device=device) if k else None
        top_lp = -torch.rand(num_rows, k, device=device) if k else None
        out = SamplerOutput(ids, logprobs, top, top_lp)
        params = SamplingParams(logprobs=k or None, seed=1)
        chosen = [Request(f"s{step}-{i}", [1], params) for i in range(num_rows)]
        pending = PendingSample(out, chosen, landing=landing)
        if previous is not None:
            got = previous[0].result()
            host = [None if t is None else t.cpu() for t in (previous[1].token_ids, previous[1].logprobs,
                                                             previous[1].top_logprob_ids, previous[1].top_logprobs)]
            assert got == PendingSample(SamplerOutput(*host), previous[0].chosen).result()
        previous = (pending, out)


def test_fill_stages_the_sampled_rows_with_the_placeholders_on_cuda():
    device = torch.device("cuda")
    buffer = SampledTokenBuffer(8, device)
    buffer.record([1, 2, 3], torch.tensor([11, 12, 13], device=device), 8)
    input_ids = torch.full((4,), -1, dtype=torch.int64, device=device)
    torch.cuda._sleep(_DELAY_CYCLES)
    rows = buffer.fill(input_ids, [0, 2], [3, 1], sampled_rows=[3, 1, 5])
    buffer.record(rows, torch.tensor([21, 22, 23], device=device), 8)
    assert input_ids.tolist() == [13, -1, 11, -1]
    assert buffer.token_ids.tolist() == [0, 22, 12, 21, 0, 23, 0, 0]

