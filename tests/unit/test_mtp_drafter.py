"""The `mtp` method through `LLM` on a tiny random DeepSeek-V3 with one MTP layer (CPU, float32): drafts from the
model's own MTP layer give the plain tokens (greedy and seeded, k = 1 and "auto"), every draft is the MTP layer's
argmax computed from scratch over the request's tokens (so its latent cache holds what a fresh pass would), and a
model without an MTP layer or a k it cannot draft is refused."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.mtp_drafter import MtpDrafter
from deepinfer.testing.checkpoints_deepseek import make_tiny_deepseek_checkpoint
from deepinfer.testing.paged_cache import PagedCache
from tests.unit.test_speculative import PROMPTS

MTP = {"method": "mtp", "num_speculative_tokens": 1}


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_deepseek_checkpoint(tmp_path_factory.mktemp("mtp"), "deepseek_v3", num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def plain(mtp_dir):
    return LLM(str(mtp_dir), block_size=4, dtype="float32", progress=False)


def run(llm, params):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def greedy(max_tokens=24):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("k", [1, "auto"])
def test_mtp_drafts_give_the_plain_tokens(mtp_dir, plain, k):
    llm = LLM(str(mtp_dir), block_size=4, dtype="float32", progress=False,
              speculative_config={**MTP, "num_speculative_tokens": k})
    assert isinstance(llm.engine.core.drafter, MtpDrafter)
    assert run(llm, greedy()) == run(plain, greedy())
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    assert run(llm, seeded) == run(plain, seeded)
    if k == 1:
        assert llm.engine.spec_decode_stats().num_draft_tokens > 0  # every decode step verified a draft


def test_every_draft_is_the_mtp_layers_argmax_over_the_request_from_scratch(mtp_dir):
    """Each draft against a fresh main + MTP pass over the request's tokens at that moment (a new paged cache): the
    MTP latents the engine kept across prefill chunks, decode and verify steps (accepted and rejected rows) equal
    a fresh computation's."""
    llm = LLM(str(mtp_dir), block_size=4, dtype="float32", progress=False, speculative_config=MTP,
              max_num_batched_tokens=16)
    core = llm.engine.core
    drafter = core.drafter
    seen: list[tuple[list[int], int]] = []
    propose = drafter.propose

    def spy(request, num_tokens):
        draft = propose(request, num_tokens)
        if draft.token_ids:
            seen.append((list(request.all_token_ids), draft.token_ids[0]))
        return draft

    drafter.propose = spy
    run(llm, greedy(16))
    model = core.runner.model
    assert len(seen) > 20
    for tokens, draft in seen:
        assert draft == _fresh_mtp_argmax(model, tokens), tokens


def _fresh_mtp_argmax(model, tokens: list[int]) -> int:
    """argmax of the MTP logits at the second-to-last position: input (h at len - 2, the last token)."""
    cache = PagedCache.for_model(model, num_blocks=64, block_size=4, num_layers=model.config.num_hidden_layers + 1)
    context = tokens[:-1]
    input_ids, positions, meta = cache.inputs([(0, context, 0)])
    with torch.no_grad():
        hidden = model(input_ids, positions, cache.kv_caches[:-1], meta)
        next_ids = torch.tensor(tokens[1:])
        logits = model.mtp_forward(hidden, next_ids, positions, cache.kv_caches[-1], meta)
    return int(logits[-1].argmax())


def test_a_model_without_an_mtp_layer_is_refused(tmp_path):
    path = make_tiny_deepseek_checkpoint(tmp_path / "v3", "deepseek_v3")
    with pytest.raises(ValueError, match="no MTP layer"):
        LLM(str(path), progress=False, speculative_config=MTP)


@pytest.mark.parametrize(("config", "message"), [
    ({**MTP, "num_speculative_tokens": 3}, "one token a step"),
])
def test_bad_mtp_configs_are_refused(mtp_dir, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(mtp_dir), progress=False, speculative_config=config)


def test_async_scheduling_is_refused_with_mtp(mtp_dir):
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(str(mtp_dir), progress=False, speculative_config=MTP, async_scheduling=True)
