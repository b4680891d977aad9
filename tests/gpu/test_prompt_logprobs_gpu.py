"""Prompt logprobs (SamplingParams.prompt_logprobs) in every execution mode against the eager engine, float32:
the rows that score prompt tokens come from the eager forward, the piecewise graphs, a decode graph (a one-token
prompt chunk in a decode-only step) or, in full mode, an eager step instead of the full graph (which ends at the
sampled rows); sync and async scheduling; batch-invariant mode."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tiny_checkpoints import checkpoints  # noqa: E402  (deepinfer.testing by path: no bus on the GPU image)

#: Three short prompts that decode long, then the scored one: with a budget of 4 tokens a step, once the three
#: decode its prompt goes one token a step beside them (decode-only steps: decode graphs).
DECODERS = [{"prompt_token_ids": [5 + i, 9 + i]} for i in range(3)]
SCORED = {"prompt_token_ids": [11, 42, 7, 99, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 13, 300, 6, 70]}
LONG = {"prompt_token_ids": list(range(40, 140))}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_tiny_checkpoint(tmp_path_factory.mktemp("prompt-logprobs") / "llama", "llama")


def scores(model_dir, mode: str, async_scheduling: bool, max_num_batched_tokens: int, prompts,
           batch_invariant: bool = False):
    """Each prompt's prompt logprobs (vLLM's dicts), None for the prompts that did not ask."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", execution_mode=mode, async_scheduling=async_scheduling,
              max_num_seqs=8, max_model_len=256, max_num_batched_tokens=max_num_batched_tokens,
              batch_invariant=batch_invariant, kv_cache_bytes=64 << 20, progress=False)
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    params = [scored if p in (SCORED, LONG) else plain for p in prompts]
    return [o.prompt_logprobs for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_same(got, expected):
    for prompt_got, prompt_expected in zip(got, expected, strict=True):
        if prompt_expected is None:
            assert prompt_got is None
            continue
        assert len(prompt_got) == len(prompt_expected) and prompt_got[0] is None
        for a, b in zip(prompt_got[1:], prompt_expected[1:], strict=True):
            assert a.keys() == b.keys()
            for token_id in a:
                assert a[token_id].logprob == pytest.approx(b[token_id].logprob, abs=1e-4)
                assert a[token_id].rank == b[token_id].rank


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["decode", "piecewise", "full"])
@pytest.mark.parametrize(("budget", "prompts"), [
    (4, [*DECODERS, SCORED]),  # one-token chunks in decode-only steps
    (32, [SCORED, LONG, *DECODERS]),  # chunked prompts in mixed steps
    (512, [SCORED, LONG]),  # whole prompts in one step
], ids=["one-token-chunks", "chunked", "whole"])
def test_every_mode_scores_as_eager(model_dir, mode, async_scheduling, budget, prompts):
    expected = scores(model_dir, "eager", False, budget, prompts)
    got = scores(model_dir, mode, async_scheduling, budget, prompts)
    assert_same(got, expected)


def test_batch_invariant_mode_scores_as_eager(model_dir):
    prompts = [SCORED, LONG, *DECODERS]
    expected = scores(model_dir, "eager", False, 32, prompts)
    got = scores(model_dir, "decode", False, 32, prompts, batch_invariant=True)
    assert_same(got, expected)
