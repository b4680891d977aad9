"""Speculative decoding through `LLM` on a tiny random Llama (CPU, float32): the same tokens as without it.

Each test runs the same requests without speculation (the reference) and with it. The n-gram drafter proposes
from repetitive prompts, but a random model rarely continues them, so most of its drafts are rejected; the
`ScriptedDrafter` proposes the reference's own tokens (all accepted) or those with every third one wrong (partial
accepts, rollbacks), so the paths where drafts are kept are exercised too.
"""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.drafter import Draft
from deepinfer.testing.drafters import ScriptedDrafter

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
#: Repetitive prompts of different lengths (n-gram lookup finds their suffixes earlier).
PROMPTS = [
    {"prompt_token_ids": [5, 17, 42, 99, 7] * 5},
    {"prompt_token_ids": [9, 8, 7, 9, 8]},
    {"prompt_token_ids": list(range(40, 60)) * 2 + [40, 41]},
    {"prompt_token_ids": [100, 3, 100, 3, 100, 3, 100]},
]


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return LLM(str(tiny_dir), block_size=4, progress=False)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def spec(tiny_dir, request):
    """Drafting by n-gram (k=4) on the synchronous engine, and on the asynchronous one (its steps with drafts
    synchronous between asynchronous ones: EngineCore._step_speculative)."""
    return LLM(str(tiny_dir), block_size=4, progress=False, speculative_config=NGRAM, async_scheduling=request.param)


def greedy(max_tokens=24, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(llm, params, prompts=PROMPTS):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def scripted(llm, reference, prompts=PROMPTS, wrong_every=0):
    """Make `llm` draft the reference outputs (token ids) of `prompts`."""
    continuations = {tuple(p["prompt_token_ids"]): out.token_ids for p, out in zip(prompts, reference, strict=True)}
    llm.engine.install_drafter(drafter := ScriptedDrafter(continuations, wrong_every))
    return drafter


def test_ngram_drafts_greedy_equal_plain_on_a_ragged_batch(plain, spec):
    before = spec.engine.spec_decode_stats()
    reference = run(plain, greedy())
    outputs = run(spec, greedy())
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    stats = spec.engine.spec_decode_stats()
    assert stats.num_drafts > before.num_drafts  # the repetitive prompts were drafted from


SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}


@pytest.mark.parametrize("k", [4, "auto"])
def test_suffix_drafts_greedy_equal_plain_and_draft_a_batch_sent_again(tiny_dir, plain, k):
    """Suffix decoding on the ragged batch: the plain tokens (from the repetitive prompts, mostly rejected by the
    random model); the same batch sent again drafts the first run's outputs from the global tree, and keeps them."""
    reference = run(plain, greedy())
    llm = LLM(str(tiny_dir), block_size=4, progress=False,
              speculative_config={**SUFFIX, "num_speculative_tokens": k})
    assert [o.token_ids for o in run(llm, greedy())] == [o.token_ids for o in reference]
    first = llm.engine.spec_decode_stats()
    assert first.num_drafts > 0
    assert [o.token_ids for o in run(llm, greedy())] == [o.token_ids for o in reference]
    stats = llm.engine.spec_decode_stats()
    drafted, accepted = (stats.num_draft_tokens - first.num_draft_tokens,
                         stats.num_accepted_tokens - first.num_accepted_tokens)
    assert drafted > 0 and accepted / drafted > 0.9, (drafted, accepted)
    # The first run's requests retired when the second's came; the second's as they finish (swept while others run).
    assert len(PROMPTS) <= llm.engine.core.drafter.num_cached_requests <= 2 * len(PROMPTS)


@pytest.mark.parametrize("wrong_every", [0, 3])
def test_scripted_drafts_give_the_plain_tokens_and_logprobs(plain, spec, wrong_every):
    params = greedy(logprobs=2)
    reference = run(plain, params)
    drafter = scripted(spec, reference, wrong_every=wrong_every)
    before = spec.engine.spec_decode_stats()
    outputs = run(spec, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    for out, ref in zip(outputs, reference, strict=True):
        # The target's logprobs, top 2 included. A verify step computes its rows as one multi-row query (other
        # GEMM shapes, the prefill attention path): float32 rounding apart, ~1e-5.
        for got, want in zip(out.logprobs, ref.logprobs, strict=True):
            assert got.keys() == want.keys()
            assert all(got[t].logprob == pytest.approx(want[t].logprob, abs=1e-4) for t in want)
    stats = spec.engine.spec_decode_stats()
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    assert drafter.num_proposed > 0 and drafted > 0
    assert (accepted == drafted) == (wrong_every == 0) and accepted > 0


@pytest.mark.parametrize("wrong_every", [0, 3])
def test_auto_draft_lengths_give_the_plain_tokens(tiny_dir, plain, wrong_every):
    reference = run(plain, greedy(max_tokens=30))
    auto = LLM(str(tiny_dir), block_size=4, progress=False, speculative_config={**NGRAM, "num_speculative_tokens": "auto"})
    # n-gram drafts first (mostly rejected by the random model), then scripted ones.
    assert [o.token_ids for o in run(auto, greedy(max_tokens=30))] == [o.token_ids for o in reference]
    drafter = scripted(auto, reference, wrong_every=wrong_every)
    before = auto.engine.spec_decode_stats()
    assert [o.token_ids for o in run(auto, greedy(max_tokens=30))] == [o.token_ids for o in reference]
    stats = auto.engine.spec_decode_stats()
    # The controller verified some of the scripted drafts (never longer than proposed), and kept the good ones.
    assert drafter.num_proposed > 0 and stats.num_accepted_tokens > before.num_accepted_tokens
    assert auto.engine.core.draft_controller.costs.seconds  # decode steps were measured


def test_install_drafter_changes_the_draft_length_or_stops_drafting(tiny_dir, plain):
    reference = run(plain, greedy())
    auto = LLM(str(tiny_dir), block_size=4, progress=False, speculative_config={**NGRAM, "num_speculative_tokens": "auto"})
    continuations = {tuple(p["prompt_token_ids"]): o.token_ids for p, o in zip(PROMPTS, reference, strict=True)}
    for k in (2, "auto", None):
        auto.engine.install_drafter(None if k is None else ScriptedDrafter(continuations), k)
        before = auto.engine.spec_decode_stats()
        assert [o.token_ids for o in run(auto, greedy())] == [o.token_ids for o in reference]
        stats = auto.engine.spec_decode_stats()
        drafts, drafted = stats.num_drafts - before.num_drafts, stats.num_draft_tokens - before.num_draft_tokens
        if k is None:
            assert drafts == 0 and auto.engine.core.draft_controller is None
        else:
            assert drafts > 0 and stats.num_accepted_tokens - before.num_accepted_tokens == drafted
            assert drafted <= 2 * drafts if k == 2 else auto.engine.core.draft_controller.costs.seconds
    with pytest.raises(ValueError, match="drafts more than the 8 tokens"):
        auto.engine.install_drafter(None, 9)
    with pytest.raises(ValueError, match="built without a speculative_config"):
        plain.engine.install_drafter(None)


def test_acceptance_counters_of_a_fully_accepted_run(tiny_dir, plain):
    prompt = [PROMPTS[1]]
    reference = run(plain, greedy(max_tokens=13), prompt)
    llm = LLM(str(tiny_dir), block_size=4, progress=False, speculative_config=NGRAM)
    scripted(llm, reference, prompt)
    assert run(llm, greedy(max_tokens=13), prompt)[0].token_ids == reference[0].token_ids
    # Token 1 from the prompt step; then 4 drafts (+1) -> 6 tokens; 4 (+1) -> 11; max_tokens leaves 1 draft (+1).
    stats = llm.engine.spec_decode_stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 9)
    assert stats.num_accepted_tokens_per_pos == [3, 2, 2, 2]
    assert stats.acceptance_rate == 1.0 and stats.mean_acceptance_length == 4.0


def test_stop_token_and_max_tokens_inside_an_accepted_run(plain, spec):
    reference = run(plain, greedy(max_tokens=24))
    scripted(spec, reference)
    for out in reference:
        tokens = out.token_ids
        i = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])  # first occurrence past 3
        stopped = greedy(max_tokens=24, stop_token_ids=[tokens[i]])
        for params in (stopped, greedy(max_tokens=i + 1)):
            want = run(plain, params, PROMPTS)
            got = run(spec, params, PROMPTS)
            assert [(o.token_ids, o.finish_reason, o.stop_reason) for o in got] == [
                (o.token_ids, o.finish_reason, o.stop_reason) for o in want]


def test_stop_string_inside_an_accepted_run_cuts_text_and_tokens_as_plain(plain, spec):
    reference = run(plain, greedy())
    scripted(spec, reference)
    for out in reference:
        text = out.text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        if not stop.strip():
            continue
        params = greedy(stop=[stop])
        want, got = run(plain, params), run(spec, params)
        assert [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in got] == [
            (o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in want]


def test_seeded_sampling_gives_the_plain_tokens(plain, spec):
    # Verification samples every row with the noise of its (seed, position), as the plain run does: a one-hot
    # draft is kept exactly when it equals that sample (deepinfer.sampling.rejection), so the outputs coincide.
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=20, ignore_eos=True, seed=1234,
                            repetition_penalty=1.2, frequency_penalty=0.3)
    reference = run(plain, params)
    assert [o.token_ids for o in run(spec, params)] == [o.token_ids for o in reference]  # n-gram drafts
    scripted(spec, reference, wrong_every=3)
    first = run(spec, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in reference]
    assert [o.token_ids for o in run(spec, params)] == [o.token_ids for o in first]


def test_penalties_and_min_tokens_see_the_accepted_drafts(plain, spec):
    params = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.5, presence_penalty=0.5,
                            min_tokens=6)
    reference = run(plain, params)
    scripted(spec, reference, wrong_every=4)
    assert [(o.token_ids, o.finish_reason) for o in run(spec, params)] == [
        (o.token_ids, o.finish_reason) for o in reference]


def test_block_pool_after_a_run_is_as_without_speculation(tiny_dir):
    def pool_after(llm, params):
        run(llm, params)
        pool = llm.engine.core.scheduler.block_pool
        events = llm.engine.take_kv_events()
        return pool.num_free_blocks, set(pool.cached_block_hash_to_block), sorted(
            h for e in events for h in e.block_hashes)

    kwargs = dict(block_size=4, progress=False, enable_kv_events=True)
    plain = LLM(str(tiny_dir), **kwargs)
    reference = run(LLM(str(tiny_dir), block_size=4, progress=False), greedy(max_tokens=30))
    spec = LLM(str(tiny_dir), speculative_config=NGRAM, **kwargs)
    scripted(spec, reference, wrong_every=3)
    want = pool_after(plain, greedy(max_tokens=30))
    assert pool_after(spec, greedy(max_tokens=30)) == want
    assert want[0] == plain.engine.num_kv_blocks - 1 and want[1]


def test_a_bad_speculative_config_is_refused_at_construction(tiny_dir):
    cases = {
        "method must be one of": {"method": "eagle", "num_speculative_tokens": 2},
        "has no MTP layer": {"method": "mtp", "num_speculative_tokens": 1},  # a Llama
        "missing num_speculative_tokens": {"method": "ngram"},
        "num_speculative_tokens must be an int >= 1": {"method": "ngram", "num_speculative_tokens": 0},
        "unknown keys": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup": 3},
        "prompt_lookup_min=4 must be <= prompt_lookup_max=2": {
            "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
    }
    for message, config in cases.items():
        with pytest.raises(ValueError, match=message):
            LLM(str(tiny_dir), progress=False, speculative_config=config)
    with pytest.raises(ValueError, match="batch_invariant=True"):
        LLM(str(tiny_dir), progress=False, speculative_config=NGRAM, batch_invariant=True)


def test_steps_with_drafts_run_the_full_graphs_while_their_rows_fit_the_slots(tiny_dir, plain):
    """With a (CPU, uncaptured) full-graph runner of 8 sequence slots, a step verifying drafts runs the graph when
    its k + 1 rows a sequence fit the slots (one prompt: 5 rows) and eagerly when they do not (four prompts: 20
    rows), with the plain tokens either way."""
    from deepinfer.engine.full_graphs import FullGraphRunner

    reference = run(plain, greedy())
    llm = LLM(str(tiny_dir), block_size=4, progress=False, speculative_config=NGRAM | {"num_speculative_tokens": "auto"})
    runner, core = llm.engine.core.runner, llm.engine.core
    runner.full_graphs = graphs = FullGraphRunner(runner.model, runner.kv_caches, 128, 8, core.max_model_len, 4,
                                                  runner.device, use_graphs=False, logits=runner.model.compute_logits)
    graph_verifies, verifies = [], []
    graph_run, execute_verify = graphs.run, runner.execute_verify

    def run_and_count(input_ids, positions, meta, logits_indices):
        assert len(logits_indices) <= 8
        if len(logits_indices) > meta.num_seqs:
            graph_verifies.append(len(logits_indices))
        return graph_run(input_ids, positions, meta, logits_indices)

    def verify_and_count(output, requests):
        verifies.append(sum(s.num_draft_tokens + 1 for s in output.scheduled if s.sample))
        return execute_verify(output, requests)

    graphs.run, runner.execute_verify = run_and_count, verify_and_count
    continuations = {tuple(p["prompt_token_ids"]): o.token_ids for p, o in zip(PROMPTS, reference, strict=True)}
    llm.engine.install_drafter(ScriptedDrafter(continuations, 3), 4)
    assert [o.token_ids for o in run(llm, greedy())] == [o.token_ids for o in reference]
    assert [o.token_ids for o in run(llm, greedy(), PROMPTS[:1])] == [reference[0].token_ids]
    assert graph_verifies and llm.engine.spec_decode_stats().num_accepted_tokens > 0
    assert any(n > 8 for n in verifies)  # steps whose rows did not fit ran eagerly, with the same tokens
    assert len(graph_verifies) == sum(n <= 8 for n in verifies)
    # "auto" keeps every verify step within the graphs' 8 rows (the draft controller's cap), tokens unchanged.
    assert runner.max_graphed_verify_tokens == 8
    verifies.clear()
    llm.engine.install_drafter(ScriptedDrafter(continuations), "auto")
    assert [o.token_ids for o in run(llm, greedy())] == [o.token_ids for o in reference]
    assert verifies and max(verifies) <= 8


def test_auto_proposes_no_draft_while_the_decodes_fill_the_graphs_rows(tiny_dir, plain):
    """With "auto" and graphs that verify at most 2 rows a step, a step whose 4 decodes fill them asks the drafter
    for nothing (no draft could be verified: its lookups would be host time for nothing); one decode alone drafts."""
    from deepinfer.engine.full_graphs import FullGraphRunner

    reference = run(plain, greedy())
    llm = LLM(str(tiny_dir), block_size=4, progress=False, speculative_config=NGRAM | {"num_speculative_tokens": "auto"})
    runner, core = llm.engine.core.runner, llm.engine.core
    runner.full_graphs = FullGraphRunner(runner.model, runner.kv_caches, 128, 2, core.max_model_len, 4, runner.device,
                                         use_graphs=False, logits=runner.model.compute_logits)
    assert runner.max_graphed_verify_tokens == 2
    drafter = ScriptedDrafter({tuple(p["prompt_token_ids"]): o.token_ids for p, o in zip(PROMPTS, reference, strict=True)})
    proposals, propose = [], drafter.propose
    drafter.propose = lambda request, k: proposals.append(request.request_id) or propose(request, k)
    llm.engine.install_drafter(drafter, "auto")
    assert [o.token_ids for o in run(llm, greedy())] == [o.token_ids for o in reference]
    assert proposals == []
    assert [o.token_ids for o in run(llm, greedy(), PROMPTS[:1])] == [reference[0].token_ids]
    assert proposals and llm.engine.spec_decode_stats().num_accepted_tokens > 0


@pytest.mark.parametrize("k", [4, "auto"])
def test_async_scheduling_with_drafts_gives_the_plain_tokens(tiny_dir, plain, k):
    """With async scheduling, steps with drafts run synchronously between asynchronous ones (auto: the engine
    steps asynchronously until drafting may pay, then proposes): the plain tokens and logprobs, greedy and seeded,
    both kinds of step taken, the block pool as after a plain run."""
    reference = run(plain, greedy(logprobs=2))
    seeded = run(plain, SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True))
    llm = LLM(str(tiny_dir), block_size=4, progress=False, async_scheduling=True,
              speculative_config=NGRAM | {"num_speculative_tokens": k if k == "auto" else 4})
    core = llm.engine.core
    assert core.async_scheduling
    counts = {"execute_async": 0, "execute_verify": 0}
    for name in counts:
        method = getattr(core.runner, name)

        def counted(*args, _method=method, _name=name):
            counts[_name] += 1
            return _method(*args)

        setattr(core.runner, name, counted)
    continuations = {tuple(p["prompt_token_ids"]): o.token_ids for p, o in zip(PROMPTS, reference, strict=True)}
    llm.engine.install_drafter(ScriptedDrafter(continuations, 3), k)
    outs = run(llm, greedy(logprobs=2))
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert [[sorted(p) for p in o.logprobs] for o in outs] == [[sorted(p) for p in o.logprobs] for o in reference]
    assert counts["execute_async"] > 0 and counts["execute_verify"] > 0
    assert llm.engine.spec_decode_stats().num_accepted_tokens > 0
    seeded_continuations = {tuple(p["prompt_token_ids"]): o.token_ids for p, o in zip(PROMPTS, seeded, strict=True)}
    llm.engine.install_drafter(ScriptedDrafter(seeded_continuations, 2), k)
    again = run(llm, SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in again] == [o.token_ids for o in seeded]
    pool = core.scheduler.block_pool
    assert pool.num_free_blocks == plain.engine.core.scheduler.block_pool.num_free_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_with_drafts_gives_the_plain_tokens(tiny_dir, plain, async_scheduling):
    # 16 blocks of 4 tokens cannot hold four 22+20-token sequences at once: requests are preempted (and resumed
    # from the prefix cache) between steps that verify drafts; the drafts never preempt by themselves.
    prompts = [{"prompt_token_ids": list(range(40, 60)) + [40, 41 + i]} for i in range(4)]
    reference = run(plain, greedy(max_tokens=20), prompts)
    bytes_per_block = plain.engine.core.kv_plan.bytes_per_block
    small = LLM(str(tiny_dir), block_size=4, kv_cache_bytes=16 * bytes_per_block, max_model_len=48, progress=False,
                speculative_config=NGRAM, async_scheduling=async_scheduling)
    scripted(small, reference, prompts, wrong_every=3)
    scheduler, preempted = small.engine.core.scheduler, []
    preempt = scheduler._preempt
    scheduler._preempt = lambda request, step: preempted.append(request.request_id) or preempt(request, step)
    assert [o.token_ids for o in run(small, greedy(max_tokens=20), prompts)] == [o.token_ids for o in reference]
    assert preempted and scheduler.block_pool.num_free_blocks == 15
    assert small.engine.spec_decode_stats().num_accepted_tokens > 0


def test_the_gpu_kv_budget_leaves_room_for_the_logits_of_every_verified_row(plain, spec):
    args = spec.engine.args
    assert plain.engine.core._max_sampled_rows() == args.max_num_seqs
    assert spec.engine.core._max_sampled_rows() == min(args.max_num_seqs * 5, args.max_num_batched_tokens)


def test_the_default_model_accepts_ngram_drafts_when_asked_to_repeat_text(prepared_dir):
    """The real default model copying a text: n-gram drafts are mostly accepted, the tokens those of a plain run
    (a batch of two chat prompts of different lengths; max_tokens 40, a stop on <|im_end|> possible)."""
    import torch

    torch.set_num_threads(1)
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill."
    conversations = [[{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}],
                     [{"role": "user", "content": f"Repeat this text exactly, twice:\n\n{text} {text}"}]]
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = LLM(str(prepared_dir), progress=False)
    spec = LLM(str(prepared_dir), progress=False, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    reference = [o.outputs[0] for o in plain.chat(conversations, params, use_tqdm=False)]
    outputs = [o.outputs[0] for o in spec.chat(conversations, params, use_tqdm=False)]
    assert [(o.token_ids, o.text) for o in outputs] == [(o.token_ids, o.text) for o in reference]
    assert text[:20] in reference[0].text
    stats = spec.engine.spec_decode_stats()
    assert stats.num_drafts > 0 and stats.acceptance_rate > 0.5, stats


#: A JSON schema a random model completes in a few tokens (then stops), and any JSON object (runs to max_tokens).
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}


def grammar_params(max_tokens=24):
    """Greedy under a JSON schema, under any JSON object, and free (a ragged batch of all three)."""
    from deepinfer.structured import json_object_grammar, json_schema_grammar

    return [SamplingParams(temperature=0, max_tokens=max_tokens, grammar=json_schema_grammar(SCHEMA)),
            SamplingParams(temperature=0, max_tokens=max_tokens, grammar=json_object_grammar()),
            SamplingParams(temperature=0, max_tokens=max_tokens, grammar=json_schema_grammar(SCHEMA)),
            greedy(max_tokens=max_tokens)]


@pytest.mark.parametrize("wrong_every", [0, 3])
def test_requests_with_a_grammar_verify_drafts_and_give_the_plain_tokens(plain, spec, wrong_every):
    params = grammar_params()
    reference = [o.outputs[0] for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert reference[0].text.startswith('{"ok"') and reference[1].text.startswith("{")
    drafter = scripted(spec, reference, wrong_every=wrong_every)
    asked, propose = [], drafter.propose
    drafter.propose = lambda request, k: asked.append(request.prompt_token_ids) or propose(request, k)
    before = spec.engine.spec_decode_stats()
    outputs = [o.outputs[0] for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    assert [(o.token_ids, o.finish_reason) for o in outputs] == [(o.token_ids, o.finish_reason) for o in reference]
    stats = spec.engine.spec_decode_stats()
    # The grammar requests drafted too (the schema's stop inside an accepted run ends them as plain).
    assert {tuple(p) for p in asked} == {tuple(p["prompt_token_ids"]) for p in PROMPTS}
    accepted, drafted = (stats.num_accepted_tokens - before.num_accepted_tokens,
                         stats.num_draft_tokens - before.num_draft_tokens)
    assert accepted > 0 and (accepted == drafted) == (wrong_every == 0)


def test_seeded_sampling_under_a_grammar_gives_the_plain_tokens(plain, spec):
    from deepinfer.structured import json_object_grammar

    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=20, seed=7, grammar=json_object_grammar())
    reference = run(plain, params)
    scripted(spec, reference, wrong_every=3)
    before = spec.engine.spec_decode_stats()
    assert [(o.token_ids, o.finish_reason) for o in run(spec, params)] == [
        (o.token_ids, o.finish_reason) for o in reference
    ]
    assert spec.engine.spec_decode_stats().num_accepted_tokens > before.num_accepted_tokens


def test_a_draft_running_past_the_grammar_s_end_stops_where_the_plain_run_does(tiny_dir, plain):
    # The drafts carry the plain output, then EOS twice: the rows past the token that completes the grammar are
    # verified under the stopped grammar's mask and dropped.
    params = grammar_params()[:3]
    prompts = PROMPTS[:3]
    reference = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.finish_reason for o in reference] == ["stop"] * 3
    eos = min(plain.engine.core.eos_token_ids)
    llm = LLM(str(tiny_dir), block_size=4, progress=False, speculative_config=NGRAM)
    drafter = ScriptedDrafter(
        {tuple(p["prompt_token_ids"]): [*o.token_ids, eos, eos] for p, o in zip(prompts, reference, strict=True)})
    llm.engine.install_drafter(drafter)
    past_the_end, propose = [], drafter.propose
    drafter.propose = lambda request, k: (draft := propose(request, k)) and (
        past_the_end.append(eos in draft.token_ids) or draft)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [(o.token_ids, o.finish_reason) for o in outputs] == [(o.token_ids, o.finish_reason) for o in reference]
    assert any(past_the_end) and llm.engine.spec_decode_stats().num_accepted_tokens > 0


class ForbiddingDrafter(ScriptedDrafter):
    """Drafts the known next token, then one the request's grammar forbids after it, then the known tokens
    again: the engine must cut each draft to its first token before verifying it."""

    def propose(self, request, num_tokens):
        draft = super().propose(request, num_tokens).token_ids
        grammar = request.grammar
        if len(draft) < 2 or grammar is None or grammar.num_allowed(draft[:1]) == 0:
            return Draft(draft)
        allowed = int.from_bytes(grammar.bitmasks_along(draft[:1])[1], "little")
        forbidden = next(t for t in range(grammar.vocab_size) if not allowed >> t & 1)
        return Draft([draft[0], forbidden, *draft[2:]])


def test_a_draft_token_the_grammar_forbids_is_never_verified(tiny_dir, plain):
    params = grammar_params()[:2]
    prompts = PROMPTS[:2]
    reference = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_dir), block_size=4, progress=False, speculative_config=NGRAM)
    continuations = {tuple(p["prompt_token_ids"]): o.token_ids for p, o in zip(prompts, reference, strict=True)}
    llm.engine.install_drafter(drafter := ForbiddingDrafter(continuations))
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [(o.token_ids, o.finish_reason) for o in outputs] == [(o.token_ids, o.finish_reason) for o in reference]
    stats = llm.engine.spec_decode_stats()
    # Every verified draft was its first (right) token alone: the forbidden second never reached the model.
    assert drafter.num_proposed > 0 and stats.num_drafts > 0
    assert stats.num_draft_tokens == stats.num_accepted_tokens == stats.num_drafts


def test_bitmasks_along_a_draft_leave_the_matcher_where_it_was(plain):
    from deepinfer.structured import json_schema_grammar

    grammars = plain.engine.core.grammars
    tokens = plain.get_tokenizer().encode('{"ok": true, "n": 7}', add_special_tokens=False)
    matcher, walker = grammars.matcher(json_schema_grammar(SCHEMA)), grammars.matcher(json_schema_grammar(SCHEMA))
    assert matcher.num_allowed(tokens) == len(tokens) and matcher.num_allowed([*tokens[:2], tokens[0]]) == 2
    masks = matcher.bitmasks_along(tokens[:3])
    assert matcher.bitmask() == masks[0]
    for i, token_id in enumerate(tokens[:3]):
        assert walker.bitmask() == masks[i]
        walker.accept(token_id)
    assert walker.bitmask() == masks[3]
    # Through the end of the object, an EOS (off llguidance's rollback stack once the grammar is stopped) and past.
    eos = min(plain.engine.core.eos_token_ids)
    masks = matcher.bitmasks_along([*tokens, eos, eos])
    assert len(masks) == len(tokens) + 3 and masks[-1] == masks[-2] == masks[-3] and matcher.bitmask() == masks[0]
    assert matcher.accept_all(tokens) and matcher.is_stopped  # unmoved: the whole object still fits
