"""Async scheduling on the GPU (CUDA graphs, pinned copies, events): exactly the synchronous tokens."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tiny_checkpoints import checkpoints  # noqa: E402  (deepinfer.testing by path: no bus on the GPU image)


def outputs(model_dir, async_scheduling: bool):
    from deepinfer import LLM, SamplingParams

    # An explicit KV budget: the first engine of the test still holds its memory when the second starts.
    llm = LLM(str(model_dir), max_num_seqs=8, max_model_len=256, async_scheduling=async_scheduling,
              kv_cache_bytes=64 << 20, progress=False)
    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 7 * i))} for i in range(6)]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=30, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=9, max_tokens=17, ignore_eos=True, n=2),
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[7, 9, 11]),
        SamplingParams(temperature=0.5, min_p=0.1, seed=3, max_tokens=40, ignore_eos=True),
    ]
    result = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in result], llm.engine.core.runner


def test_async_equals_sync_with_cuda_graphs(tmp_path):
    model_dir = checkpoints.make_tiny_checkpoint(tmp_path / "llama", "llama")
    sync, _ = outputs(model_dir, async_scheduling=False)
    overlapped, runner = outputs(model_dir, async_scheduling=True)
    assert overlapped == sync
    assert runner.graphs is not None
