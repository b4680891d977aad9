"""EleutherAI's lm-evaluation-harness against a running deepinfer endpoint: its `local-completions` model on a
multiple-choice (loglikelihood), a perplexity (loglikelihood_rolling) and a generation task, next to its `hf` model
on the same weights (float32 on the CPU, or --hf-dtype/--hf-device); prints both runs' scores, the largest per-sample log-likelihood difference and
the differing generations, then one JSON line.

    deepinfer up --port 8000 &                          # or any deployment serving the model
    PYTHONPATH=shared:. python bench/eval/lm_eval_parity.py --base-url http://127.0.0.1:8000 --model-dir ~/.cache/deepinfer/models/<dir> \\
        --lm-eval /path/to/venv/bin/lm_eval              # lm-eval[api]==0.4.13 (+ transformers, accelerate)

The harness runs from its own environment (`--lm-eval`); the tasks are local files (deepinfer.testing.lm_eval_tasks),
so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deepinfer.testing.lm_eval_tasks import compare, lm_eval_commands, table, write_tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model-dir", required=True, type=Path, help="the served model's Hugging Face directory")
    parser.add_argument("--served-model-name", default="smollm2-135m-instruct")
    parser.add_argument("--lm-eval", default="lm_eval", help="the harness's CLI (from its own environment)")
    parser.add_argument("--batch-size", type=int, default=4, help="prompts per completions request")
    parser.add_argument("--out", type=Path, default=None, help="where the harness writes (default: a temp dir)")
    parser.add_argument("--hf-dtype", default="float32", help="the hf run's dtype (bfloat16 beside a GPU server)")
    parser.add_argument("--hf-device", default="cpu", help="the hf run's device (cuda beside a GPU server)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="lm-eval-parity-"))
    task_dir = write_tasks(out / "tasks")
    commands = lm_eval_commands(args.lm_eval, task_dir, out, f"{args.base_url.rstrip('/')}/v1/completions",
                                args.served_model_name, args.model_dir.expanduser(), args.batch_size,
                                args.hf_dtype, args.hf_device)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    seconds = {}
    for name, command in commands.items():
        started = time.perf_counter()
        print("$", " ".join(command), file=sys.stderr)
        subprocess.run(command, check=True, env=env, stdout=sys.stderr)
        seconds[name] = round(time.perf_counter() - started, 1)
    comparison = compare(out / "local-completions", out / "hf")
    print(table(comparison, "local-completions", "hf"))
    print(json.dumps({"bench": "lm_eval_parity", "largest_loglikelihood_diff": comparison.largest_diff,
                      "num_loglikelihoods": comparison.num_loglikelihoods,
                      "differing_generations": sum(comparison.generation_mismatches.values()),
                      "scores": {task: {m: list(v) for m, v in metrics.items()}
                                 for task, metrics in comparison.scores.items()},
                      "seconds": seconds, "out": str(out)}))


if __name__ == "__main__":
    main()
