"""Speculative decoding on the GPU (float32, tiny Llama): in every execution mode a run with drafts gives the
tokens of the same run without them. Verify steps run eagerly beside the mode's graphs (decode graphs, piecewise
or full prompt graphs), so this checks the fall-back and the KV rollback against the graphs' own steps. A scripted
drafter proposes the plain run's tokens with every third one wrong: full accepts, partial accepts and rollbacks."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tiny_checkpoints import checkpoints  # noqa: E402  (deepinfer.testing by path: no bus on the GPU image)

PROMPTS = [
    {"prompt_token_ids": [5, 17, 42, 99, 7] * 5},
    {"prompt_token_ids": [9, 8, 7, 9, 8]},
    {"prompt_token_ids": list(range(40, 60)) * 2 + [40, 41]},
    {"prompt_token_ids": [100, 3, 100, 3, 100, 3, 100]},
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_tiny_checkpoint(tmp_path_factory.mktemp("speculative") / "llama", "llama")


def build(model_dir, mode: str, speculative: bool, num_speculative_tokens: int | str = 4):
    from deepinfer import LLM

    config = {**NGRAM, "num_speculative_tokens": num_speculative_tokens} if speculative else None
    # No host tier: its default pins a share of the host's memory per engine, and the engines of earlier tests in
    # the same process (two per case here) are freed only when collected (CUDA out of memory pinning it, 2026-12-04).
    return LLM(str(model_dir), dtype="float32", execution_mode=mode, max_num_seqs=8, max_model_len=256,
               kv_cache_bytes=64 << 20, kv_host_cache_bytes=0, progress=False, speculative_config=config)


def outputs(llm, params):
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize(("mode", "sampling"), [
    ("eager", "seeded"), ("decode", "greedy"), ("decode", "seeded"), ("piecewise", "greedy"), ("full", "seeded"),
])
def test_drafts_give_the_plain_tokens_in_every_mode(model_dir, mode, sampling):
    from deepinfer import SamplingParams
    from deepinfer.testing.drafters import ScriptedDrafter

    extra = {"temperature": 0.0} if sampling == "greedy" else {"temperature": 0.8, "seed": 7}
    params = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=1, **extra)
    reference = outputs(build(model_dir, mode, speculative=False), params)
    spec = build(model_dir, mode, speculative=True)
    assert [o.token_ids for o in outputs(spec, params)] == [o.token_ids for o in reference]  # n-gram drafts
    continuations = {tuple(p["prompt_token_ids"]): o.token_ids for p, o in zip(PROMPTS, reference, strict=True)}
    spec.engine.install_drafter(ScriptedDrafter(continuations, 3))
    before = spec.engine.spec_decode_stats()
    got = outputs(spec, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in reference]
    for out, ref in zip(got, reference, strict=True):
        for a, b in zip(out.logprobs, ref.logprobs, strict=True):
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in b)
    stats = spec.engine.spec_decode_stats()
    assert 0 < stats.num_accepted_tokens - before.num_accepted_tokens < stats.num_draft_tokens - before.num_draft_tokens


def test_auto_draft_lengths_give_the_plain_tokens_beside_decode_graphs(model_dir):
    """num_speculative_tokens="auto": the cost table sets graph-replayed decode steps against eager verify steps;
    whatever it chooses, the tokens are the plain run's, and the first (optimistic) steps do verify drafts."""
    from deepinfer import SamplingParams
    from deepinfer.testing.drafters import ScriptedDrafter

    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0)
    reference = outputs(build(model_dir, "decode", speculative=False), params)
    spec = build(model_dir, "decode", speculative=True, num_speculative_tokens="auto")
    continuations = {tuple(p["prompt_token_ids"]): o.token_ids for p, o in zip(PROMPTS, reference, strict=True)}
    spec.engine.install_drafter(ScriptedDrafter(continuations, 3))
    assert [o.token_ids for o in outputs(spec, params)] == [o.token_ids for o in reference]
    assert spec.engine.spec_decode_stats().num_draft_tokens > 0


def test_grammar_requests_verify_drafts_under_their_masks_beside_full_graphs(model_dir):
    """A JSON-object grammar: drafts cut where the grammar forbids, each verified row masked on the device by the
    grammar after the drafts before it; the tokens are the plain run's."""
    from deepinfer import SamplingParams
    from deepinfer.structured import json_object_grammar
    from deepinfer.testing.drafters import ScriptedDrafter

    params = SamplingParams(max_tokens=24, temperature=0.0, grammar=json_object_grammar())
    reference = outputs(build(model_dir, "full", speculative=False), params)
    spec = build(model_dir, "full", speculative=True)
    continuations = {tuple(p["prompt_token_ids"]): o.token_ids for p, o in zip(PROMPTS, reference, strict=True)}
    spec.engine.install_drafter(ScriptedDrafter(continuations, 3))
    got = outputs(spec, params)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in reference]
    assert spec.engine.spec_decode_stats().num_accepted_tokens > 0


@pytest.mark.parametrize("mode", ["eager", "full"])
def test_a_draft_model_gives_the_plain_tokens(model_dir, mode):
    """method draft_model with the target's own checkpoint as the draft: its nested engine (its own pool, in full
    mode its own graphs) on the same device; greedy tokens as the plain run's with nearly every draft kept, seeded
    ones as the plain run's."""
    from deepinfer import LLM, SamplingParams

    spec = LLM(str(model_dir), dtype="float32", execution_mode=mode, max_num_seqs=8, max_model_len=256,
               kv_cache_bytes=64 << 20, kv_host_cache_bytes=0, progress=False,
               speculative_config={"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3})
    plain = build(model_dir, mode, speculative=False)
    greedy = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0)
    assert [o.token_ids for o in outputs(spec, greedy)] == [o.token_ids for o in outputs(plain, greedy)]
    stats = spec.engine.spec_decode_stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0.8 * stats.num_draft_tokens
    seeded = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.8, seed=7)
    assert [o.token_ids for o in outputs(spec, seeded)] == [o.token_ids for o in outputs(plain, seeded)]


def test_mtp_drafts_give_the_plain_tokens(tmp_path_factory):
    """method mtp on a tiny DeepSeek-V3 with an MTP layer (MLA, MoE; eager, the Triton kernels): the MTP pass
    over every step's rows writes its latent cache on the device; greedy and seeded tokens as the plain run's."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.testing import checkpoints_deepseek

    path = checkpoints_deepseek.make_tiny_deepseek_checkpoint(tmp_path_factory.mktemp("mtp"), "deepseek_v3",
                                                              std=0.1, seed=3, num_nextn_predict_layers=1)
    common = {"dtype": "float32", "max_num_seqs": 8, "max_model_len": 256, "kv_cache_bytes": 64 << 20,
              "kv_host_cache_bytes": 0, "progress": False, "execution_mode": "eager"}
    plain = LLM(str(path), **common)
    spec = LLM(str(path), speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **common)
    for params in (SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0),
                   SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.8, seed=7)):
        assert [o.token_ids for o in outputs(spec, params)] == [o.token_ids for o in outputs(plain, params)]
    assert spec.engine.spec_decode_stats().num_draft_tokens > 0
