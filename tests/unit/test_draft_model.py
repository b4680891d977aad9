"""The `draft_model` method through `LLM` on tiny random Llamas (CPU, float32): the plain tokens with a draft model.

The target drafting with itself accepts (nearly) every draft; with its own weights slightly moved, some; with another
random checkpoint of the same vocabulary almost none; the tokens are the plain run's in every case. The draft
engine's pool holds no block between steps, and the target's ends as after a run without speculation.
"""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.args import EngineArgs
from deepinfer.engine.core import EngineCore
from deepinfer.engine.draft_model import DraftModelDrafter, check_same_vocabulary
from tests.unit.test_speculative import PROMPTS  # prompts with repeats and without


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """Another random Llama of the tiny shape's vocabulary, one layer: a draft that rarely agrees."""
    from deepinfer.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft") / "llama", "llama", seed=1, num_hidden_layers=1)


@pytest.fixture(scope="module")
def near_dir(tiny_dir, tmp_path_factory):
    """The target's checkpoint with every weight moved by N(0, 0.005): a draft that agrees often, not always (about
    40% of draft tokens accepted at k = 4, rejections at every position)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("near") / "llama"
    shutil.copytree(tiny_dir, path)
    noise = torch.Generator().manual_seed(0)
    weights = {name: (w + 0.005 * torch.randn(w.shape, generator=noise)).contiguous()
               for name, w in load_file(tiny_dir / "model.safetensors").items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return LLM(str(tiny_dir), block_size=4, progress=False)


def draft_model(model, k=4):
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


def greedy(max_tokens=24):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run(llm, params, prompts=PROMPTS):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def draft_core(llm) -> EngineCore:
    drafter = llm.engine.core.drafter
    assert isinstance(drafter, DraftModelDrafter)
    return drafter.core


def assert_draft_side_empty(llm):
    """No mirror left in the draft engine, every block of its pool free (cached ones stay, evictable)."""
    core = draft_core(llm)
    assert not core.scheduler.requests and not core.scheduler.running and not core.scheduler.waiting
    assert core.scheduler.block_pool.num_free_blocks == core.kv_plan.num_blocks - 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("k", [4, "auto"])
def test_the_target_as_its_own_draft_accepts_and_gives_the_plain_tokens(tiny_dir, plain, k, async_scheduling):
    reference = run(plain, greedy())
    llm = LLM(str(tiny_dir), block_size=4, progress=False, speculative_config=draft_model(tiny_dir, k),
              async_scheduling=async_scheduling)
    assert [o.token_ids for o in run(llm, greedy())] == [o.token_ids for o in reference]
    stats = llm.engine.spec_decode_stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens / stats.num_draft_tokens > 0.9, stats
    assert_draft_side_empty(llm)
    target_pool = llm.engine.core.scheduler.block_pool
    assert target_pool.num_free_blocks == plain.engine.core.scheduler.block_pool.num_free_blocks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("k", [3, "auto"])
@pytest.mark.parametrize("draft", ["other", "near"])
def test_drafts_of_other_checkpoints_rejected_in_part_or_whole_give_the_plain_tokens(
        tiny_dir, other_dir, near_dir, plain, draft, k, async_scheduling):
    reference = run(plain, greedy())
    draft_dir = other_dir if draft == "other" else near_dir
    llm = LLM(str(tiny_dir), block_size=4, progress=False, speculative_config=draft_model(draft_dir, k),
              async_scheduling=async_scheduling)
    assert [o.token_ids for o in run(llm, greedy())] == [o.token_ids for o in reference]
    stats = llm.engine.spec_decode_stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert_draft_side_empty(llm)
    assert llm.engine.core.scheduler.block_pool.num_free_blocks == plain.engine.core.scheduler.block_pool.num_free_blocks


def test_one_draft_forward_a_position_for_the_whole_batch(tiny_dir):
    """Each propose drafts every decode together: k draft steps (the first computes the new tokens, then k - 1
    decodes of all mirrors), whatever the batch size; the drafts then verify as usual."""
    llm = LLM(str(tiny_dir), block_size=4, progress=False, speculative_config=draft_model(tiny_dir, 3))
    drafter, core = llm.engine.core.drafter, draft_core(llm)
    rounds, steps = [], []
    propose_batch, step = drafter.propose_batch, core.step
    core.step = lambda: steps.append(len(core.scheduler.requests)) or step()  # mirrors in the step

    def counted(requests, num_tokens):
        steps.clear()
        drafts = propose_batch(requests, num_tokens)
        rounds.append((len(requests), list(steps)))
        return drafts

    drafter.propose_batch = counted
    run(llm, greedy(max_tokens=12))
    assert rounds[0] == (len(PROMPTS), [len(PROMPTS)] * 3)
    # Never more steps than k: fewer where max_tokens leaves the target room for fewer drafts (none at the end).
    assert all(len(round_steps) <= 3 for _, round_steps in rounds) and rounds[-1][1] == []


def test_finished_and_aborted_requests_leave_no_draft_state(tiny_dir):
    core = EngineCore(EngineArgs(model=str(tiny_dir), block_size=4, progress=False,
                                 speculative_config=draft_model(tiny_dir, 4)))
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"r{i}", prompt["prompt_token_ids"], greedy(max_tokens=10 + 10 * i))
    for _ in range(3):
        core.step()
    core.abort_requests(["r2", "r3"])
    while core.has_unfinished_requests():
        core.step()
    draft = core.drafter.core
    assert not draft.scheduler.requests and not core.drafter._block_hashes  # nothing kept of a request gone
    assert draft.scheduler.block_pool.num_free_blocks == draft.kv_plan.num_blocks - 1
    assert core.scheduler.block_pool.num_free_blocks == core.kv_plan.num_blocks - 1


def test_seeded_sampling_gives_the_plain_tokens_on_every_run(tiny_dir, other_dir, near_dir, plain):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True, seed=1234,
                            repetition_penalty=1.2)
    reference = run(plain, params)
    for draft in (tiny_dir, near_dir, other_dir):
        llm = LLM(str(tiny_dir), block_size=4, progress=False, speculative_config=draft_model(draft, 4))
        first = run(llm, params)
        assert [(o.token_ids, o.text) for o in first] == [(o.token_ids, o.text) for o in reference]
        assert [o.text for o in run(llm, params)] == [o.text for o in first]
    assert llm.engine.spec_decode_stats().num_draft_tokens > 0


def test_a_draft_model_of_another_vocabulary_is_refused_at_start(tiny_dir, tmp_path):
    from deepinfer.testing.checkpoints import make_tiny_checkpoint

    plain_vocab = LLM(str(tiny_dir), progress=False).engine.core.model_config.vocab_size
    other = make_tiny_checkpoint(tmp_path / "other-vocab", "llama", vocab_size=plain_vocab + 64)
    with pytest.raises(ValueError, match="the draft model's tokenizer differs from the target's"):
        LLM(str(tiny_dir), progress=False, speculative_config=draft_model(other))


def test_vocabularies_without_tokenizers_compare_vocab_size(tiny_dir):
    from deepinfer.tokenizer import Tokenizer

    check_same_vocabulary(100, None, 100, None)
    with pytest.raises(ValueError, match="vocab_size=96 differs from the target's 100"):
        check_same_vocabulary(100, None, 96, Tokenizer.from_dir(tiny_dir))
    tokenizer = Tokenizer.from_dir(tiny_dir)
    check_same_vocabulary(100, tokenizer, 128, Tokenizer.from_dir(tiny_dir))  # padded past it: drafts are cut


def test_drafts_stop_before_an_id_the_target_lacks(tiny_dir, plain):
    llm = LLM(str(tiny_dir), block_size=4, progress=False, speculative_config=draft_model(tiny_dir))
    drafter = llm.engine.core.drafter
    drafter.target_vocab_size = 10
    assert drafter._in_target_vocab([3, 9, 10, 2]) == [3, 9]
    assert drafter._in_target_vocab([3, 9]) == [3, 9]


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "draft_model", "num_speculative_tokens": 4}, "model is required with method 'draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": 4, "model": "x"}, "model is only for method 'draft_model'"),
    ({"method": "draft_model", "model": "x"}, "missing num_speculative_tokens"),
])
def test_bad_draft_model_configs_are_refused(tiny_dir, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_dir), progress=False, speculative_config=config)


def test_every_draft_is_the_draft_model_s_greedy_continuation_after_rejections(tiny_dir, near_dir, monkeypatch):
    """The draft side trusts no KV of a rejected draft: each round's drafts (after partial accepts at every
    position) equal the draft model's own greedy continuation of the target's tokens, computed afresh by a plain
    engine over the draft model. Mirrors adopt the block hashes of the round before (not hashed again)."""
    from deepinfer.engine.request import Request

    adopted, adopt = [], Request.adopt_block_hashes
    monkeypatch.setattr(Request, "adopt_block_hashes", lambda self, hashes: adopted.append(len(hashes)) or adopt(
        self, hashes))
    llm = LLM(str(tiny_dir), block_size=4, progress=False, speculative_config=draft_model(near_dir, 4))
    drafter, rounds = llm.engine.core.drafter, []
    propose_batch = drafter.propose_batch

    def recorded(requests, num_tokens):
        drafts = propose_batch(requests, num_tokens)
        rounds.extend((list(r.all_token_ids), drafts[r.request_id].token_ids) for r in requests if r.request_id in drafts)
        return drafts

    drafter.propose_batch = recorded
    run(llm, greedy(max_tokens=24))
    stats = llm.engine.spec_decode_stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and stats.num_accepted_tokens_per_pos[-1] > 0
    fresh = LLM(str(near_dir), block_size=4, progress=False, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": tokens} for tokens, _ in rounds]
    outputs = [o.outputs[0] for o in fresh.generate(prompts, greedy(max_tokens=4), use_tqdm=False)]
    assert len(rounds) > 20 and len(adopted) == len(rounds) - len(PROMPTS) and sum(adopted) > 0
    assert [draft for _, draft in rounds] == [o.token_ids[: len(d)] for o, (_, d) in zip(outputs, rounds, strict=True)]


def test_auto_asks_the_draft_model_for_the_depth_that_pays(tiny_dir, plain):
    """With "auto" the draft model is not asked before the controller has measured a plain step, then for the depth
    the controller's plan picks (DraftController.draft_depth: at most 8, its rounds' measured cost counted)."""
    reference = run(plain, greedy(max_tokens=30))
    llm = LLM(str(tiny_dir), block_size=4, progress=False, speculative_config=draft_model(tiny_dir, "auto"))
    drafter, asked = llm.engine.core.drafter, []
    propose_batch = drafter.propose_batch
    drafter.propose_batch = lambda requests, k: asked.append(k) or propose_batch(requests, k)
    assert [o.token_ids for o in run(llm, greedy(max_tokens=30))] == [o.token_ids for o in reference]
    assert asked and min(asked) >= 1 and max(asked) <= 8
    assert llm.engine.core.draft_controller.draft_costs.seconds  # every round measured
    assert llm.engine.spec_decode_stats().num_accepted_tokens > 0


def test_requests_with_a_grammar_draft_from_the_model_and_give_the_plain_tokens(tiny_dir, near_dir, plain):
    """The draft model knows no grammar: its drafts are cut before the first token the grammar forbids (as every
    drafter's), and the tokens are the plain run's."""
    from deepinfer.structured import json_object_grammar

    params = [SamplingParams(temperature=0, max_tokens=20, grammar=json_object_grammar()), greedy(max_tokens=20)]
    prompts = PROMPTS[:2]
    reference = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_dir), block_size=4, progress=False, speculative_config=draft_model(near_dir, 4))
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [(o.token_ids, o.finish_reason) for o in outputs] == [(o.token_ids, o.finish_reason) for o in reference]
    assert llm.engine.spec_decode_stats().num_draft_tokens > 0
