"""Prompt logprobs (SamplingParams.prompt_logprobs) through the offline engine on a tiny random checkpoint, against
transformers' float64 log-softmax of the same weights: whole and chunked prompts, sync and async scheduling, a
cold and a warm prefix, preemption while the prompt is computed, and the rows a chunk scores (exact positions)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.outputs import PromptLogprobs
from deepinfer.engine.prompt_logprobs import prompt_rows
from deepinfer.engine.request import Request

PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300, 6]
OTHER = list(range(40, 75))
#: float32 engine against a float64 reference of the same weights.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """prompt -> [P, V] float64 log-softmax of transformers' logits (row i predicts token i + 1)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()

    def log_softmax(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), dim=-1)

    return log_softmax


def params(k=3, **kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 2, "ignore_eos": True, "prompt_logprobs": k, **kw})


def check(prompt, dicts, ref, k=3):
    """vLLM's shape, each prompt token's logprob and rank, and the top k, against the reference."""
    assert len(dicts) == len(prompt) and dicts[0] is None
    for i, entry in enumerate(dicts[1:], start=1):
        row = ref[i - 1]
        token = entry[prompt[i]]
        assert token.logprob == pytest.approx(row[prompt[i]].item(), abs=TOLERANCE)
        assert token.rank == int((row > row[prompt[i]]).sum()) + 1
        top = row.topk(k)
        for rank, (token_id, logprob) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True), 1):
            assert entry[token_id].logprob == pytest.approx(logprob, abs=TOLERANCE)
            assert entry[token_id].rank == (token.rank if token_id == prompt[i] else rank)
        assert len(entry) in (k, k + 1)  # the prompt token and the top k (one entry when it is among them)


@pytest.mark.parametrize("engine_kw", [
    {},
    {"max_num_batched_tokens": 8},  # chunked: 20 prompt tokens over three steps
    {"max_num_batched_tokens": 8, "async_scheduling": True},
], ids=["whole", "chunked", "chunked-async"])
def test_prompt_logprobs_match_transformers(tiny_dir, reference, engine_kw):
    llm = LLM(str(tiny_dir), block_size=4, progress=False, **engine_kw)
    outputs = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": OTHER}, {"prompt_token_ids": [9]}],
                           [params(), SamplingParams(temperature=0, max_tokens=3), params(k=0)], use_tqdm=False)
    check(PROMPT, outputs[0].prompt_logprobs, reference(PROMPT))
    assert outputs[1].prompt_logprobs is None  # not asked
    assert outputs[2].prompt_logprobs == [None]  # one token: nothing to score
    assert len(outputs[0].outputs[0].token_ids) == 2


def test_one_token_chunks_beside_decodes(tiny_dir, reference, monkeypatch):
    """A budget of 4 tokens a step and three requests decoding: the scored prompt goes one token a step, in
    decode-only steps (those replay decode graphs on a GPU, whose hidden states give the row)."""
    import deepinfer.engine.inputs as inputs

    chunks: list[int] = []
    rows = inputs.prompt_rows
    monkeypatch.setattr(inputs, "prompt_rows", lambda request, start, num_new: (
        chunks.append(num_new), rows(request, start, num_new))[-1])
    llm = LLM(str(tiny_dir), block_size=4, progress=False, max_num_batched_tokens=4)
    decoders = [{"prompt_token_ids": [5 + i, 9 + i]} for i in range(3)]
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outputs = llm.generate([*decoders, {"prompt_token_ids": PROMPT}], [plain] * 3 + [params()], use_tqdm=False)
    check(PROMPT, outputs[3].prompt_logprobs, reference(PROMPT))
    assert chunks.count(1) >= len(PROMPT) - 4  # most of its prompt went one token a step


def test_warm_prefix_is_recomputed_and_gives_the_same_numbers(tiny_dir, reference):
    """Cached KV has no logits: a request asking for prompt logprobs skips the prefix cache (as vLLM does), yet
    its blocks are cached for others."""
    llm = LLM(str(tiny_dir), block_size=4, progress=False)
    plain = SamplingParams(temperature=0, max_tokens=2)
    assert llm.generate([{"prompt_token_ids": PROMPT}], plain, use_tqdm=False)[0].num_cached_tokens == 0
    warm = llm.generate([{"prompt_token_ids": PROMPT}], params(), use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0  # the prefix was cached, and computed again
    check(PROMPT, warm.prompt_logprobs, reference(PROMPT))
    again = llm.generate([{"prompt_token_ids": PROMPT}], plain, use_tqdm=False)[0]
    assert again.num_cached_tokens == 16


def test_preempted_while_computing_the_prompt(tiny_dir, reference, block_bytes, monkeypatch):
    """A KV cache of 11 blocks for three 20- to 35-token prompts in chunks of 8: requests are preempted mid-prompt
    and recompute it from position 0; each still gets every prompt position scored exactly once."""
    from deepinfer.engine.scheduler import Scheduler

    preempted: list[str] = []
    preempt = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, request, step: (
        preempted.append(request.request_id), preempt(self, request, step))[-1])
    llm = LLM(str(tiny_dir), block_size=4, progress=False, max_num_batched_tokens=8, max_model_len=40,
              kv_cache_bytes=12 * block_bytes)
    prompts = [PROMPT, OTHER, PROMPT[::-1]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params(max_tokens=4), use_tqdm=False)
    assert preempted
    for prompt, output in zip(prompts, outputs, strict=True):
        check(prompt, output.prompt_logprobs, reference(prompt))


def test_n_siblings_reuse_the_prompt(tiny_dir, reference):
    llm = LLM(str(tiny_dir), block_size=4, progress=False)
    output = llm.generate([{"prompt_token_ids": PROMPT}], params(n=2, temperature=1.0, seed=7), use_tqdm=False)[0]
    check(PROMPT, output.prompt_logprobs, reference(PROMPT))
    assert len(output.outputs) == 2


def _request(num_prompt_tokens: int, num_scored: int) -> Request:
    request = Request("r", list(range(num_prompt_tokens)), SamplingParams(prompt_logprobs=0))
    request.prompt_logprobs = PromptLogprobs(logprobs=[0.0] * num_scored)
    return request


@pytest.mark.parametrize(("num_scored", "start", "num_new", "rows"), [
    (0, 0, 4, (1, 4)),  # rows 0..3 score prompt tokens 1..4
    (4, 4, 3, (5, 2)),  # the last chunk: rows 4, 5 score 5, 6; row 6 samples the first output token
    (0, 0, 7, (1, 6)),  # the whole prompt at once
    (0, 0, 1, (1, 1)),  # a one-token chunk
    (6, 6, 1, None),  # the last prompt token alone: its row only samples
    (4, 0, 3, None),  # recomputed after a preemption: tokens 1..3 were scored before
    (4, 0, 6, (5, 2)),  # ... and past them: only the new ones
])
def test_chunk_rows(num_scored, start, num_new, rows):
    """Which prompt positions a chunk of a 7-token prompt scores (deepinfer.engine.prompt_logprobs' diagram)."""
    found = prompt_rows(_request(7, num_scored), start, num_new)
    assert (None if found is None else (found.first, found.num_rows)) == rows


def test_not_asked_or_handed_out_scores_nothing():
    request = _request(7, 0)
    request.prompt_logprobs = None
    assert prompt_rows(request, 0, 7) is None
    assert not request.needs_prompt_logits
