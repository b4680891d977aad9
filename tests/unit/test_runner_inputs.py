"""Input preparation of the model runner on the CPU: flat batch, slot mapping, padding, staging, graph ladder."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.engine.cuda_graphs import capture_sizes, padded_batch_size
from deepinfer.engine.runner import InputStager, block_slots, build_host_batch, pad_decode_batch
from deepinfer.engine.scheduler import ScheduledRequest
from deepinfer.kernels import build_attention_metadata

BLOCK_SIZE = 4


def scheduled(rid, token_ids, num_computed, block_ids, sample=True):
    """A ScheduledRequest feeding token_ids after num_computed cached tokens."""
    return ScheduledRequest(rid, list(token_ids), num_computed, len(token_ids), list(block_ids), sample, False)


def reference_slots(block_ids, start, end):
    """Per-token slot arithmetic, the obvious way."""
    return [block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]


@pytest.mark.parametrize(("start", "end"), [(0, 1), (0, 4), (3, 9), (5, 6), (4, 12), (2, 15)])
def test_block_slots_match_per_token_arithmetic(start, end):
    block_ids = [7, 2, 9, 5]
    assert block_slots(block_ids, start, end, BLOCK_SIZE) == reference_slots(block_ids, start, end)


def mixed_batch():
    """A prefill chunk that samples nothing, a decode, and a chunk over a cached prefix."""
    return [
        scheduled("a", [11, 12, 13, 14, 15, 16], 0, [3, 8], sample=False),
        scheduled("b", [21], 9, [1, 4, 6]),
        scheduled("c", [31, 32, 33], 5, [2, 5]),
    ]


def test_host_batch_flattens_the_ragged_batch():
    batch = build_host_batch(mixed_batch(), BLOCK_SIZE)
    assert batch.input_ids == [11, 12, 13, 14, 15, 16, 21, 31, 32, 33]
    assert batch.positions == [0, 1, 2, 3, 4, 5, 9, 5, 6, 7]
    assert batch.slot_mapping == reference_slots([3, 8], 0, 6) + reference_slots([1, 4, 6], 9, 10) + \
        reference_slots([2, 5], 5, 8)
    assert batch.query_lens == [6, 1, 3] and batch.seq_lens == [6, 10, 8]
    assert batch.logits_indices == [6, 9] and [s.request_id for s in batch.sampled] == ["b", "c"]
    assert not batch.is_decode_only


def test_staged_inputs_equal_build_attention_metadata():
    batch = build_host_batch(mixed_batch(), BLOCK_SIZE)
    stager = InputStager(torch.device("cpu"))
    stager.stage(build_host_batch([scheduled("x", [1] * 13, 0, [9, 9, 9, 9])], BLOCK_SIZE))  # stale data
    inputs = stager.stage(batch)
    ref = build_attention_metadata(batch.query_lens, batch.seq_lens, batch.block_ids, batch.slot_mapping)
    assert inputs.input_ids.tolist() == batch.input_ids
    assert inputs.positions.tolist() == batch.positions
    assert inputs.logits_indices.tolist() == [6, 9]
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(inputs.meta, name), getattr(ref, name)), name
        assert getattr(inputs.meta, name).dtype == getattr(ref, name).dtype, name
    assert inputs.meta.query_start_loc_cpu == ref.query_start_loc_cpu
    assert (inputs.meta.max_query_len, inputs.meta.max_seq_len) == (6, 10)


def test_padding_rows_write_nothing_and_read_the_null_block():
    batch = build_host_batch([scheduled("a", [5], 6, [3, 4]), scheduled("b", [7], 0, [2])], BLOCK_SIZE)
    assert batch.is_decode_only
    padded = pad_decode_batch(batch, 4)
    assert padded.input_ids == [5, 7, 0, 0] and padded.positions == [6, 0, 0, 0]
    assert padded.slot_mapping == [4 * BLOCK_SIZE + 2, 2 * BLOCK_SIZE, -1, -1]
    assert padded.seq_lens == [7, 1, 1, 1] and padded.block_ids[2:] == [[0], [0]]
    assert padded.logits_indices == [0, 1] and len(padded.sampled) == 2
    with pytest.raises(AssertionError):
        pad_decode_batch(build_host_batch(mixed_batch(), BLOCK_SIZE), 8)


def test_capture_ladder_and_padding_size():
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(256)[-1] == 256
    assert all(b - a == 8 for a, b in zip(capture_sizes(256)[3:], capture_sizes(256)[4:], strict=False))
    assert capture_sizes(3) == [1, 2, 3] and capture_sizes(1) == [1] and capture_sizes(20)[-1] == 20
    sizes = capture_sizes(64)
    assert [padded_batch_size(sizes, n) for n in (1, 3, 5, 9, 17, 64)] == [1, 4, 8, 16, 24, 64]
    assert padded_batch_size(sizes, 65) is None


def test_dummy_weights_engine_without_tokenizer_generates_token_ids(tmp_path):
    """load_format="dummy" on a config.json alone: no weights, no tokenizer; LLM takes prompt_token_ids."""
    from deepinfer import LLM, SamplingParams

    torch.set_num_threads(1)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "eos_token_id": 5}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", block_size=4, kv_cache_bytes=1 << 20,
              progress=False)
    assert llm.tokenizer is None and llm.engine.eos_token_ids == {5}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]}, {"prompt_token_ids": [9, 8]}]
    first = llm.generate(prompts, params, use_tqdm=False)
    again = LLM(str(tmp_path), load_format="dummy", device="cpu", block_size=4, kv_cache_bytes=1 << 20,
                progress=False).generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in first] == [6, 6]
    assert [o.outputs[0].text for o in first] == ["", ""]
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]  # seeded weights
    weights = torch.cat([p.flatten() for p in llm.engine.runner.model.parameters()])
    assert weights.std() > 0.01 and torch.isfinite(weights).all()
