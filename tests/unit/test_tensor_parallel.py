"""Tensor parallelism on the CPU: weight sharding (pure) and TP=2 over gloo (two real processes) against TP=1.

Oracle: the single-rank model of the same tiny checkpoint (itself checked against transformers in
test_model_parity). TP=2 changes only the order of float32 sums, so logits agree to ~1e-6 relative.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.distributed.layers import ColumnParallelLinear, VocabParallelEmbedding
from deepinfer.distributed.parallel_state import TensorParallelGroup, free_tcp_init_method
from deepinfer.distributed.sharding import ColumnShard, head_shard, vocab_range
from deepinfer.distributed.weights import load_full_parameters
from deepinfer.executor.tensor_parallel import WorkerSpec, spawn_tensor_parallel
from deepinfer.kernels import build_attention_metadata, get_ops
from deepinfer.loader.hf import iter_safetensors, load_model, load_model_config
from deepinfer.loader.shard import build_empty_shard
from deepinfer.models.parallel import shard_config
from deepinfer.testing.checkpoints import make_tiny_checkpoint

OPS = get_ops("cpu")
PROMPTS = [
    {"prompt_token_ids": [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300, 6]},
    {"prompt_token_ids": [9, 8, 7]},
    {"prompt_token_ids": list(range(40, 75))},
]


# tiny_dir (conftest): 4 query heads over 2 KV heads, so TP=2 splits the KV heads and TP=4 replicates them.
@pytest.fixture(scope="module")
def whole(tiny_dir):
    return load_model(tiny_dir, torch.float32, "cpu", OPS, progress=False)


def shards(tiny_dir, tp_size):
    """Every rank's shard loaded from the checkpoint files (loading needs no collectives)."""
    result = []
    for rank in range(tp_size):
        model = build_empty_shard(tiny_dir, torch.float32, torch.device("cpu"), OPS, TensorParallelGroup(rank, tp_size))
        model.load_weights(iter_safetensors(tiny_dir))
        result.append(model)
    return result


def params(model):
    return dict(model.named_parameters())


# -- sharding arithmetic ----------------------------------------------------------------------------------------
def test_head_shard_splits_then_replicates_kv_heads():
    assert [head_shard(8, 2, 2, r) for r in range(2)] == [
        (h := type(head_shard(8, 2, 2, 0)))(0, 4, 0, 1), h(4, 4, 1, 1)
    ]
    # tp=4 > 2 KV heads: each KV head sits on two consecutive ranks, next to the query heads that read it.
    assert [(s.q_start, s.kv_start, s.num_kv_heads) for s in (head_shard(8, 2, 4, r) for r in range(4))] == [
        (0, 0, 1), (2, 0, 1), (4, 1, 1), (6, 1, 1)
    ]
    group = 8 // 2
    for r in range(8):
        s = head_shard(8, 2, 8, r)
        assert s.num_q_heads == 1 and s.kv_start == s.q_start // group
    with pytest.raises(ValueError, match="num_attention_heads=6"):
        head_shard(6, 2, 4, 0)
    with pytest.raises(ValueError, match="multiple"):
        head_shard(12, 4, 6, 0)


def test_vocab_range_pads_the_last_rank():
    assert [vocab_range(385, 2, r) for r in range(2)] == [(0, 193, 193), (193, 192, 193)]
    emb = VocabParallelEmbedding(385, 3, TensorParallelGroup(1, 2))
    full = torch.randn(385, 3)
    emb.weight.data.fill_(7.0)
    emb.load_full("weight", full)
    assert torch.equal(emb.weight[:192], full[193:]) and torch.equal(emb.weight[192], torch.zeros(3))


def test_shard_config_sizes_the_kv_cache(tiny_dir):
    config = load_model_config(tiny_dir)
    rank = shard_config(config, 2, 1)
    assert (rank.num_attention_heads, rank.num_kv_heads, rank.intermediate_size) == (2, 1, 64)
    assert rank.vocab_size == config.vocab_size and rank.hidden_size == config.hidden_size
    assert rank.kv_cache_shape(10, 4) == (2, 10, 4, 1, config.head_dim)
    assert shard_config(config, 4, 3).num_kv_heads == 1


# -- weight sharding --------------------------------------------------------------------------------------------
def test_shards_concatenate_back_to_the_checkpoint(tiny_dir, whole):
    config = load_model_config(tiny_dir)
    ranks = [params(m) for m in shards(tiny_dir, 2)]
    d = config.head_dim
    q_rows, kv_rows = config.num_attention_heads * d, config.num_kv_heads * d
    for name, full in params(whole).items():
        local = [p[name] for p in ranks]
        if name.endswith("qkv_proj.weight"):
            q, k, v = full.split([q_rows, kv_rows, kv_rows])
            per_rank = [t.split([q_rows // 2, kv_rows // 2, kv_rows // 2]) for t in local]
            for i, part in enumerate((q, k, v)):
                assert torch.equal(torch.cat([pr[i] for pr in per_rank]), part), name
        elif name.endswith("gate_up_proj.weight"):
            gate, up = full.chunk(2)
            assert torch.equal(torch.cat([t.chunk(2)[0] for t in local]), gate), name
            assert torch.equal(torch.cat([t.chunk(2)[1] for t in local]), up), name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(local, dim=1), full), name
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            assert torch.equal(torch.cat(local)[: config.vocab_size], full), name
        else:  # norms are replicated
            assert all(torch.equal(t, full) for t in local), name


def test_gqa_replication_puts_each_kv_head_next_to_its_queries(tiny_dir, whole):
    config = load_model_config(tiny_dir)
    d = config.head_dim
    q_rows, kv_rows = config.num_attention_heads * d, config.num_kv_heads * d
    q, k, v = params(whole)["model.layers.0.self_attn.qkv_proj.weight"].split([q_rows, kv_rows, kv_rows])
    group = config.num_attention_heads // config.num_kv_heads
    for rank, shard in enumerate(shards(tiny_dir, 4)):  # 4 ranks, 2 KV heads: one query head, one KV head each
        lq, lk, lv = params(shard)["model.layers.0.self_attn.qkv_proj.weight"].split([d, d, d])
        kv_head = rank // group
        assert torch.equal(lq, q[rank * d : (rank + 1) * d])
        assert torch.equal(lk, k[kv_head * d : (kv_head + 1) * d])
        assert torch.equal(lv, v[kv_head * d : (kv_head + 1) * d])


def test_full_parameters_and_checkpoint_give_the_same_shard(tiny_dir, whole):
    for rank, from_files in enumerate(shards(tiny_dir, 2)):
        from_whole = build_empty_shard(tiny_dir, torch.float32, torch.device("cpu"), OPS, TensorParallelGroup(rank, 2))
        load_full_parameters(from_whole, whole.named_parameters())
        for name, tensor in params(from_files).items():
            assert torch.equal(tensor, params(from_whole)[name]), name


def test_load_errors_name_the_tensor():
    linear = ColumnParallelLinear(4, [ColumnShard("q_proj", 8, 0, 4), ColumnShard("k_proj", 4, 0, 2)], False,
                                  TensorParallelGroup(0, 2))
    with pytest.raises(ValueError, match=r"k_proj.weight.*\(3, 4\).*\(4, 4\)"):
        linear.load_part("weight", "k_proj", torch.zeros(3, 4))
    with pytest.raises(ValueError, match="'v_proj' is not a part"):
        linear.load_part("weight", "v_proj", torch.zeros(4, 4))


# -- TP=2 over gloo, two processes ------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch_dir(request, tiny_dir, tmp_path_factory):
    """Llama; Qwen2 (q/k/v bias, tied embeddings: the vocab-parallel embedding is the head); Qwen3 (q/k norm)."""
    if request.param == "llama":
        return tiny_dir
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp") / request.param, request.param)


def test_tp2_logits_match_tp1_over_prefill_and_decode(arch_dir):
    tiny_dir = arch_dir
    whole = load_model(tiny_dir, torch.float32, "cpu", OPS, progress=False)
    config = load_model_config(tiny_dir)
    spec = WorkerSpec(model_dir=str(tiny_dir), dtype=torch.float32, device_type="cpu", accelerator="cpu",
                      tp_size=2, backend="gloo", init_method=free_tcp_init_method(), timeout_s=120.0)
    driver = spawn_tensor_parallel(spec, OPS)
    try:
        block_size, num_blocks = 4, 32
        caches = {
            "tp1": [torch.zeros(config.kv_cache_shape(num_blocks, block_size)) for _ in range(config.num_hidden_layers)],
            "tp2": [torch.zeros(shard_config(config, 2).kv_cache_shape(num_blocks, block_size))
                    for _ in range(config.num_hidden_layers)],
        }
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(4, config.vocab_size, (n,), generator=gen).tolist() for n in (11, 3, 6)]
        tables = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
        # prefill all three, then two decode steps feeding the greedy token of TP=1
        steps = [[(p, 0) for p in prompts]]
        for step in range(2):
            steps.append([([0], len(p) + step) for p in prompts])
        last = None
        for chunks in steps:
            if last is not None:
                chunks = [([t], start) for t, (_, start) in zip(last, chunks, strict=True)]
            ids = torch.tensor([t for toks, _ in chunks for t in toks])
            positions = torch.tensor([start + i for toks, start in chunks for i in range(len(toks))])
            slots = [tables[s][pos // block_size] * block_size + pos % block_size
                     for s, (toks, start) in enumerate(chunks) for pos in range(start, start + len(toks))]
            meta = build_attention_metadata([len(t) for t, _ in chunks], [s + len(t) for t, s in chunks], tables, slots)
            rows = torch.tensor(meta.query_start_loc_cpu[1:]) - 1
            with torch.inference_mode():
                ref = whole.compute_logits(whole(ids, positions, caches["tp1"], meta)[rows])
                ours = driver.compute_logits(driver(ids, positions, caches["tp2"], meta)[rows])
            assert ours.shape == ref.shape == (3, config.vocab_size)
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
            assert torch.equal(ours.argmax(-1), ref.argmax(-1))
            last = ref.argmax(-1).tolist()
    finally:
        driver.close()
    assert all(p.exitcode == 0 for p in driver.processes)


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_llm_tp2_greedy_tokens_equal_tp1(tiny_dir, load_format):
    """"dummy": each rank slices the single-rank random weights of the same seed, so TP=2 is the same model."""
    params_ = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kwargs = {"block_size": 4, "progress": False, "load_format": load_format, "dummy_seed": 5}
    expected = [o.outputs[0].token_ids for o in LLM(str(tiny_dir), **kwargs).generate(
        PROMPTS, params_, use_tqdm=False)]
    with LLM(str(tiny_dir), tensor_parallel_size=2, **kwargs) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params_, use_tqdm=False)]
        # a second call reuses the workers' KV shards (and rank 0's prefix cache)
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], params_, use_tqdm=False)]
    assert got == expected
    assert again == expected[:1]
    assert all(len(t) == 10 for t in got)


def test_a_rank_that_dies_before_joining_fails_llm_within_seconds(tiny_dir, tmp_path):
    # A spawned rank re-imports the main module by path; a script that is gone by then kills the rank before it
    # joins the group. Rank 0 used to wait out the group's 600 s timeout; it must raise with the rank's exit.
    script = tmp_path / "gone_main.py"
    script.write_text(
        "import os\n"
        "os.remove(__file__)\n"
        "from deepinfer import LLM\n"
        f"LLM({str(tiny_dir)!r}, tensor_parallel_size=2, device='cpu', kv_cache_bytes=8 << 20, progress=False)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1
    assert time.monotonic() - started < 60
    assert "tensor-parallel worker rank 1 exited with code 1 before joining the group" in result.stderr
