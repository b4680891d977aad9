"""No Triton compile while serving: after the engine's start (CUDA graph capture + warm-up), a workload of
varied prompt lengths, mixed prefill/decode steps, prefix hits and sampling modes compiles nothing.

Run in a fresh process: Triton's in-memory kernel cache is per process, and earlier tests would have compiled
most variants already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib.util, json, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("checkpoints", sys.argv[2] + "/shared/deepinfer/testing/checkpoints.py")
checkpoints = importlib.util.module_from_spec(spec)
spec.loader.exec_module(checkpoints)
from deepinfer import LLM, SamplingParams

model_dir = checkpoints.make_tiny_checkpoint(Path(sys.argv[1]) / "llama", "llama")
llm = LLM(str(model_dir), dtype="bfloat16", max_num_seqs=8, max_model_len=512, max_num_batched_tokens=256,
          kv_cache_bytes=64 << 20, progress=False)
watch = llm.engine.core.compiles
start = watch.start_compiles
lengths = [3, 9, 16, 17, 30, 33, 60, 64, 70, 100, 130, 200, 300, 450]
prompts = [{"prompt_token_ids": [(7 * i + j) % 250 + 1 for j in range(n)]} for i, n in enumerate(lengths)]
prompts.append({"prompt_token_ids": prompts[-2]["prompt_token_ids"] + [5, 6, 7]})  # a prefix hit
params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.7, min_p=0.1, seed=4, max_tokens=9, ignore_eos=True, logprobs=2)]
for round_ in range(2):
    llm.generate(prompts, [params[(i + round_) % 3] for i in range(len(prompts))], use_tqdm=False)
pieces = llm.engine.core.runner.full_graphs  # prompt steps ran as full graphs (the default): their kernels too
print(json.dumps({"start": start, "serving": watch.serving_compiles, "piecewise_runs": pieces.num_runs,
                  "piecewise_graphs": pieces.num_graphs}))
"""


def test_no_compile_while_serving(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "shared"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(ROOT)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["start"] > 0, counts  # the watch saw the start's compiles
    assert counts["piecewise_runs"] > 0 and counts["piecewise_graphs"] > 0, counts
    assert counts["serving"] == 0, done.stderr[-3000:]
