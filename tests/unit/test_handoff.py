"""Prefill on one engine, decode on another with the KV moved as bytes: same tokens as one engine alone."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.args import EngineArgs
from deepinfer.engine.core import EngineCore
from deepinfer.engine.handoff import (
    LeaseNotHeld,
    admit_prefilled,
    engine_stats,
    export_held,
    held_block_ids,
    release_held,
)
from deepinfer.sampling.params import SamplingParams
from deepinfer.testing.checkpoints import make_tiny_checkpoint

PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300]  # 19 tokens: 5 blocks of 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3")


def engine(tiny_dir) -> EngineCore:
    # A byte budget, not a memory fraction: several engines share the device (a GPU on a GPU host).
    return EngineCore(EngineArgs(model=str(tiny_dir), block_size=4, progress=False, kv_cache_bytes=16 << 20))


def run(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=12, ignore_eos=True),
])
def test_disaggregated_tokens_equal_aggregated(tiny_dir, params):
    reference = engine(tiny_dir)
    reference.add_request("r", PROMPT, params)
    expected = run(reference)["r"]

    prefill = engine(tiny_dir)
    prefill.add_request("r", PROMPT, params.clone(max_tokens=1), hold_blocks=True)
    first = run(prefill)["r"]
    assert first == expected[:1]
    block_ids = held_block_ids(prefill, "r")
    assert len(block_ids) == 5
    payloads = export_held(prefill, "r", block_ids)

    decode = engine(tiny_dir)
    assert admit_prefilled(decode, "r", PROMPT, first, params, payloads)
    assert first + run(decode)["r"] == expected

    assert release_held(prefill, "r")
    assert engine_stats(prefill).num_free_blocks == engine_stats(prefill).num_total_blocks
    assert engine_stats(decode).num_free_blocks == engine_stats(decode).num_total_blocks


def test_export_refuses_blocks_not_held(tiny_dir):
    prefill = engine(tiny_dir)
    prefill.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=1), hold_blocks=True)
    run(prefill)
    held = held_block_ids(prefill, "r")
    with pytest.raises(LeaseNotHeld):
        export_held(prefill, "r", [max(held) + 1])
    release_held(prefill, "r")
    with pytest.raises(LeaseNotHeld):
        export_held(prefill, "r", held)


def test_admit_checks_payload_count(tiny_dir):
    decode = engine(tiny_dir)
    with pytest.raises(ValueError, match="kv payloads"):
        admit_prefilled(decode, "r", PROMPT, [1], SamplingParams(max_tokens=4), [b"x"] * 2)
