"""Every execution mode against eager on one GPU: where greedy tokens first differ, and how close the eager run's
top-2 logits were there (a near tie, or a bug).

    PYTHONPATH=shared:. python3 bench/gpu/graph_vs_eager.py --out graph-vs-eager.json

The tiny Llama of tests/gpu/test_model_gpu.py (4 layers, random weights, llama3 RoPE scaling), 11 prompts (a decode
graph of 16 rows, 5 padding rows), 24 greedy tokens each. For each (dtype, mode) pair: per prompt, the first position
whose token differs from eager, the eager engine's top-2 logprob margin there (teacher-forced: the prompt and the
common tokens, one step with logprobs=2) and the mode's own margin. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from deepinfer.testing import checkpoints

SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 32}
NEW_TOKENS = 24
#: name -> engine arguments over the eager baseline
MODES = {
    "decode": {"execution_mode": "decode", "graph_sampling": False},
    "decode+tail": {"execution_mode": "decode"},
    "piecewise": {"execution_mode": "piecewise"},
    "full": {"execution_mode": "full", "graph_sampling": False},
    "full+tail": {"execution_mode": "full"},
    "full-sync": {"async_scheduling": False},
    "decode-sync": {"execution_mode": "decode", "graph_sampling": False, "async_scheduling": False},
}


def prompts(n: int, vocab: int = 384, seed: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (int(length),), generator=g).tolist()
            for length in torch.randint(3, 90, (n,), generator=g)]


def engine(checkpoint: Path, dtype: str, **kwargs):
    from deepinfer import LLM

    return LLM(str(checkpoint), device="cuda", dtype=dtype, accelerator="cuda", progress=False,
               kv_cache_bytes=64 << 20, max_num_seqs=16, **kwargs)


def greedy(llm, batch: list[list[int]]) -> list[list[int]]:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def sampled(llm, batch: list[list[int]]) -> list[list[int]]:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True, seed=7)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch[:3]], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def top2(llm, context: list[int]) -> tuple[list[int], float]:
    """(top-2 token ids, margin in logprob) of one step after `context`."""
    from deepinfer import SamplingParams

    out = llm.generate([{"prompt_token_ids": context}], SamplingParams(temperature=0, max_tokens=1, logprobs=2),
                       use_tqdm=False)[0].outputs[0]
    ranked = sorted(out.logprobs[0].items(), key=lambda kv: -kv[1].logprob)
    return [t for t, _ in ranked[:2]], ranked[0][1].logprob - ranked[1][1].logprob


def compare(eager, other, batch, ref, got) -> list[dict]:
    rows = []
    for prompt, want, have in zip(batch, ref, got, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(want, have, strict=True)) if a != b), None)
        row = {"prompt_len": len(prompt), "first_diff": first}
        if first is not None:
            context = prompt + want[:first]
            row["eager_top2"], row["eager_margin"] = top2(eager, context)
            row["mode_top2"], row["mode_margin"] = top2(other, context)
            row["eager_token"], row["mode_token"] = want[first], have[first]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="graph-vs-eager.json")
    parser.add_argument("--dtypes", default="float32,bfloat16,bfloat16-invariant")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    ckpt = checkpoints.make_tiny_checkpoint(tmp / "llama", "llama", std=0.1, seed=3,
                                            rope_scaling=checkpoints.LLAMA3_ROPE_SCALING, **SHAPE)
    batch = prompts(11)
    results: dict = {}
    for dtype_name in args.dtypes.split(","):
        dtype, invariant = dtype_name.removesuffix("-invariant"), dtype_name.endswith("-invariant")
        extra = {"batch_invariant": True} if invariant else {}
        eager = engine(ckpt, dtype, enforce_eager=True, **extra)
        ref, ref_random = greedy(eager, batch), sampled(eager, batch)
        eager_again = greedy(eager, batch)
        results[dtype_name] = {"eager_repeatable": ref == eager_again}
        modes = ["full"] if invariant else args.modes.split(",")
        for mode in modes:
            started = time.monotonic()
            try:
                llm = engine(ckpt, dtype, **extra, **MODES[mode])
                got, got_random = greedy(llm, batch), sampled(llm, batch)
                rows = compare(eager, llm, batch, ref, got)
                entry = {"rows": rows, "equal": got == ref, "random_equal": got_random == ref_random,
                         "runner": {"graphs": llm.engine.core.runner.graphs is not None,
                                    "piecewise": llm.engine.core.runner.piecewise is not None,
                                    "full": llm.engine.core.runner.full_graphs is not None,
                                    "async": llm.engine.core.async_scheduling},
                         "seconds": round(time.monotonic() - started, 1)}
                del llm
            except Exception as exc:  # a mode that fails to build or run: record it, go on
                entry = {"error": repr(exc)}
            results[dtype_name][mode] = entry
            diffs = [r for r in entry.get("rows", []) if r["first_diff"] is not None]
            print(f"{dtype_name:18s} {mode:12s} equal={entry.get('equal')} random_equal={entry.get('random_equal')} "
                  f"differing={len(diffs)} " + " ".join(
                      f"[{r['first_diff']}: eager {r['eager_margin']:.4f} mode {r['mode_margin']:.4f}]"
                      for r in diffs) + (f" ERROR {entry['error']}" if "error" in entry else ""), flush=True)
        del eager
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
