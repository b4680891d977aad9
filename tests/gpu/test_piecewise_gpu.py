"""Piecewise and full CUDA graphs of prompt steps on the GPU (bf16, Triton kernels): prompt and mixed steps through
the captured pieces, or the one graph with attention inside (graph mode), give the eager outputs within bf16's rounding (padding to a bucket can change the matmul algorithm), a step above
the largest bucket runs eagerly. That nothing compiles after the start with piecewise steps: test_compile_warm_gpu.py.

Runs on a bare GPU image: `PYTHONPATH=shared python -m pytest tests/gpu -q --noconftest`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
from tiny_checkpoints import checkpoints  # noqa: E402  (deepinfer.testing by path: no bus on the GPU image)

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048, "hidden_size": 512,
          "intermediate_size": 1024, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 128, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5}
BLOCK_SIZE, NUM_BLOCKS, MAX_TOKENS = 16, 1024, 512
#: Prompt lengths of the workloads: 3..450 tokens (decode rows, small and large buckets, chunked prefill).
LENGTHS = (3, 9, 17, 30, 64, 100, 130, 200, 300, 450)


#: The prompt steps' graphs: piecewise, full, full with the logits tail (graph_sampling), as engine arguments.
MODE_ARGS = {"piecewise": {"execution_mode": "piecewise", "graph_sampling": True},
             "full": {"execution_mode": "full", "graph_sampling": False},
             "full_sampling": {"execution_mode": "full", "graph_sampling": True}}
MODES = tuple(MODE_ARGS)


def llm_outputs(model_dir: Path, piecewise: bool, mode: str = "piecewise"):
    """Greedy tokens and logprobs of prompts of 3..450 tokens admitted while earlier ones decode (a 256-token
    budget: most steps mix decode rows with prompt chunks), and the engine's runner."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="bfloat16", max_num_seqs=8, max_model_len=512, max_num_batched_tokens=256,
              **(MODE_ARGS[mode] if piecewise else {"execution_mode": "decode"}), kv_cache_bytes=64 << 20,
              progress=False)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 250 + 4 for j in range(n)]} for i, n in enumerate(LENGTHS)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    result = llm.generate(prompts, params, use_tqdm=False)
    runner = llm.engine.core.runner
    tokens = []
    for o in result:
        c = o.outputs[0]
        tokens.append((c.token_ids, [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs, strict=True)]))
    return tokens, runner


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: the q/k norm inside the first half
def test_engine_greedy_outputs_piecewise_on_equal_off(tmp_path, arch, mode):
    from deepinfer.engine.full_graphs import FullGraphRunner

    model_dir = checkpoints.make_tiny_checkpoint(tmp_path / arch, arch)
    eager, off = llm_outputs(model_dir, piecewise=False)
    piecewise, on = llm_outputs(model_dir, piecewise=True, mode=mode)
    assert off.piecewise is None and off.full_graphs is None and off.graphs is not None
    prompt_graphs, full = on.full_graphs or on.piecewise, mode != "piecewise"
    assert isinstance(prompt_graphs, FullGraphRunner) == full and (on.piecewise is None) == full
    if full:  # the tail's logits land in the decode graphs' buffer
        assert (prompt_graphs.compute_logits is not None) == (mode == "full_sampling")
    assert prompt_graphs.num_runs > 0 and prompt_graphs.num_graphs > 0
    for (got, got_lp), (want, want_lp) in zip(piecewise, eager, strict=True):
        # bf16: padded rows may take another GEMM algorithm; the first tokens agree, logprobs to rounding.
        assert got[:4] == want[:4]
        assert max(abs(a - b) for a, b in zip(got_lp[:4], want_lp[:4], strict=True)) < 0.05


def make_runner(tmp_path, mode: str):
    """A CUDA runner over dummy bf16 weights with decode graphs and the prompt graphs of `mode` (buckets up to 512
    tokens)."""
    from deepinfer.engine.execution import RunnerConfig
    from deepinfer.engine.runner import ModelRunner
    from deepinfer.kernels import get_ops
    from deepinfer.loader.dummy import load_dummy_model

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    model = load_dummy_model(tmp_path, torch.bfloat16, "cuda", get_ops("cuda"), seed=5, std=0.05)
    kv_caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 128, dtype=torch.bfloat16, device="cuda")
                 for _ in range(CONFIG["num_hidden_layers"])]
    return ModelRunner(model, kv_caches, RunnerConfig(
        block_size=BLOCK_SIZE, vocab_size=CONFIG["vocab_size"], device=torch.device("cuda"), max_model_len=1024,
        max_num_seqs=16, max_num_batched_tokens=MAX_TOKENS, execution_mode=MODE_ARGS[mode]["execution_mode"],
        graph_sampling=MODE_ARGS[mode]["graph_sampling"]))


class Blocks:
    """Hands out distinct KV blocks from 1 (0 is the null block)."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, num_tokens: int) -> list[int]:
        num = -(-num_tokens // BLOCK_SIZE)
        self.next += num
        return list(range(self.next - num, self.next))


def scheduled(request_id: str, token_ids: list[int], start: int, blocks: list[int]):
    from deepinfer.engine.scheduler import ScheduledRequest

    return ScheduledRequest(request_id, token_ids, start, len(token_ids), blocks, sample=True, is_new=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, CONFIG["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("mode", MODES)
@torch.inference_mode()
def test_mixed_step_logits_piecewise_vs_eager_and_padding_writes_no_kv(tmp_path, mode):
    runner, full = make_runner(tmp_path, mode), mode != "piecewise"
    model, pieces, blocks = runner.model, runner.full_graphs or runner.piecewise, Blocks()
    assert pieces is not None and pieces.buckets[-1] == MAX_TOKENS and (runner.full_graphs is not None) == full
    contexts = {f"d{i}": prompt(n, i) for i, n in enumerate((40, 100, 7, 300))}
    tables = {rid: blocks.take(len(ids) + 1) for rid, ids in contexts.items()}
    first = runner.prepare_inputs([scheduled(rid, ids, 0, tables[rid]) for rid, ids in contexts.items()])
    model(first.input_ids, first.positions, runner.kv_caches, first.meta)  # the decode rows' context
    step = [scheduled(rid, [5], len(ids), tables[rid]) for rid, ids in contexts.items()]
    step += [scheduled(f"p{n}", prompt(n, n), 0, blocks.take(n)) for n in (60, 130)]  # 194 tokens: bucket 256
    inputs = runner.prepare_inputs(step)
    before = [c.clone() for c in runner.kv_caches]
    eager_caches = [c.clone() for c in runner.kv_caches]
    eager = model.compute_logits(model(inputs.input_ids, inputs.positions, eager_caches, inputs.meta))
    runs = pieces.num_runs
    if full:  # the graph ends at the sampled rows (each sequence's last), with the tail their logits and tokens
        rows = inputs.logits_indices.tolist()
        graph_step = pieces.run(inputs.input_ids, inputs.positions, inputs.meta, rows)
        eager = eager[rows]
        if mode == "full_sampling":
            logits = graph_step.logits
            assert torch.equal(graph_step.greedy_token_ids, logits.argmax(-1)) and len(rows) == 6
        else:
            assert graph_step.logits is None and graph_step.hidden.shape[0] == 6
            logits = model.compute_logits(graph_step.hidden)
    else:
        logits = model.compute_logits(pieces.run(inputs.input_ids, inputs.positions, inputs.meta))
        assert logits.shape == (194, CONFIG["vocab_size"])
    assert pieces.num_runs == runs + 1 and logits.shape == eager.shape
    err, scale = (logits - eager).abs().max().item(), eager.abs().max().item()
    assert err <= 0.03 * scale, (err, scale)  # bf16 rounding of other GEMM tiles, relative to the largest logit
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device="cuda")
    written[inputs.meta.slot_mapping] = True
    for ours, theirs, old in zip(runner.kv_caches, eager_caches, before, strict=True):
        ours, theirs, old = (c.view(2, NUM_BLOCKS * BLOCK_SIZE, -1) for c in (ours, theirs, old))
        assert torch.equal(ours[:, ~written], old[:, ~written]), "a padding row wrote KV"
        # a later layer's K/V carry the earlier layers' rounding (graph mode tiles attention by 64 query rows, the
        # eager kernel by 128): 2 of 99k elements 0.027 apart in one run, about one bf16 step at 4; a wrong row is
        # O(1) (K/V ~ N(0, 1) here)
        torch.testing.assert_close(ours[:, written], theirs[:, written], rtol=0.02, atol=0.06)


@pytest.mark.parametrize("mode", MODES)
@torch.inference_mode()
def test_step_above_the_largest_bucket_runs_eagerly(tmp_path, mode):
    runner = make_runner(tmp_path, mode)
    attr = "piecewise" if mode == "piecewise" else "full_graphs"
    pieces, blocks = getattr(runner, attr), Blocks()
    lengths = {"a": 300, "b": 200, "c": 100}  # 600 tokens > 512
    tables = {rid: blocks.take(n) for rid, n in lengths.items()}

    def forward(names) -> torch.Tensor:
        batch = runner.prepare_batch([scheduled(r, prompt(lengths[r], i), 0, tables[r]) for i, r in enumerate(names)])
        return runner.forward(batch).hidden.clone()

    runs = pieces.num_runs
    above = forward(["a", "b", "c"])
    assert pieces.num_runs == runs  # eager
    setattr(runner, attr, None)
    assert torch.equal(forward(["a", "b", "c"]), above)  # the same eager forward (same KV rewritten)
    setattr(runner, attr, pieces)
    forward(["a", "b"])  # 500 tokens: the 512 bucket
    assert pieces.num_runs == runs + 1
    assert torch.isfinite(above).all()
