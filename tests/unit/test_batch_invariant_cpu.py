"""Batch-invariant mode on the CPU: the fixed-tile Triton matmul under TRITON_INTERPRET=1 (parity with F.linear,
bit-identical rows whatever the batch), and the runner in that mode (a request's tokens and logprobs alone equal
those inside a batch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.execution import RunnerConfig
from deepinfer.engine.request import Request
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.scheduler import Scheduler
from deepinfer.kernels import get_ops
from deepinfer.loader.dummy import load_dummy_model
from deepinfer.sampling.params import SamplingParams

_INTERPRETED = """
import torch, torch.nn.functional as F
from triton.runtime import interpreter

original = interpreter._patch_lang_tensor  # numpy >= 2.4 refuses int() of 1-element arrays (triton#9171)

def patch_lang_tensor(tensor, scope):
    original(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

interpreter._patch_lang_tensor = patch_lang_tensor
from deepinfer.kernels.triton_matmul import linear
torch.manual_seed(0)
K, N = 80, 144  # neither a multiple of the tiles: masked edges on both
w, bias = torch.randn(N, K), torch.randn(N)
target = torch.randn(1, K)
alone = linear(target, w, bias)
ref = F.linear(target.double(), w.double(), bias.double()).float()
assert ((alone - ref).norm() / ref.norm()).item() < 1e-5, "parity with F.linear"
for rows, where in ((8, 3), (131, 130), (200, 64)):  # within one tile, past BLOCK_M, deep in the second tile
    batch = torch.randn(rows, K)
    batch[where] = target[0]
    out = linear(batch, w, bias)
    assert torch.equal(out[where], alone[0]), (rows, where)
    ref = F.linear(batch.double(), w.double(), bias.double()).float()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
print("ok")
"""


def test_triton_matmul_rows_are_batch_invariant_under_the_interpreter():
    """Runs in a subprocess: TRITON_INTERPRET must be set before triton is imported."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_rowwise_twin_matches_f_linear_and_the_mode_routes_linears():
    from deepinfer.kernels.triton_matmul import BatchInvariantLinear, rowwise_linear

    torch.manual_seed(1)
    x, w = torch.randn(5, 3, 16), torch.randn(24, 16)
    torch.testing.assert_close(rowwise_linear(x, w), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
    calls = []

    def impl(*args, **kwargs):
        calls.append(args[0].shape)
        return rowwise_linear(*args, **kwargs)

    layer = torch.nn.Linear(16, 24)
    with BatchInvariantLinear(impl):
        out = layer(x)
    assert calls == [x.shape] and out.shape == (5, 3, 24)
    layer(x)  # outside the mode: the library again
    assert len(calls) == 1


def run_alone_and_in_batch(runner: ModelRunner, config: EngineConfig, prompts: list[list[int]], max_tokens: int):
    """Generate greedily through Scheduler + runner: (token ids, logprobs) of every prompt, all in one batch."""
    scheduler = Scheduler(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=0, logprobs=0)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"r{i}", prompt, params, arrival_time=float(i)))
    tokens: dict[str, list[tuple[int, float]]] = {}
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        sampled = runner.execute(output, scheduler.requests)
        for rid, s in sampled.items():
            tokens.setdefault(rid, []).append((s.token_id, s.logprob))
        scheduler.update(output, {rid: [s.token_id] for rid, s in sampled.items()})
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_runner_in_batch_invariant_mode_gives_the_same_tokens_alone_and_in_a_batch(tmp_path):
    """Mixed steps (decodes beside prefill chunks, a small budget) split into two forwards. Tokens must be equal;
    logprobs only to 1e-5 here: the CPU torch twins' vectorised elementwise kernels (exp, rsqrt) take a scalar
    tail at positions that depend on the number of rows. Bit-identity is the GPU test's (Triton kernels)."""
    torch.set_num_threads(1)
    config_json = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
                   "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    model = load_dummy_model(tmp_path, torch.float32, "cpu", get_ops("cpu"), seed=2, std=0.2)
    config = EngineConfig(num_blocks=64, max_model_len=64, block_size=4, max_num_seqs=8,
                          max_num_batched_tokens=16)
    kv_caches = [torch.zeros(2, 64, 4, 2, 8) for _ in range(2)]
    runner = ModelRunner(model, kv_caches, RunnerConfig(block_size=4, vocab_size=96, device=torch.device("cpu"),
                                                        max_model_len=64, max_num_seqs=8, batch_invariant=True))
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 96, (9,), generator=g).tolist()
    others = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (13, 3, 21, 6, 5, 17, 2)]
    alone = run_alone_and_in_batch(runner, config, [target], 6)[0]
    for num_others in (1, 7):
        batched = run_alone_and_in_batch(runner, config, [target, *others[:num_others]], 6)[0]
        assert [t for t, _ in batched] == [t for t, _ in alone], num_others
        assert max(abs(a - b) for (_, a), (_, b) in zip(alone, batched, strict=True)) < 1e-5
    assert len(alone) == 6


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_batch_invariant_runner_needs_max_model_len(batch_invariant):
    make = lambda: ModelRunner(torch.nn.Identity(), [], RunnerConfig(  # noqa: E731
        block_size=4, vocab_size=8, device=torch.device("cpu"), batch_invariant=batch_invariant))
    if batch_invariant:
        with pytest.raises(ValueError, match="max_model_len"):
            make()
    else:
        assert not make().batch_invariant
