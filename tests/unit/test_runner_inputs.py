"""Input preparation of the model runner on the CPU: persistent block table, flat batch, slot mapping, padding,
staging, graph inputs and ladders."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from deepinfer.engine.cuda_graphs import GraphInputs, capture_sizes, padded_batch_size, seq_len_buckets
from deepinfer.engine.inputs import BlockTable, InputStager, block_slots, build_host_batch, pad_decode_batch
from deepinfer.engine.scheduler import ScheduledRequest, SchedulerOutput
from deepinfer.kernels import build_attention_metadata

BLOCK_SIZE = 4


def scheduled(rid, token_ids, num_computed, block_ids, sample=True, is_new=True):
    """A ScheduledRequest feeding token_ids after num_computed cached tokens (block_ids: the whole table when
    is_new, else the ids appended since the request's last step)."""
    return ScheduledRequest(rid, list(token_ids), num_computed, len(token_ids), list(block_ids), sample, is_new)


def host_batch(requests, table=None):
    """build_host_batch over a fresh (or the given) block table."""
    return build_host_batch(requests, table if table is not None else BlockTable(8, 2), BLOCK_SIZE)


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
    batch = host_batch(mixed_batch())
    assert batch.input_ids == [11, 12, 13, 14, 15, 16, 21, 31, 32, 33]
    assert batch.positions == [0, 1, 2, 3, 4, 5, 9, 5, 6, 7]
    assert batch.slot_mapping == reference_slots([3, 8], 0, 6) + reference_slots([1, 4, 6], 9, 10) + \
        reference_slots([2, 5], 5, 8)
    assert batch.query_lens == [6, 1, 3] and batch.seq_lens == [6, 10, 8]
    assert batch.logits_indices == [6, 9] and [s.request_id for s in batch.sampled] == ["b", "c"]
    assert not batch.is_decode_only


def test_staged_inputs_equal_build_attention_metadata():
    table = BlockTable(4, 2)
    stager = InputStager(torch.device("cpu"))
    stale = host_batch([scheduled("x", [1] * 13, 0, [9, 9, 9, 9])], table)
    stager.stage(stale, table)  # stale data in the buffers and in a row that is freed and reused
    table.free(["x"])
    requests = mixed_batch()
    batch = host_batch(requests, table)
    inputs = stager.stage(batch, table)
    block_ids = [s.new_block_ids for s in requests]
    ref = build_attention_metadata(batch.query_lens, batch.seq_lens, block_ids, batch.slot_mapping)
    assert inputs.input_ids.tolist() == batch.input_ids
    assert inputs.positions.tolist() == batch.positions
    assert inputs.logits_indices.tolist() == [6, 9]
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(inputs.meta, name), getattr(ref, name)), name
        assert getattr(inputs.meta, name).dtype == getattr(ref, name).dtype, name
    assert inputs.meta.query_start_loc_cpu == ref.query_start_loc_cpu
    assert (inputs.meta.max_query_len, inputs.meta.max_seq_len) == (6, 10)
    assert inputs.meta.num_decodes == ref.num_decodes == batch.query_lens.count(1) > 0  # the decode kernel's rows


def test_padding_rows_write_nothing_and_read_the_null_block():
    table = BlockTable(4, 2)
    batch = host_batch([scheduled("a", [5], 6, [3, 4]), scheduled("b", [7], 0, [2])], table)
    assert batch.is_decode_only
    padded = pad_decode_batch(batch, 4)
    assert padded.input_ids == [5, 7, 0, 0] and padded.positions == [6, 0, 0, 0]
    assert padded.slot_mapping == [4 * BLOCK_SIZE + 2, 2 * BLOCK_SIZE, -1, -1]
    assert padded.seq_lens == [7, 1, 1, 1] and padded.block_table_rows[2:] == [0, 0]
    assert padded.logits_indices == [0, 1] and len(padded.sampled) == 2
    out = np.full((4, 2), -7, dtype=np.int32)
    table.gather(padded.block_table_rows, 2, out)
    assert out[:, :1].tolist() == [[3], [2], [0], [0]] and out[0].tolist() == [3, 4]
    with pytest.raises(AssertionError):
        pad_decode_batch(host_batch(mixed_batch()), 8)


def test_block_table_follows_new_block_ids_across_steps_and_reuses_rows():
    """Whole table at is_new, appended ids after; finished rows are reused; a resumed request restarts its row."""
    table = BlockTable(2, 1)  # one column: the table must grow
    step1 = host_batch([scheduled("a", [1, 2, 3, 4, 5], 0, [7, 3], sample=False),
                        scheduled("b", [9], 0, [5])], table)
    step2 = host_batch([scheduled("a", [6, 7, 8, 9], 5, [8], is_new=False),
                        scheduled("b", [10], 1, [], is_new=False)], table)
    assert step2.slot_mapping == [3 * BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 2, 3 * BLOCK_SIZE + 3, 8 * BLOCK_SIZE,
                                  5 * BLOCK_SIZE + 1]
    assert step2.max_num_blocks == 3
    assert step2.block_table_rows == step1.block_table_rows
    assert table.block_ids[table.rows["a"]] == [7, 3, 8] and table.table[table.rows["a"], :3].tolist() == [7, 3, 8]
    row_b = table.rows["b"]
    table.free(["b"])  # finished
    step3 = host_batch([scheduled("c", [4], 0, [6]), scheduled("a", [1], 9, [], is_new=False)], table)
    assert step3.block_table_rows == [row_b, table.rows["a"]] and table.block_ids[row_b] == [6]
    host_batch([scheduled("a", [1, 2], 0, [2])], table)  # resumed after a preemption: the row restarts
    assert table.block_ids[table.rows["a"]] == [2] and table.table[table.rows["a"], 0] == 2
    host_batch([scheduled("d", [1], 0, [4])], table)  # a third live request: the rows grow
    assert len({table.rows[r] for r in "acd"}) == 3 and 0 not in table.rows.values()
    table.free_stale(lambda rid: rid == "d")
    assert list(table.rows) == ["d"]


def test_graph_inputs_equal_the_padded_batch():
    table = BlockTable(8, 4)
    host_batch([scheduled("z", [1] * 16, 0, [11, 12, 13, 14], sample=False)], table)  # stale row contents
    table.free(["z"])
    batch = host_batch([scheduled("a", [5], 6, [3, 4]), scheduled("b", [7], 0, [2]), scheduled("c", [8], 2, [9])],
                       table)
    inputs = GraphInputs(max_bs=8, width=4)
    inputs.host32.fill_(-5)  # poison: every live entry must be written
    n32 = inputs.fill(batch, table, bs=4)
    padded = pad_decode_batch(batch, 4)
    assert inputs.host64[:3, :4].tolist() == [padded.input_ids, padded.positions, padded.slot_mapping]
    # Async scheduling's sampled rows ride along (no placeholder here: rows 3-4 are not read).
    assert inputs.host64[5, :3].tolist() == batch.sampled_rows == [table.rows[r] for r in "abc"]
    assert inputs.host32[:4].tolist() == padded.seq_lens and n32 == inputs.seq_off + 4 * 4
    tables = inputs.host32[inputs.seq_off : n32].view(4, 4)
    assert tables[:, 0].tolist() == [3, 2, 9, 0] and tables[0, 1].item() == 4


def test_runner_frees_rows_of_finished_and_preempted_requests():
    from deepinfer.engine.execution import RunnerConfig
    from deepinfer.engine.runner import ModelRunner

    runner = ModelRunner(torch.nn.Identity(), [], RunnerConfig(block_size=BLOCK_SIZE, vocab_size=8,
                                                               device=torch.device("cpu"), max_model_len=16,
                                                               max_num_seqs=2))
    runner.prepare_batch(SchedulerOutput([scheduled("a", [1], 0, [1]), scheduled("b", [1], 0, [2])]))
    assert runner.block_table.num_free_rows == 0
    out = SchedulerOutput([scheduled("c", [1], 0, [3])], preempted_request_ids=["a"], finished_request_ids=["b"])
    runner.prepare_batch(out)
    assert set(runner.block_table.rows) == {"c"} and runner.block_table.num_free_rows == 1


def test_seq_len_buckets_follow_the_decode_partitions():
    assert seq_len_buckets(8192) == [512, 1024, 2048, 4096, 8192]
    assert seq_len_buckets(3000) == [512, 1024, 2048, 3000] and seq_len_buckets(512) == [512]
    assert seq_len_buckets(8192, fixed=True) == [8192]


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
    assert llm.tokenizer is None and llm.engine.core.eos_token_ids == {5}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]}, {"prompt_token_ids": [9, 8]}]
    first = llm.generate(prompts, params, use_tqdm=False)
    again = LLM(str(tmp_path), load_format="dummy", device="cpu", block_size=4, kv_cache_bytes=1 << 20,
                progress=False).generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in first] == [6, 6]
    assert [o.outputs[0].text for o in first] == ["", ""]
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]  # seeded weights
    weights = torch.cat([p.flatten() for p in llm.engine.core.runner.model.parameters()])
    assert weights.std() > 0.01 and torch.isfinite(weights).all()


def tiny_engine(tmp_path, **engine_args):
    """The EngineCore of a one-layer random-weight Llama on the CPU (no tokenizer: prompts are token ids)."""
    from deepinfer import LLM

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "eos_token_id": 5}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return LLM(str(tmp_path), load_format="dummy", device="cpu", block_size=4, kv_cache_bytes=1 << 20,
               progress=False, **engine_args).engine.core


@pytest.mark.parametrize("split", [True, False])
def test_mixed_step_counts_its_decodes_unless_the_setting_is_off(tmp_path, split):
    """`mixed_step_decode_kernel` (settings -> EngineArgs -> runner): a mixed step's metadata counts its
    single-row sequences for the attention dispatch, or leaves them uncounted (one kernel)."""
    from deepinfer import SamplingParams
    from deepinfer.config import DecodeSettings
    from deepinfer.worker.settings import engine_args

    assert engine_args(DecodeSettings(mixed_step_decode_kernel=split)).mixed_step_decode_kernel is split
    torch.set_num_threads(1)
    engine = tiny_engine(tmp_path, async_scheduling=False, mixed_step_decode_kernel=split)
    seen, model = [], engine.runner.model
    forward = model.forward
    model.forward = lambda ids, positions, caches, meta: seen.append(
        (meta.max_query_len, meta.num_decodes)) or forward(ids, positions, caches, meta)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", [1, 2, 3, 4, 6], params)
    engine.step()  # a's prefill
    kinds = [engine.last_step_kind]
    engine.add_request("b", [7, 8, 9], params)
    engine.step()  # a decodes beside b's prefill
    kinds.append(engine.last_step_kind)
    engine.step()
    kinds.append(engine.last_step_kind)
    assert seen[1] == (3, 1 if split else None)
    assert kinds == ["prefill", "mixed", "decode"]  # what the worker's step-time histogram is labelled with


def test_async_steps_are_labelled_with_the_step_they_wait_for(tmp_path):
    """With async scheduling a step() call launches step N+1 and waits for step N: N's kind labels its time."""
    from deepinfer import SamplingParams

    torch.set_num_threads(1)
    engine = tiny_engine(tmp_path, async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", [1, 2, 3, 4, 6], params)
    kinds = []
    for i in range(4):
        if i == 1:
            engine.add_request("b", [7, 8, 9], params)
        engine.step()
        kinds.append(engine.last_step_kind)
    # launched: prefill(a), mixed(a + b), decode, decode; each call but the first waits for the one before
    assert kinds == ["prefill", "prefill", "mixed", "decode"]


def test_an_admission_window_reaches_the_engine_and_every_request_finishes(tmp_path):
    """`admission_window_s` (settings -> EngineArgs -> scheduler): with async scheduling, two requests arriving
    while one runs are held and prefilled in one step, and every request still completes."""
    from deepinfer import SamplingParams
    from deepinfer.config import DecodeSettings
    from deepinfer.worker.settings import engine_args

    assert engine_args(DecodeSettings(admission_window_s=0.2)).admission_window_s == 0.2
    torch.set_num_threads(1)
    # A window far longer than a's 12 steps take even on a loaded machine (its quiet quarter, 1.25 s, is what holds
    # b and c): they are held until a is done, then prefilled with nothing running, which never waits.
    engine = tiny_engine(tmp_path, async_scheduling=True, admission_window_s=5.0)
    assert engine.scheduler.admission_window.window_s == 5.0
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", [1, 2, 3, 4, 6], params)
    engine.step()  # a's prefill: nothing was running, so at once
    engine.add_request("b", [7, 8, 9], params)
    engine.add_request("c", [9, 8, 7, 6], params)
    kinds, finished = [], set()
    while engine.has_unfinished_requests():
        finished.update(o.request_id for o in engine.step() if o.finish_reason is not None)
        kinds.append(engine.last_step_kind)
    assert finished == {"a", "b", "c"}
    # a's prefill (async: the first call waits for it), then b and c, held while a ran (the window outlasts a
    # here) and prefilled together in one step; no mixed step
    assert [kind for kind in kinds if kind not in ("decode", "empty")] == ["prefill", "prefill"], kinds


def test_an_eager_step_runs_under_its_own_switch_interval(tmp_path):
    """`eager_step_switch_interval_s` (settings -> EngineArgs -> runner): the layers of a step that runs
    eagerly launch under that switch interval, and the process's own comes back after the step."""
    import sys

    from deepinfer import SamplingParams
    from deepinfer.config import DecodeSettings
    from deepinfer.worker.settings import engine_args

    assert engine_args(DecodeSettings(eager_step_switch_interval_s=5e-5)).eager_step_switch_interval_s == 5e-5
    assert engine_args(DecodeSettings()).eager_step_switch_interval_s is None
    torch.set_num_threads(1)
    engine = tiny_engine(tmp_path, async_scheduling=False, eager_step_switch_interval_s=5e-5)
    seen, model = [], engine.runner.model
    forward = model.forward
    model.forward = lambda *args: seen.append(sys.getswitchinterval()) or forward(*args)
    own = sys.getswitchinterval()
    engine.add_request("a", [1, 2, 3, 4, 6], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()
    assert seen == [pytest.approx(5e-5)] and sys.getswitchinterval() == own


def test_runner_config_takes_the_execution_mode_by_name():
    from deepinfer.engine.execution import ExecutionMode, RunnerConfig

    config = RunnerConfig(block_size=4, vocab_size=8, device=torch.device("cpu"), max_model_len=16,
                          execution_mode="piecewise")
    assert config.execution_mode is ExecutionMode.PIECEWISE and config.execution_mode.prompt_graphs
    with pytest.raises(ValueError):
        RunnerConfig(block_size=4, vocab_size=8, device=torch.device("cpu"), execution_mode="fast")
    with pytest.raises(ValueError, match="max_model_len"):
        RunnerConfig(block_size=4, vocab_size=8, device=torch.device("cpu"), execution_mode="decode")
