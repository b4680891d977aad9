"""Gemma 3 (text) against `transformers` on a tiny random checkpoint whose window (8 keys) is far shorter than
every prompt: five local layers then a global one, each type with its own RoPE base.

Tolerance, stated once: |ours - hf| <= 1e-4 * max|hf logits| elementwise (float32, CPU), as test_model_parity.
transformers runs with attn_implementation="eager" (its reference attention, with the sliding mask built by
masking_utils: a key at distance >= sliding_window is masked).
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.kernels import get_ops
from deepinfer.loader.hf import load_model
from deepinfer.models.config import ModelConfig
from deepinfer.testing.checkpoints import make_tiny_checkpoint
from deepinfer.testing.paged_cache import PagedCache, assert_close_logits
from deepinfer.testing.paged_cache import random_prompt as prompt

REL_TOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 160
WINDOW = 8
NEW_TOKENS = 32

paged = functools.partial(PagedCache.for_model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
assert_close = functools.partial(assert_close_logits, rel_tol=REL_TOL)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def models(tiny_dir):
    """(our model, transformers' Gemma3ForCausalLM) from the same checkpoint."""
    from transformers import AutoModelForCausalLM

    ours = load_model(tiny_dir, torch.float32, torch.device("cpu"), get_ops("cpu"), progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    hf.generation_config.eos_token_id = None  # a random model may emit eos: generate every token
    return ours, hf


def hf_greedy(hf, token_ids: list[int], num_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([token_ids]), do_sample=False, max_new_tokens=num_tokens, pad_token_id=1)
    return out[0, len(token_ids):].tolist()


def test_config_reads_layer_types_window_and_both_rope_bases(tiny_dir, models):
    ours, _ = models
    config = ours.config
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert config.sliding_window == WINDOW and config.rope_theta == 1_000_000.0
    windows = [layer.self_attn.sliding_window for layer in ours.model.layers]
    assert windows == [WINDOW] * 5 + [None]
    bases = [layer.self_attn.rotary.config.rope_theta for layer in ours.model.layers]
    assert bases == [10_000.0] * 5 + [1_000_000.0]
    assert ours.model.layers[0].self_attn.scale == pytest.approx(24**-0.5)


def test_older_config_style_gives_the_same_layers():
    """transformers 4.x Gemma 3 configs: rope_theta / rope_local_base_freq and sliding_window_pattern."""
    old = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 384, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 12, "num_attention_heads": 4, "head_dim": 16,
           "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window": 512,
           "sliding_window_pattern": 6, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    config = ModelConfig.from_hf_config(old)
    assert config.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 2
    assert config.rope_theta == 1_000_000.0 and config.rope_scaling == {"rope_type": "linear", "factor": 8.0}


@pytest.mark.parametrize("field", ["attn_logit_softcapping", "use_bidirectional_attention"])
def test_unsupported_variants_are_refused(tiny_dir, field):
    import json

    hf = json.loads((tiny_dir / "config.json").read_text())
    hf[field] = 50.0 if field == "attn_logit_softcapping" else True
    from deepinfer.models.gemma3 import Gemma3ForCausalLM

    with pytest.raises(ValueError, match=field):
        Gemma3ForCausalLM(ModelConfig.from_hf_config(hf), get_ops("cpu"))


def test_prefill_logits_match_past_the_window(models):
    ours, hf = models
    token_ids = prompt(37, seed=1, vocab_size=ours.config.vocab_size)
    (logits,) = paged(ours).step(ours, [(0, token_ids, 0)])
    with torch.no_grad():
        ref = hf(torch.tensor([token_ids])).logits[0].float()
    assert_close(logits, ref, "prefill logits")


@pytest.mark.parametrize("length", [9, 21, 40])
def test_greedy_tokens_match_generate_as_decode_crosses_the_window(models, length):
    ours, hf = models
    token_ids = prompt(length, seed=length, vocab_size=ours.config.vocab_size)
    cache = paged(ours)
    (logits,) = cache.step(ours, [(0, token_ids, 0)])
    generated = [int(logits[-1].argmax())]
    while len(generated) < NEW_TOKENS:
        (logits,) = cache.step(ours, [(0, generated[-1:], length + len(generated) - 1)])
        generated.append(int(logits[-1].argmax()))
    assert generated == hf_greedy(hf, token_ids)


def test_chunks_and_ragged_batches_match_one_prefill(models):
    """A prompt prefilled in chunks (each chunk's queries reading keys of the chunk before), batched with other
    rows, gives the one-pass logits."""
    ours, _ = models
    vocab = ours.config.vocab_size
    token_ids = prompt(30, seed=5, vocab_size=vocab)
    (whole,) = paged(ours).step(ours, [(0, token_ids, 0)])
    cache = paged(ours)
    other = prompt(13, seed=6, vocab_size=vocab)
    first, _ = cache.step(ours, [(0, token_ids[:11], 0), (1, other, 0)])
    second, _ = cache.step(ours, [(0, token_ids[11:14], 11), (2, other[:5], 0)])
    third, _, _ = cache.step(ours, [(0, token_ids[14:], 14), (1, [7], 13), (2, other[5:], 5)])
    assert_close(torch.cat([first, second, third]), whole, "chunked prefill")


def test_engine_greedy_matches_transformers_with_chunked_prefill(tiny_dir, models):
    """The whole engine (scheduler, block pool, chunked prefill of 16-token steps, batched decode) against
    transformers' generate, on prompts from twice to six times the window."""
    _, hf = models
    llm = LLM(str(tiny_dir), block_size=BLOCK_SIZE, max_num_batched_tokens=16, progress=False)
    prompts = [prompt(n, seed=100 + n, vocab_size=384) for n in (17, 29, 48)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for token_ids, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, token_ids)


def test_prefix_cache_hit_longer_than_the_window_gives_the_cold_tokens(tiny_dir):
    """A second request sharing 32 tokens (four windows) with the first reuses their blocks in every layer (each
    layer keeps all its blocks today) and generates what a cold engine does."""
    shared = prompt(33, seed=7, vocab_size=384)
    first, second = shared + prompt(6, seed=8, vocab_size=384), shared + prompt(9, seed=9, vocab_size=384)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    warm = LLM(str(tiny_dir), block_size=BLOCK_SIZE, progress=False)
    warm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
    hit = warm.generate([{"prompt_token_ids": second}], params, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 32
    cold = LLM(str(tiny_dir), block_size=BLOCK_SIZE, progress=False, enable_prefix_caching=False)
    assert hit.outputs[0].token_ids == cold.generate([{"prompt_token_ids": second}], params,
                                                     use_tqdm=False)[0].outputs[0].token_ids


def test_final_logit_softcapping_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path, "gemma3", sliding_window=WINDOW, final_logit_softcapping=3.0, seed=1)
    ours = load_model(path, torch.float32, torch.device("cpu"), get_ops("cpu"), progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    token_ids = prompt(19, seed=11, vocab_size=384)
    (logits,) = paged(ours).step(ours, [(0, token_ids, 0)])
    with torch.no_grad():
        ref = hf(torch.tensor([token_ids])).logits[0].float()
    assert ref.abs().max() <= 3.0
    assert_close(logits, ref, "soft-capped logits")


@torch.no_grad()
@pytest.mark.parametrize("graphs", ["piecewise", "full"])
def test_graph_runners_without_capture_equal_the_eager_forward(models, graphs):
    """The CUDA graph runners' forward (run without capture on the CPU, over their padded static buffers): pieces
    split at each layer's attention, or the whole forward with graph-mode metadata, give the eager hidden states and
    KV writes on mixed steps whose prompts are longer than the window."""
    from deepinfer.engine.full_graphs import FullGraphRunner
    from deepinfer.engine.piecewise_graphs import PiecewiseGraphRunner, supports_piecewise
    from tests.unit.test_piecewise_graphs import assert_kv_writes, mixed_steps

    ours, _ = models
    assert supports_piecewise(ours)
    cache = paged(ours)
    steps = list(mixed_steps(ours, cache))
    caches = [c.clone() for c in cache.kv_caches]
    cpu = torch.device("cpu")
    if graphs == "piecewise":
        runner = PiecewiseGraphRunner(ours, caches, 64, cpu, use_graphs=False)
        runner.capture()
    else:
        runner = FullGraphRunner(ours, caches, 64, 6, 128, BLOCK_SIZE, cpu, use_graphs=False)
    for ids, positions, meta in steps:
        before = [c.clone() for c in caches]
        eager = ours(ids, positions, cache.kv_caches, meta)
        if graphs == "piecewise":
            hidden = runner.run(ids, positions, meta)
        else:
            rows = [end - 1 for end in meta.query_start_loc_cpu[1:]]
            hidden, eager = runner.run(ids, positions, meta, rows).hidden, eager[rows]
        torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)
        assert_kv_writes(caches, cache.kv_caches, before, meta.slot_mapping)


#: llama.cpp's gemma3 tensor names for our HF ones, under blk.N. (its converter also adds 1 to every norm).
LLAMA_CPP_GEMMA3_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm",
}


def write_gemma3_gguf(path, checkpoint) -> None:
    """The tiny checkpoint as llama.cpp's convert_hf_to_gguf writes a Gemma 3 (F32 tensors, norms + 1, no q/k
    permutation), with a small sentencepiece vocabulary (tests/unit/test_model_store.py's)."""
    import gguf
    from safetensors.numpy import load_file
    from test_model_store import _add_tokenizer

    config = json.loads((checkpoint / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["full_attention"]["rope_theta"])
    writer.add_sliding_window(config["sliding_window"])
    assert _add_tokenizer(writer, "llama") == config["vocab_size"]
    for name, tensor in sorted(load_file(str(checkpoint / "model.safetensors")).items()):
        stem = name.removesuffix(".weight")
        if stem == "model.embed_tokens":
            gguf_name = "token_embd"
        elif stem == "model.norm":
            gguf_name = "output_norm"
        else:
            _, _, layer, part = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{LLAMA_CPP_GEMMA3_NAMES[part]}"
        writer.add_tensor(f"{gguf_name}.weight", tensor + 1 if stem.endswith("norm") else tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_conversion_matches_transformers_gguf_loader(tmp_path):
    """A llama.cpp-layout Gemma 3 GGUF, converted by us, against transformers loading the same file: the weights
    (norms zero-centred again, q/k as stored) and the logits of a prompt four windows long. head_dim 256: the
    query_pre_attn_scalar transformers assumes for a GGUF, and the one llama.cpp's head_dim rule gives."""
    from transformers import AutoModelForCausalLM

    from deepinfer.loader.gguf import convert_gguf_to_hf

    checkpoint = make_tiny_checkpoint(tmp_path / "hf", "gemma3", sliding_window=WINDOW, vocab_size=266,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                      query_pre_attn_scalar=256)
    gguf_path = tmp_path / "tiny-gemma3.gguf"
    write_gemma3_gguf(gguf_path, checkpoint)
    converted = convert_gguf_to_hf(gguf_path, tmp_path / "converted", progress=False)
    config = json.loads((converted / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (config["sliding_window"], config["query_pre_attn_scalar"]) == (WINDOW, 256)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_path.name, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    ref_weights = ref.state_dict()
    from deepinfer.loader.hf import iter_safetensors

    for name, tensor in iter_safetensors(converted):
        assert torch.equal(tensor, ref_weights[name]), name
    ours = load_model(converted, torch.float32, torch.device("cpu"), get_ops("cpu"), progress=False)
    token_ids = prompt(4 * WINDOW, seed=12, vocab_size=266)
    (logits,) = paged(ours).step(ours, [(0, token_ids, 0)])
    with torch.no_grad():
        want = ref(torch.tensor([token_ids])).logits[0].float()
    assert_close(logits, want, "logits of the converted GGUF")
