"""Small local tasks for EleutherAI's lm-evaluation-harness (`lm_eval`), one per output type, and the comparison of
two runs' per-sample results: how the harness's `local-completions` model against a deepinfer endpoint is checked
against its `hf` model on the same weights (bench/eval/lm_eval_parity.py, tests/e2e/test_lm_eval.py).

    task_dir = write_tasks(tmp)                     # YAML + JSONL: no dataset is downloaded
    lm_eval --include_path task_dir --tasks deepinfer_mc,deepinfer_rolling,deepinfer_gen --log_samples ...
    report = compare(samples_dir_a, samples_dir_b)  # every per-sample log-likelihood, side by side

The harness is not a dependency of this package: this module only writes files and reads its JSON output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

#: multiple_choice: the harness asks the log-likelihood of each choice after the question (loglikelihood).
MC = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("What color is the sky on a clear day?", ["green", "blue", "red", "black"], 1),
    ("How many legs does a spider have?", ["six", "four", "eight", "ten"], 2),
    ("Which animal barks?", ["a cat", "a cow", "a fish", "a dog"], 3),
    ("What do bees make?", ["honey", "milk", "silk", "wool"], 0),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
    ("What is two plus two?", ["three", "five", "four", "six"], 2),
    ("Which season is the coldest?", ["summer", "spring", "autumn", "winter"], 3),
]
#: loglikelihood_rolling: the log-likelihood of each whole text (perplexity), scored with max_tokens 0.
ROLLING = [
    "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks were striking "
    "thirteen.",
    "A paged KV cache stores keys and values in fixed-size blocks, and a prefix cache lets many requests share the "
    "blocks of a common system prompt.",
    "Paris is the capital and most populous city of France. The city is a major European centre of finance, "
    "diplomacy, commerce, culture, fashion and gastronomy.",
    "One, two, three, four, five, six, seven, eight, nine, ten. Counting is the process of determining the number of "
    "elements of a finite set of objects.",
]
#: generate_until: greedy generation up to the end of the sentence.
GENERATION = [
    ("The capital of France is", "Paris"),
    ("The largest ocean on Earth is", "the Pacific Ocean"),
    ("A week has seven days, and a year has twelve", "months"),
    ("The opposite of hot is", "cold"),
]
TASKS = ("deepinfer_mc", "deepinfer_rolling", "deepinfer_gen")


def write_tasks(directory: Path) -> Path:
    """Write the three tasks (YAML) and their data (JSONL) into `directory`; pass it as `--include_path`."""
    directory.mkdir(parents=True, exist_ok=True)
    data = {
        "deepinfer_mc": [{"question": q, "choices": c, "answer": a} for q, c, a in MC],
        "deepinfer_rolling": [{"text": t} for t in ROLLING],
        "deepinfer_gen": [{"question": q, "answer": a} for q, a in GENERATION],
    }
    for task, rows in data.items():
        (directory / f"{task}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    yamls = {
        "deepinfer_mc": 'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
                        'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
                        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        "deepinfer_rolling": "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
                             "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
                             "  - metric: bits_per_byte\n",
        "deepinfer_gen": 'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: " {{answer}}"\n'
                         'generation_kwargs:\n  until: [".", "\\n"]\n  do_sample: false\n  max_gen_toks: 16\n'
                         "metric_list:\n  - metric: exact_match\n    ignore_case: true\n"
                         "    ignore_punctuation: true\n",
    }
    for task, body in yamls.items():
        path = directory / f"{task}.jsonl"
        (directory / f"{task}.yaml").write_text(f"task: {task}\n" + common.format(path=path) + body)
    return directory


def lm_eval_commands(lm_eval: str, task_dir: Path, out_dir: Path, base_url: str, served_model_name: str,
                     model_dir: Path, batch_size: int = 4, hf_dtype: str = "float32",
                     hf_device: str = "cpu") -> dict[str, list[str]]:
    """The two harness runs to compare, by name: `local-completions` against `base_url` (the server's
    /v1/completions; token ids in, the model's own tokenizer files), `hf` on the same weights (float32 on the CPU
    unless told: the GPU comparison runs both in bfloat16)."""
    common = ["--include_path", str(task_dir), "--tasks", ",".join(TASKS), "--log_samples"]
    return {
        "local-completions": [
            lm_eval, "--model", "local-completions", "--model_args",
            f"base_url={base_url},model={served_model_name},tokenizer={model_dir},tokenized_requests=True,"
            f"num_concurrent=1,max_retries=1", "--batch_size", str(batch_size),
            *common, "--output_path", str(out_dir / "local-completions"),
        ],
        "hf": [
            lm_eval, "--model", "hf", "--model_args", f"pretrained={model_dir},dtype={hf_dtype}", "--device", hf_device,
            "--batch_size", "1", *common, "--output_path", str(out_dir / "hf"),
        ],
    }


@dataclass
class Comparison:
    """Two runs of the tasks side by side: each task's scores, and the per-sample log-likelihood differences."""

    #: task -> metric -> (run a, run b)
    scores: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    #: task -> the largest |a - b| over its samples' log-likelihoods (each choice of a multiple-choice question)
    max_loglikelihood_diff: dict[str, float] = field(default_factory=dict)
    #: task -> samples whose generations differ (generate_until)
    generation_mismatches: dict[str, int] = field(default_factory=dict)
    num_loglikelihoods: int = 0

    @property
    def largest_diff(self) -> float:
        """The largest per-sample log-likelihood difference over every task."""
        return max(self.max_loglikelihood_diff.values(), default=0.0)


def compare(run_a: Path, run_b: Path) -> Comparison:
    """Compare two `lm_eval --output_path X --log_samples` runs of TASKS (X: a directory each)."""
    result = Comparison()
    a_results, b_results = _results(run_a), _results(run_b)
    for task in TASKS:
        metrics = {name: value for name, value in a_results[task].items()
                   if isinstance(value, float) and "stderr" not in name}
        result.scores[task] = {name: (value, b_results[task][name]) for name, value in metrics.items()}
        a_samples, b_samples = _samples(run_a, task), _samples(run_b, task)
        assert a_samples.keys() == b_samples.keys(), task
        if task == "deepinfer_gen":
            result.generation_mismatches[task] = sum(
                a_samples[k]["filtered_resps"] != b_samples[k]["filtered_resps"] for k in a_samples)
            continue
        diffs = []
        for doc_id, sample in a_samples.items():
            for got, want in zip(_loglikelihoods(sample), _loglikelihoods(b_samples[doc_id]), strict=True):
                diffs.append(abs(got - want))
        result.num_loglikelihoods += len(diffs)
        result.max_loglikelihood_diff[task] = max(diffs)
    return result


def table(comparison: Comparison, name_a: str, name_b: str) -> str:
    """A plain-text table of the scores and differences."""
    lines = [f"{'task':<20} {'metric':<18} {name_a:>16} {name_b:>16}"]
    for task, metrics in comparison.scores.items():
        for metric, (a, b) in metrics.items():
            lines.append(f"{task:<20} {metric:<18} {a:>16.6f} {b:>16.6f}")
    for task, diff in comparison.max_loglikelihood_diff.items():
        lines.append(f"{task:<20} max |d loglik|     {diff:>16.3e}")
    for task, count in comparison.generation_mismatches.items():
        lines.append(f"{task:<20} differing outputs  {count:>16d}")
    return "\n".join(lines)


def _results(run: Path) -> dict[str, dict]:
    (path,) = sorted(run.rglob("results_*.json"))[-1:]
    return json.loads(path.read_text())["results"]


def _samples(run: Path, task: str) -> dict[int, dict]:
    (path,) = sorted(run.rglob(f"samples_{task}_*.jsonl"))[-1:]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["doc_id"]: row for row in rows}


def _loglikelihoods(sample: dict) -> list[float]:
    """A sample's log-likelihoods: one per choice (multiple choice), or the text's (rolling)."""
    values = []
    for response in sample["resps"]:
        first = response[0]
        values.append(float(first[0] if isinstance(first, list) else first))
    return values
