"""Prefill on one engine, decode on another with the KV moved as bytes: same tokens as one engine alone."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine import Engine, EngineArgs, EngineRequest, LeaseNotHeld, PulledKv
from deepinfer.sampling.params import SamplingParams
from deepinfer.testing.checkpoints import make_tiny_checkpoint

PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300]  # 19 tokens: 5 blocks of 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3")


def engine(tiny_dir) -> Engine:
    # A byte budget, not a memory fraction: several engines share the device (a GPU on a GPU host).
    return Engine(EngineArgs(model=str(tiny_dir), block_size=4, progress=False, kv_cache_bytes=16 << 20))


def run(core: Engine) -> dict[str, list[int]]:
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
    reference.add_request(EngineRequest("r", PROMPT, params))
    expected = run(reference)["r"]

    prefill = engine(tiny_dir)
    prefill.add_request(EngineRequest("r", PROMPT, params.clone(max_tokens=1), hold_blocks=True))
    first = run(prefill)["r"]
    assert first == expected[:1]
    block_ids = prefill.held_block_ids("r")
    assert len(block_ids) == 5
    payloads = prefill.export_held("r", block_ids)

    decode = engine(tiny_dir)
    admission = decode.add_request(EngineRequest("r", PROMPT, params, output_token_ids=first, kv=PulledKv(payloads)))
    assert admission.kv == "pulled"
    assert first + run(decode)["r"] == expected

    assert prefill.release_held("r")
    assert prefill.stats().num_free_blocks == prefill.stats().num_total_blocks
    assert decode.stats().num_free_blocks == decode.stats().num_total_blocks


def test_export_refuses_blocks_not_held(tiny_dir):
    prefill = engine(tiny_dir)
    prefill.add_request(EngineRequest("r", PROMPT, SamplingParams(temperature=0, max_tokens=1), hold_blocks=True))
    run(prefill)
    held = prefill.held_block_ids("r")
    with pytest.raises(LeaseNotHeld):
        prefill.export_held("r", [max(held) + 1])
    prefill.release_held("r")
    with pytest.raises(LeaseNotHeld):
        prefill.export_held("r", held)


def test_admit_checks_payload_count(tiny_dir):
    decode = engine(tiny_dir)
    with pytest.raises(ValueError, match="kv payloads"):
        decode.add_request(EngineRequest("r", PROMPT, SamplingParams(max_tokens=4), output_token_ids=[1],
                                         kv=PulledKv([b"x"] * 2)))
