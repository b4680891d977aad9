"""The n-gram prompt-lookup drafter (vLLM's `ngram` semantics) and `speculative_config` validation. No model."""

from __future__ import annotations

import pytest

from deepinfer.engine.args import EngineArgs
from deepinfer.engine.drafter import Draft, NgramDrafter, make_drafter, propose_drafts, propose_ngram
from deepinfer.engine.request import Request
from deepinfer.engine.spec_config import SpeculativeConfig


@pytest.mark.parametrize(("tokens", "min_n", "max_n", "k", "draft"), [
    # vLLM's docstring example: [4, 2, 3] has no earlier match; [2, 3] does, and only 3 tokens follow it.
    ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),
    # The longest n wins: the 3-gram [7, 8, 9] at 4 beats the 1-gram [9] at 0.
    ([9, 5, 5, 5, 7, 8, 9, 6, 1, 7, 8, 9], 1, 3, 2, [6, 1]),
    # Among matches of that length, the earliest: [1, 2] at 0 (then 3), not at 3 (then 4).
    ([1, 2, 3, 1, 2, 4, 1, 2], 2, 2, 1, [3]),
    # The draft may run into the suffix itself: a repeated token proposes itself.
    ([6, 6, 6], 1, 1, 3, [6, 6]),
    ([1, 2, 3, 4], 1, 3, 2, []),  # nothing recurs
    ([5, 6, 5, 6], 3, 4, 2, []),  # only a 2-gram recurs, shorter than min_n
    ([1, 2, 1], 1, 1, 0, []),  # k = 0
    ([1], 1, 1, 3, []),  # too short to recur
])
def test_propose_ngram(tokens, min_n, max_n, k, draft):
    assert propose_ngram(tokens, min_n, max_n, k) == draft


def test_the_drafter_reads_prompt_and_output():
    request = Request("r", [10, 11, 12, 13, 10], sampling_params=None)
    request.append_output_token_ids([11, 12])
    draft = NgramDrafter(prompt_lookup_min=2, prompt_lookup_max=3).propose(request, 3)
    assert (draft.token_ids, draft.probs) == ([13, 10, 11], None)


def test_config_defaults_as_vllm():
    assert SpeculativeConfig.of(None) is None
    both = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)
    assert isinstance(make_drafter(both), NgramDrafter)


@pytest.mark.parametrize(("config", "message"), [
    ([("method", "ngram")], "must be a dict"),
    ({"method": "ngram", "num_speculative_tokens": True}, "must be an int >= 1"),
    ({"method": "ngram", "num_speculative_tokens": "automatic"}, "must be an int >= 1 or \"auto\""),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
    ({"method": "mtp", "num_speculative_tokens": 2}, "one token a step"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model is required with method 'draft_model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": ""}, "model is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "m"}, "model is only for method 'draft_model'"),
    ({"num_speculative_tokens": 2}, "missing method"),
])
def test_bad_configs_name_what_is_wrong(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.of(config)


def test_engine_args_validate_and_keep_async_scheduling():
    import torch

    args = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert isinstance(args.speculative_config, SpeculativeConfig)
    # auto: on for one CUDA device beside speculation too (verify steps run synchronously between async ones)
    assert args.resolve_async_scheduling(torch.device("cuda")) is True
    assert args.resolve_async_scheduling(torch.device("cpu")) is False
    assert EngineArgs().speculative_config is None
    assert EngineArgs().resolve_async_scheduling(torch.device("cuda")) is True
    for kwargs, message in (({"batch_invariant": True}, "batch_invariant=True"),
                            ({"tensor_parallel_size": 2}, "tensor_parallel_size > 1")):
        with pytest.raises(ValueError, match=message):
            EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **kwargs)


def test_propose_drafts_calls_a_batch_drafter_once_and_a_plain_one_per_request():
    requests = [Request("a", [1, 2, 1], sampling_params=None), Request("b", [3, 4, 3], sampling_params=None)]

    class Batched:
        has_probs = False
        calls: list = []

        def propose(self, request, num_tokens):
            raise AssertionError("propose_batch is used")

        def propose_batch(self, batch, num_tokens):
            self.calls.append(([r.request_id for r in batch], num_tokens))
            return {"b": Draft([7] * num_tokens)}  # no guess for "a"

    batched = Batched()
    assert propose_drafts(batched, requests, 2) == {"a": [], "b": [7, 7]}
    assert batched.calls == [(["a", "b"], 2)]
    ngram = NgramDrafter(prompt_lookup_min=1, prompt_lookup_max=1)
    assert propose_drafts(ngram, requests, 2) == {"a": [2, 1], "b": [4, 3]}
    with pytest.raises(ValueError, match="EngineCore builds it"):
        make_drafter(SpeculativeConfig(method="draft_model", model="m", num_speculative_tokens=2))
