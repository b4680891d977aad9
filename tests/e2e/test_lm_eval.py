"""EleutherAI's lm-evaluation-harness against the stack: its `local-completions` model runs a multiple-choice
(loglikelihood), a perplexity (loglikelihood_rolling) and a generation task (deepinfer.testing.lm_eval_tasks) with
batched requests, and every per-sample log-likelihood matches its `hf` model on the same weights within 1e-3
(float32, CPU); the generations are the same.

The harness is a test dependency (`lm-eval[api]`, pinned in constraints.txt): the test runs the `lm_eval` CLI beside
this Python, or the one DEEPINFER_TEST_LM_EVAL names (another environment's, to try another harness version)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.defaults import default_model_cache_dir
from deepinfer.model_store import resolve_model
from deepinfer.testing.lm_eval_tasks import compare, lm_eval_commands, table, write_tasks
from deepinfer.up import Stack

pytestmark = pytest.mark.e2e

LM_EVAL = os.environ.get("DEEPINFER_TEST_LM_EVAL") or str(Path(sys.executable).parent / "lm_eval")


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
