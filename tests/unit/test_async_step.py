"""The async step's host side on the CPU: the landing ring that sampled tensors come back through (pinned on
CUDA; tests/gpu/test_sampling_staging_gpu.py runs it there), and the index lists staged in one copy."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.async_step import PendingSample, SampledTokenBuffer, SampleLanding
from deepinfer.engine.request import Request
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.sampler import SamplerOutput
from deepinfer.sampling.staging import HostStaging


def _output(num_rows: int, k: int, offset: int) -> SamplerOutput:
    ids = torch.arange(num_rows, dtype=torch.int64) + offset
    top = None if k == 0 else torch.arange(num_rows * k, dtype=torch.int64).view(num_rows, k) + offset
    top_lp = None if k == 0 else -torch.rand(num_rows, k)
    return SamplerOutput(ids, -torch.rand(num_rows), top, top_lp)


def _requests(num_rows: int, logprobs: int) -> list[Request]:
    params = SamplingParams(logprobs=logprobs or None, seed=1)
    return [Request(f"r{i}", [1, 2], params) for i in range(num_rows)]


def test_landing_ring_reuses_its_buffers_and_reads_what_each_step_sampled():
    landing = SampleLanding(pinned=False, num_slots=3)
    pending = []
    for step, (num_rows, k) in enumerate([(4, 0), (64, 2), (3, 0), (100, 5), (64, 2), (1, 0), (7, 3)]):
        out = _output(num_rows, k, offset=1000 * step)
        chosen = _requests(num_rows, k)
        landed = PendingSample(out, chosen, landing=landing)
        want = PendingSample(out, chosen).result()  # read in place
        pending.append(landed)
        assert landed.result() == want
        assert all(s.token_id == 1000 * step + i for i, s in enumerate(want.values()))
    # Steps 1 and 4 land in the same slot with the same shapes: the same memory, no allocation per step.
    assert pending[1]._host[0].data_ptr() == pending[4]._host[0].data_ptr()
    assert pending[1]._host[3].data_ptr() == pending[4]._host[3].data_ptr()


def test_a_sample_read_after_its_slot_was_reused_raises():
    landing = SampleLanding(pinned=False, num_slots=2)
    first = PendingSample(_output(2, 0, 0), _requests(2, 0), landing=landing)
    PendingSample(_output(2, 0, 10), _requests(2, 0), landing=landing)
    PendingSample(_output(2, 0, 20), _requests(2, 0), landing=landing)  # reuses first's slot
    with pytest.raises(RuntimeError, match="reused"):
        first.result()


def test_int64_lists_of_any_lengths_in_one_copy():
    staging = HostStaging("cpu", num_slots=2)
    a, b, c = staging.int64_lists(([1, 2, 3], [], [-(2**63), 2**63 - 1]))
    assert a.tolist() == [1, 2, 3] and b.tolist() == [] and c.tolist() == [-(2**63), 2**63 - 1]
    assert a.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()  # views of one upload
    staging.int64_lists((list(range(5000)),))  # a later write (a grown slot, then the first again) ...
    staging.int64_lists(([7] * 3,))
    assert a.tolist() == [1, 2, 3]  # ... leaves an earlier upload as it was


def test_fill_returns_the_sampled_rows_for_record():
    buffer = SampledTokenBuffer(8, torch.device("cpu"))
    buffer.record([1, 2, 3], torch.tensor([11, 12, 13]), 8)
    input_ids = torch.full((4,), -1, dtype=torch.int64)
    rows = buffer.fill(input_ids, [0, 2], [3, 1], sampled_rows=[3, 1, 5])
    assert input_ids.tolist() == [13, -1, 11, -1]
    buffer.record(rows, torch.tensor([21, 22, 23]), 8)  # the device index fill() returned
    assert buffer.token_ids.tolist() == [0, 22, 12, 21, 0, 23, 0, 0]
