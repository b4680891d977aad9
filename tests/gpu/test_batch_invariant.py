"""Batch-invariant mode on the GPU: a request's tokens and logprobs are bit-identical alone and inside batches of
1, 7 and 64 other requests (CUDA graphs on, bf16, Triton kernels, random weights; prompts long enough for the
decode split-K and for mixed prefill+decode steps). Also the CUDA-graph context buckets against eager decode.

Runs on a bare GPU image: `PYTHONPATH=shared python -m pytest tests/gpu -q --noconftest`.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048, "hidden_size": 512,
          "intermediate_size": 1024, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 128, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5}
MAX_MODEL_LEN, BLOCK_SIZE, MAX_NUM_SEQS, NUM_BLOCKS = 1536, 16, 72, 4096


def make_runner(tmp_path, batch_invariant: bool, use_cuda_graphs: bool = True):
    """A CUDA runner over dummy bf16 weights and its scheduler config."""
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.execution import ExecutionMode, RunnerConfig
    from deepinfer.engine.runner import ModelRunner
    from deepinfer.kernels import get_ops
    from deepinfer.loader.dummy import load_dummy_model

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    model = load_dummy_model(tmp_path, torch.bfloat16, "cuda", get_ops("cuda"), seed=5, std=0.05)
    kv_caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 128, dtype=torch.bfloat16, device="cuda")
                 for _ in range(CONFIG["num_hidden_layers"])]
    mode = ExecutionMode.DECODE if use_cuda_graphs else ExecutionMode.EAGER
    runner = ModelRunner(model, kv_caches, RunnerConfig(
        block_size=BLOCK_SIZE, vocab_size=CONFIG["vocab_size"], device=torch.device("cuda"),
        max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, execution_mode=mode, batch_invariant=batch_invariant))
    config = EngineConfig(num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                          max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=2048, enable_kv_events=False)
    return runner, config


def generate(runner, config, prompts, max_tokens: int, temperature: float = 0.0, seeds=None):
    """Every prompt in one batch through Scheduler + runner: [(token id, logprob), ...] per prompt.

    `seeds[i]` is prompt i's seed (default 100 + i): a request keeps its seed wherever it sits in the batch.
    """
    from deepinfer.engine.request import Request
    from deepinfer.engine.scheduler import Scheduler
    from deepinfer.sampling.params import SamplingParams

    scheduler = Scheduler(config)
    for i, prompt in enumerate(prompts):
        seed = 100 + i if seeds is None else seeds[i]
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed,
                                logprobs=0)
        scheduler.add_request(Request(f"r{i}", prompt, params, arrival_time=float(i)))
    tokens: dict[str, list[tuple[int, float]]] = {}
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        sampled = runner.execute(output, scheduler.requests)
        for rid, s in sampled.items():
            tokens.setdefault(rid, []).append((s.token_id, s.logprob))
        scheduler.update(output, {rid: [s.token_id] for rid, s in sampled.items()})
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def random_prompts(num: int, seed: int) -> list[list[int]]:
    """Prompts of 20..900 tokens (past one 512-key decode partition)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 900, (num,), generator=g).tolist()
    return [torch.randint(0, CONFIG["vocab_size"], (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tokens_and_logprobs_are_bit_identical_alone_and_in_batches(tmp_path, temperature):
    runner, config = make_runner(tmp_path, batch_invariant=True)
    target = random_prompts(1, seed=1)[0][:700]
    others = random_prompts(64, seed=2)
    alone = generate(runner, config, [target], 24, temperature)[0]
    assert len(alone) == 24
    for num_others in (1, 7, 64):
        batched = generate(runner, config, [target, *others[:num_others]], 24, temperature)[0]
        assert batched == alone, f"differs inside a batch of {num_others} others"
    # arriving last (admitted in a later step, beside running decodes) changes nothing either
    last = generate(runner, config, [*others[:7], target], 24, temperature, seeds=[*range(101, 108), 100])[-1]
    assert last == alone


def test_default_mode_graph_buckets_match_eager_decode(tmp_path):
    """Graphs captured per context bucket give the eager tokens (greedy), at several context lengths."""
    runner, config = make_runner(tmp_path, batch_invariant=False)
    assert len(runner.graphs.seq_len_buckets) > 1
    prompts = [p[:n] for p, n in zip(random_prompts(5, seed=3), (30, 400, 520, 800, 1100), strict=False)]
    prompts[-1] = random_prompts(1, seed=4)[0] + random_prompts(1, seed=5)[0]  # a long one
    prompts[-1] = prompts[-1][: MAX_MODEL_LEN - 40]
    with_graphs = generate(runner, config, prompts, 16)
    replays = runner.graphs.num_replays
    graphs, runner.graphs = runner.graphs, None
    eager = generate(runner, config, prompts, 16)
    runner.graphs = graphs
    assert replays > 0
    for got, want in zip(with_graphs, eager, strict=True):  # bf16 rounding differs (other split): first tokens
        assert [t for t, _ in got[:4]] == [t for t, _ in want[:4]]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got[:4], want[:4], strict=True)) < 0.05


def test_triton_matmul_matches_torch_and_rows_are_invariant():
    from deepinfer.kernels.triton_matmul import linear

    torch.manual_seed(0)
    w = torch.randn(4096 + 64, 1024 + 40, device="cuda", dtype=torch.bfloat16) * 0.05
    bias = torch.randn(w.shape[0], device="cuda", dtype=torch.bfloat16)
    x = torch.randn(300, w.shape[1], device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    out = linear(x, w, bias)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    alone = linear(x[137:138], w, bias)
    for rows in (1, 7, 64, 129, 300):
        batch = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
        batch[rows // 2] = x[137]
        assert torch.equal(linear(batch, w, bias)[rows // 2], alone[0]), rows
