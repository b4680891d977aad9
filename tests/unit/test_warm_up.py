"""The runner's warm-up writes no KV and changes no output; the compile watch tells start from serving."""

from __future__ import annotations

import logging

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.runner import warm_up_query_lens
from deepinfer.kernels.compile_watch import CompileWatch
from deepinfer.testing.checkpoints import make_tiny_checkpoint

PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300, 6]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    torch.set_num_threads(1)
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    return LLM(str(model_dir), block_size=4, max_model_len=160, progress=False)


def greedy(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids


def test_query_lens_cover_every_prefill_tile_within_the_context():
    assert warm_up_query_lens(2048, 8192) == [16, 32, 64, 128, 2048]
    assert warm_up_query_lens(2048, 100) == [16, 32, 64, 100]
    assert warm_up_query_lens(48, 8192) == [16, 32, 48, 64, 128]


def test_warm_up_writes_no_kv_and_leaves_no_row(llm):
    before = greedy(llm)
    runner = llm.engine.core.runner
    caches, rows = [c.clone() for c in runner.kv_caches], dict(runner.block_table.rows)
    runner.warm_up(warm_up_query_lens(llm.engine.args.max_num_batched_tokens, llm.engine.max_model_len))
    assert all(torch.equal(a, b) for a, b in zip(caches, runner.kv_caches, strict=True))
    assert runner.block_table.rows == rows
    assert greedy(llm) == before


def test_compiles_after_start_are_logged(caplog):
    watch = CompileWatch()
    watch.on_start()
    watch.on_compiled(repr="_early[num_warps=4](x: *fp32)")  # before any engine started
    with watch.starting():
        watch.on_start()
        watch.on_compiled(repr="_capture[num_warps=4](x: *fp32)")
    assert (watch.start_compiles, watch.serving_compiles) == (2, 0)
    with caplog.at_level(logging.WARNING, logger="deepinfer.kernels.compile_watch"):
        watch.on_start()
        watch.on_compiled(repr="_prefill_kernel[num_warps=8](BLOCK_M: 128)")
    assert watch.serving_compiles == 1 and watch.serving_seconds >= 0
    assert "_prefill_kernel" in caplog.text and "while serving" in caplog.text
    with watch.starting():  # a second engine starting in the same process: its compiles are its start's
        watch.on_start()
        watch.on_compiled(repr="_other[num_warps=4]()")
    assert (watch.start_compiles, watch.serving_compiles) == (3, 1)
