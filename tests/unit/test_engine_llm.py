"""The offline engine end to end on a tiny random checkpoint: batching, prefix cache, seeds, n, stops, errors.

References: each request run alone (for batching and preemption), transformers' greedy generate (in
test_model_parity), and a float64 log-softmax for logprobs.
"""

from __future__ import annotations

import math

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.memory import KvCacheTooSmall

PROMPTS = [
    {"prompt_token_ids": [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300, 6]},
    {"prompt_token_ids": [9, 8, 7]},
    {"prompt_token_ids": list(range(40, 75))},
    {"prompt_token_ids": [100]},
]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), block_size=4, progress=False)


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_ragged_batch_equals_one_by_one(llm):
    together = tokens(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    alone = [tokens(llm.generate([p], greedy(), use_tqdm=False))[0] for p in PROMPTS]
    assert together == alone
    assert all(len(t[0]) == 12 for t in together)


def test_prefix_cache_hit_gives_same_tokens(tiny_dir):
    llm = LLM(str(tiny_dir), block_size=4, progress=False)
    cold = llm.generate([PROMPTS[2]], greedy(), use_tqdm=False)[0]
    warm = llm.generate([PROMPTS[2]], greedy(), use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    # 35 prompt tokens: 8 full blocks of 4 are cached (the last prompt token is always recomputed).
    assert warm.num_cached_tokens == 32
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_prefix_cache_hit_gives_same_logprobs(tiny_dir):
    llm = LLM(str(tiny_dir), block_size=4, progress=False)
    params = greedy(max_tokens=4, logprobs=3)
    cold = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].logprobs
    warm_out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert warm_out.num_cached_tokens == 16
    for a, b in zip(cold, warm_out.outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        for token_id in a:
            assert a[token_id].logprob == pytest.approx(b[token_id].logprob, abs=1e-4)


def test_seeded_request_same_alone_and_in_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)
    batch = llm.generate(PROMPTS[1:3] + [PROMPTS[0]] + PROMPTS[3:], [others, others, seeded, others], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    different = llm.generate([PROMPTS[0]], seeded.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert different != alone


def test_n_sequences_share_prompt_and_differ(tiny_dir):
    llm = LLM(str(tiny_dir), block_size=4, progress=False)
    hits = []
    add_request = llm.engine.core.scheduler.add_request

    def spy(request):
        add_request(request)
        hits.append(request)

    llm.engine.core.scheduler.add_request = spy
    out = llm.generate([PROMPTS[2]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    # Siblings 1 and 2 reuse the 8 full prompt blocks sequence 0 computed.
    assert [r.num_cached_tokens for r in hits] == [0, 32, 32]
    again = llm.generate([PROMPTS[2]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False)
    assert tokens(again)[0] == [c.token_ids for c in out.outputs]


def test_logprobs_are_the_raw_distribution(llm, tiny_dir):
    out = llm.generate([PROMPTS[1]], greedy(max_tokens=1, logprobs=5), use_tqdm=False)[0].outputs[0]
    entry = out.logprobs[0]
    assert len(entry) == 5
    ranks = sorted(entry.values(), key=lambda lp: lp.rank)
    assert [lp.rank for lp in ranks] == [1, 2, 3, 4, 5]
    assert ranks[0].logprob >= ranks[-1].logprob
    assert out.token_ids[0] in entry and entry[out.token_ids[0]].rank == 1  # greedy takes rank 1
    assert sum(math.exp(lp.logprob) for lp in entry.values()) < 1.0 + 1e-5


def test_stop_strings_and_stop_tokens(llm):
    base = llm.generate([PROMPTS[0]], greedy(max_tokens=16), use_tqdm=False)[0].outputs[0]
    # A stop token id taken from the greedy output ends the sequence right there, token included.
    stop_id = base.token_ids[5]
    cut = base.token_ids.index(stop_id)
    out = llm.generate([PROMPTS[0]], greedy(max_tokens=16, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[: cut + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    # A stop string taken from the greedy text truncates the text before it.
    text = base.text
    start = next(i for i in range(len(text) // 2, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    out = llm.generate([PROMPTS[0]], greedy(max_tokens=16, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert len(out.token_ids) < len(base.token_ids)


def test_texts_in_a_mixed_batch_are_those_of_one_token_at_a_time(llm):
    # Sequences without stop strings are detokenized once finished, those with stop strings step by step with
    # every window of a step in one batch (per skip_special_tokens): both must give the token-by-token text.
    from deepinfer.tokenizer import IncrementalDetokenizer, StopChecker

    never = ["@@never@@", "\x00\x01"]
    params = [greedy(max_tokens=24), greedy(max_tokens=24, stop=never),
              greedy(max_tokens=24, stop=never, skip_special_tokens=False),
              SamplingParams(temperature=1.0, seed=7, max_tokens=20, skip_special_tokens=False),
              SamplingParams(temperature=1.0, seed=8, max_tokens=20, stop=never, n=2)]
    outputs = llm.generate(PROMPTS + [PROMPTS[0]], params, use_tqdm=False)
    for output, p in zip(outputs, params, strict=True):
        for c in output.outputs:
            detokenizer = IncrementalDetokenizer(llm.tokenizer, output.prompt_token_ids, p.skip_special_tokens)
            checker = StopChecker(p.stop, p.include_stop_str_in_output)
            text = "".join(checker.step(detokenizer.step([t]))[0] for t in c.token_ids)
            text += checker.step(detokenizer.flush())[0] + checker.flush()
            assert c.text == text and c.finish_reason == "length"


def test_eos_and_min_tokens(tiny_dir):
    llm = LLM(str(tiny_dir), block_size=4, progress=False)
    base = llm.generate([PROMPTS[1]], greedy(max_tokens=8), use_tqdm=False)[0].outputs[0]
    # Treat a token the model emits at step 3 as eos through stop_token_ids + min_tokens.
    token = base.token_ids[2]
    first = base.token_ids.index(token)
    out = llm.generate(
        [PROMPTS[1]], greedy(max_tokens=8, stop_token_ids=[token], min_tokens=first + 2), use_tqdm=False
    )[0].outputs[0]
    # The stop token is banned until min_tokens outputs exist, so it cannot end the sequence early.
    assert len(out.token_ids) >= first + 2
    assert token not in out.token_ids[: first + 2]


def test_preemption_gives_same_tokens(tiny_dir):
    # 14 blocks of 4 tokens cannot hold four 35+16-token sequences at once: requests get preempted.
    bytes_per_block = LLM(str(tiny_dir), block_size=4, progress=False).engine.core.kv_plan.bytes_per_block
    small = LLM(str(tiny_dir), block_size=4, kv_cache_bytes=14 * bytes_per_block, max_model_len=52, progress=False)
    assert small.engine.core.kv_plan.num_blocks == 14
    prompts = [PROMPTS[2]] * 4
    params = [greedy(max_tokens=16)] * 4
    out = tokens(small.generate(prompts, params, use_tqdm=False))
    big = LLM(str(tiny_dir), block_size=4, progress=False, enable_prefix_caching=False)
    assert out == tokens(big.generate(prompts, params, use_tqdm=False))


def test_bad_input_names_the_field_and_engine_keeps_serving(llm):
    cases = [
        (lambda: llm.generate([{"prompt_token_ids": []}], greedy(), use_tqdm=False), "prompt"),
        (lambda: llm.generate([{"prompt_token_ids": [1] * 600}], greedy(), use_tqdm=False), "prompt"),
        (lambda: llm.generate([{"prompt_token_ids": [10_000]}], greedy(), use_tqdm=False), "prompt_token_ids"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(temperature=-1), "temperature"),
        (lambda: SamplingParams(top_p=0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: SamplingParams(n=0), "n"),
    ]
    for call, field in cases:
        with pytest.raises(ValueError, match=rf"^{field}\b"):
            call()
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([PROMPTS[1]], greedy(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_kv_cache_too_small_fails_at_start_with_numbers(tiny_dir):
    with pytest.raises(KvCacheTooSmall, match=r"max_model_len=512 needs at least 129 blocks"):
        LLM(str(tiny_dir), block_size=4, kv_cache_bytes=4096, progress=False)


def test_chat_uses_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hello, world!"}]
    out = llm.chat(messages, greedy(max_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode_chat(messages, add_generation_prompt=True)
    assert out.prompt.endswith("<|im_start|>assistant\n")
