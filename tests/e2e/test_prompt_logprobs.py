"""Prompt log-probabilities through every service, with the official `openai` client, against transformers on the
same weights (float32, CPU): computed by the decode worker (a tiny model's stack with no prefill worker, prompts
chunked over steps) and by the prefill worker (the session's stack, the default model).

Covers completions' echo (text and token-id prompts, a batch, max_tokens 0, streamed), vLLM's prompt_logprobs on
completions and chat, and a cold and a warm prefix giving the same numbers (cached KV has no logits: the prompt
is computed again)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from deepinfer.defaults import default_model_cache_dir
from deepinfer.model_store import resolve_model
from deepinfer.testing.checkpoints import make_tiny_checkpoint
from deepinfer.up import Stack

pytestmark = pytest.mark.e2e

#: A float32 engine against a float64 log-softmax of transformers' float32 logits.
TOLERANCE = 1e-4
TINY_ENV = {
    "DEEPINFER_GATEWAY_API_KEYS": "",
    "OMP_NUM_THREADS": "1",
    "DEEPINFER_DECODE_BLOCK_SIZE": "4",
    # prompts of more than 16 tokens are computed over several steps, their scores gathered across them
    "DEEPINFER_DECODE_MAX_NUM_BATCHED_TOKENS": "16",
    "DEEPINFER_DECODE_DTYPE": "float32",  # a parity test: not "auto" (bfloat16 on a CPU with bf16 instructions)
}
IDS = [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300, 6, 70, 71, 72, 73, 74, 75]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    torch.set_num_threads(1)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("echo") / "llama", "llama")


@pytest.fixture(scope="module")
def tiny_stack(tiny_dir) -> Iterator[Stack]:
    with Stack(model=str(tiny_dir), device="cpu", port=0, num_prefill=0, num_decode=1, num_kvcache=0,
               env_overrides=TINY_ENV, start_timeout_s=240) as running:
        yield running


def transformers_log_softmax(model_dir):
    """prompt ids -> [P, V] float64 log-softmax of transformers' float32 logits (row i predicts token i + 1)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)

    return log_softmax


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir):
    return transformers_log_softmax(tiny_dir)


def check_vllm_shape(ids: list[int], prompt_logprobs: list, ref: torch.Tensor, k: int, tolerance: float) -> None:
    """vLLM's prompt_logprobs against the reference: each token's logprob and rank, and the top k by id."""
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for i, position in enumerate(prompt_logprobs[1:], start=1):
        row, token = ref[i - 1], position[str(ids[i])]
        assert token["logprob"] == pytest.approx(row[ids[i]].item(), abs=tolerance)
        assert token["rank"] == int((row > row[ids[i]]).sum()) + 1
        top = row.topk(k)
        for rank, (token_id, logprob) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True), 1):
            entry = position[str(token_id)]
            assert entry["logprob"] == pytest.approx(logprob, abs=tolerance)
            assert entry["rank"] == (token["rank"] if token_id == ids[i] else rank)


def check_legacy_shape(ids: list[int], logprobs, ref: torch.Tensor, tolerance: float) -> None:
    """OpenAI's legacy lists of an echoed prompt: null first, then each token's logprob; its top_logprobs hold it
    and the most likely token (logprobs=1)."""
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, len(ids)):
        row = ref[i - 1]
        assert logprobs.token_logprobs[i] == pytest.approx(row[ids[i]].item(), abs=tolerance)
        assert max(logprobs.top_logprobs[i].values()) == pytest.approx(row.max().item(), abs=tolerance)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]


def test_echo_scores_match_transformers_when_decode_computes_the_prompt(tiny_stack: Stack, tiny_reference):
    """lm-eval's two requests: echo + logprobs with max_tokens 1 (loglikelihood) and 0 (scoring alone), batched."""
    client = openai.OpenAI(base_url=tiny_stack.base_url, api_key="e2e", max_retries=0, timeout=120)
    prompts = [IDS, IDS[:7], IDS[3:]]
    for max_tokens in (1, 0):
        result = client.completions.create(model=tiny_stack.model_name, prompt=prompts, max_tokens=max_tokens,
                                           echo=True, logprobs=1, temperature=0)
        assert [c.index for c in result.choices] == [0, 1, 2]
        for choice, ids in zip(result.choices, prompts, strict=True):
            assert len(choice.logprobs.tokens) == len(ids) + max_tokens
            check_legacy_shape(ids, choice.logprobs, tiny_reference(ids), TOLERANCE)
        assert result.usage.completion_tokens == len(prompts) * max_tokens


def test_vllm_prompt_logprobs_cold_and_warm_prefix_agree(tiny_stack: Stack, tiny_reference):
    client = openai.OpenAI(base_url=tiny_stack.base_url, api_key="e2e", max_retries=0, timeout=120)
    ids = IDS[::-1]
    cold = client.completions.create(model=tiny_stack.model_name, prompt=ids, max_tokens=2,
                                     extra_body={"prompt_logprobs": 3})
    check_vllm_shape(ids, cold.choices[0].prompt_logprobs, tiny_reference(ids), 3, TOLERANCE)
    plain = client.completions.create(model=tiny_stack.model_name, prompt=ids, max_tokens=2)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0  # the prompt's blocks are cached now
    warm = client.completions.create(model=tiny_stack.model_name, prompt=ids, max_tokens=2,
                                     extra_body={"prompt_logprobs": 3})
    assert warm.usage.prompt_tokens_details.cached_tokens == 0  # computed again: cached KV has no logits
    assert warm.choices[0].prompt_logprobs == cold.choices[0].prompt_logprobs


def test_a_streamed_echo_equals_the_whole_response(tiny_stack: Stack):
    client = openai.OpenAI(base_url=tiny_stack.base_url, api_key="e2e", max_retries=0, timeout=120)
    body = {"model": tiny_stack.model_name, "prompt": [IDS, IDS[:5]], "max_tokens": 4, "echo": True, "logprobs": 2,
            "temperature": 0}
    whole = client.completions.create(**body)
    texts, logprobs = ["", ""], [[], []]
    for chunk in client.completions.create(**body, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            logprobs[choice.index] += choice.logprobs.token_logprobs
    for index, choice in enumerate(whole.choices):
        assert texts[index] == choice.text
        assert logprobs[index][0] is None and choice.logprobs.token_logprobs[0] is None
        assert logprobs[index][1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=TOLERANCE)


def test_echo_scores_match_transformers_when_prefill_computes_the_prompt(stack: Stack, client: openai.OpenAI):
    """The session's stack (the default model, a prefill worker computing prompts): text prompts, chat."""
    from transformers import AutoTokenizer

    model_dir = resolve_model(stack.model, default_model_cache_dir(), progress=False)
    reference, tokenizer = transformers_log_softmax(model_dir), AutoTokenizer.from_pretrained(model_dir)
    prompts = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France, and Berlin is"]
    result = client.completions.create(model=stack.model_name, prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    for choice, text in zip(result.choices, prompts, strict=True):
        ids = tokenizer(text)["input_ids"]
        assert choice.text == text and len(choice.logprobs.tokens) == len(ids)
        check_legacy_shape(ids, choice.logprobs, reference(ids), 5e-4)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=stack.model_name, messages=messages, max_tokens=2,
                                          extra_body={"prompt_logprobs": 2})
    ids = httpx.post(f"{stack.base_url.removesuffix('/v1')}/tokenize", json={"messages": messages},
                     timeout=30).json()["tokens"]  # the chat template as the gateway renders it
    check_vllm_shape(ids, chat.prompt_logprobs, reference(ids), 2, 5e-4)
