"""Decode CUDA graphs that compute the logits and the greedy tokens (`graph_sampling`): the sampler's tokens and
logprobs, with the sampler skipped only for steps where it would take each row's argmax."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tiny_checkpoints import checkpoints  # noqa: E402  (deepinfer.testing by path: no bus on the GPU image)

PROMPTS = [{"prompt_token_ids": list(range(5 + i, 30 + 5 * i))} for i in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_tiny_checkpoint(tmp_path_factory.mktemp("graph-sampling") / "llama", "llama")


def generate(model_dir, graph_sampling: bool, params):
    """(per request: token ids and the sampled tokens' logprobs, sampler launches, graph replays, engine steps)."""
    from deepinfer import LLM

    # An explicit KV budget: an earlier engine of the test may still hold its memory.
    llm = LLM(str(model_dir), max_num_seqs=8, max_model_len=256, graph_sampling=graph_sampling,
              kv_cache_bytes=64 << 20, progress=False)
    runner, calls = llm.engine.core.runner, []
    forward = runner.sampler.forward
    runner.sampler.forward = lambda *args: calls.append(1) or forward(*args)
    result = llm.generate(PROMPTS, params, use_tqdm=False)
    outputs = [(c.token_ids, [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [], strict=False)])
               for o in result for c in o.outputs]
    return outputs, len(calls), runner.graphs.num_replays, llm


def assert_same(got, expected):
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, rel=1e-3, abs=1e-4)


def test_greedy_steps_take_the_graphs_argmax_without_the_sampler(model_dir):
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    eager_tail, eager_calls, _, llm = generate(model_dir, False, params)
    del llm
    in_graph, calls, replays, llm = generate(model_dir, True, params)
    assert llm.engine.core.runner.graphs.logits is not None and replays >= 20
    assert_same(in_graph, eager_tail)
    assert all(len(logprobs) == 24 for _, logprobs in in_graph)  # the sampled tokens' logprobs came back
    # Only the steps with prompt rows ran the sampler; every decode step took the graph's tokens.
    assert eager_calls >= 24 and calls <= eager_calls - replays


def test_random_penalised_and_top_logprob_rows_sample_from_the_graphs_logits(model_dir):
    from deepinfer import SamplingParams

    # Four requests of one length: every decode step has 4 rows, the graph's size (no padding rows), so the
    # logits are those of the eager LM head and the seeded draws must agree exactly.
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, presence_penalty=0.5, max_tokens=16, ignore_eos=True, logprobs=0),
    ]
    eager_tail, eager_calls, _, llm = generate(model_dir, False, params)
    del llm
    in_graph, calls, replays, _ = generate(model_dir, True, params)
    assert replays >= 12
    assert_same(in_graph, eager_tail)
    assert calls == eager_calls  # no step was plain greedy: each ran the sampler, on the graph's logits
