"""EleutherAI's lm-evaluation-harness against the stack: its `local-completions` model runs a multiple-choice
(loglikelihood), a perplexity (loglikelihood_rolling) and a generation task (deepinfer.testing.lm_eval_tasks) with
batched requests, and every per-sample log-likelihood matches its `hf` model on the same weights within 1e-3
(float32, CPU); the generations are the same.

The harness is not in this project's environment (it brings its own pins): the test runs its CLI from the
environment named by DEEPINFER_TEST_LM_EVAL (a path to `lm_eval`, e.g. a venv with `lm-eval[api]==0.4.13`,
transformers and accelerate), else an `lm_eval` on PATH, and is skipped without one."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from deepinfer.defaults import default_model_cache_dir
from deepinfer.model_store import resolve_model
from deepinfer.testing.lm_eval_tasks import compare, lm_eval_commands, table, write_tasks
from deepinfer.up import Stack

pytestmark = pytest.mark.e2e

LM_EVAL = os.environ.get("DEEPINFER_TEST_LM_EVAL") or shutil.which("lm_eval")


@pytest.mark.skipif(LM_EVAL is None, reason="no lm_eval CLI (set DEEPINFER_TEST_LM_EVAL)")
def test_lm_eval_local_completions_matches_its_hf_model(stack: Stack, tmp_path: Path):
    model_dir = resolve_model(stack.model, default_model_cache_dir(), progress=False)
    commands = lm_eval_commands(str(LM_EVAL), write_tasks(tmp_path / "tasks"), tmp_path, f"{stack.base_url}/completions",
                                stack.model_name, model_dir, batch_size=4)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for name, command in commands.items():
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, f"{name}: {run.stderr[-3000:]}"
    comparison = compare(tmp_path / "local-completions", tmp_path / "hf")
    print(table(comparison, "local-completions", "hf"))
    assert comparison.num_loglikelihoods == 8 * 4 + 4
    assert comparison.largest_diff < 1e-3
    assert sum(comparison.generation_mismatches.values()) == 0
    for task, metrics in comparison.scores.items():
        for metric, (ours, theirs) in metrics.items():
            assert ours == pytest.approx(theirs, rel=1e-3), (task, metric)
