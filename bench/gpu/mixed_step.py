"""Mixed prefill+decode steps, eager vs piecewise vs full CUDA graphs, split vs one attention kernel: ms a step.

    PYTHONPATH=shared:. python bench/gpu/mixed_step.py --random-model llama-1b [--out FILE] \
        [--decode-rows 0,64,256] [--prompt-tokens 32,512,1536] [--steps 20]

One engine (dummy weights, bf16, CUDA graphs on, sync scheduling, no host tier). For each (B decode rows,
P prompt tokens): B requests whose --context tokens are already in the cache decode while, every step, one new
request of P random tokens (max_tokens 1) is admitted whole, so each step is one forward of B + P tokens
(B = 0: a prefill-only step). Each engine.step() is timed with a CUDA sync after it, after --warmup steps,
once with the piecewise graphs and once with them set aside (`runner.piecewise = None`: the eager forward),
and with the piecewise graphs once more with the mixed step's attention in one kernel (the runner's
`mixed_step_decode_kernel` off: the decode rows go through the prefill kernel; the "one kernel" column), and with
the full graphs (one graph a step, attention inside: engine.full_graphs, captured into the same pool; "full").
Prints a table and one JSON line (`--out`: also written there). `--model DIR --device cpu`: a dry run of the
code paths on a small checkpoint (no graphs: both columns eager).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.results_io import emit_json_line


def make_engine(model_dir: str, device: str, max_decode_rows: int, max_tokens: int, max_model_len: int):
    """EngineCore over the config alone (load_format=dummy), piecewise graphs on where the device has graphs."""
    from deepinfer.engine.args import EngineArgs
    from deepinfer.engine.core import EngineCore

    args = EngineArgs(model=model_dir, load_format="dummy", dtype="bfloat16" if device == "cuda" else "float32",
                      device=device, max_model_len=max_model_len, max_num_seqs=max_decode_rows + 1,
                      max_num_batched_tokens=max_tokens, async_scheduling=False, kv_host_cache_bytes=0,
                      enable_kv_events=False, progress=False, execution_mode="piecewise")
    return EngineCore(args)


def capture_full(engine, max_tokens: int, max_model_len: int):
    """Full graphs of the engine's model beside its piecewise ones (None without decode graphs)."""
    from deepinfer.engine.full_graphs import capture_full as capture

    runner = engine.runner
    if runner.graphs is None:
        return None
    graphs = runner.graphs
    return capture(runner.model, runner.kv_caches, max_tokens, runner.max_num_seqs, max_model_len, runner.block_size,
                   runner.device, graphs.pool, graphs.compute_logits, graphs.logits)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_ms(engine, rng, device: str, decode_rows: int, prompt_tokens: int, context: int, warmup: int,
            steps: int) -> float:
    """Mean wall ms of an engine step of `decode_rows` decodes plus one whole new prompt of `prompt_tokens`."""
    from deepinfer.sampling.params import SamplingParams

    vocab = engine.model_config.vocab_size
    decodes = []
    for i in range(decode_rows):
        rid = f"d{rng.integers(1 << 62)}-{i}"
        request = engine.new_request(rid, rng.integers(0, vocab, context + 1).tolist(),
                                     SamplingParams(temperature=0.0, max_tokens=warmup + steps + 4, ignore_eos=True))
        assert engine.scheduler.add_prefilled_request(request, context) is not None, "KV cache too small"
        engine.scheduler.commit_prefilled(rid)
        decodes.append(rid)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times, tokens, forward = [], [], engine.runner.forward

    def counted(batch, **kwargs):
        tokens.append(batch.num_tokens)
        return forward(batch, **kwargs)

    engine.runner.forward = counted  # an instance attribute: the step's token count, checked below
    for i in range(warmup + steps):
        engine.add_request(f"p{rng.integers(1 << 62)}", rng.integers(0, vocab, prompt_tokens).tolist(), one)
        sync(device)
        start = time.perf_counter()
        engine.step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    del engine.runner.forward
    assert tokens == [decode_rows + prompt_tokens] * (warmup + steps), f"steps were not B + P tokens: {tokens}"
    engine.abort_requests(decodes)
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * statistics.mean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-model", default="llama-1b", help="a random-weight shape (shared/deepinfer/testing/random_model.py)")
    parser.add_argument("--model", default=None, help="a checkpoint directory instead of --random-model")
    parser.add_argument("--cache-dir", type=Path, default=Path(".bench-models"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--decode-rows", default="0,64,256")
    parser.add_argument("--prompt-tokens", default="32,512,1536")
    parser.add_argument("--context", type=int, default=512, help="tokens in the cache of each decode row")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", default="eager,piecewise,one_kernel,full",
                        help="columns to time, of eager, piecewise, one_kernel, full")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    variants = args.variants.split(",")
    rows = [int(b) for b in args.decode_rows.split(",")]
    prompts = [int(p) for p in args.prompt_tokens.split(",")]
    model = args.model
    if model is None:
        from deepinfer.testing.random_model import write_random_model

        model = str(write_random_model(args.random_model, args.cache_dir))
    max_tokens = max(2048, max(rows) + max(prompts))
    started = time.perf_counter()
    max_model_len = max(args.context + args.warmup + args.steps + 8, max(prompts) + 8)
    engine = make_engine(model, args.device, max(rows), max_tokens, max_model_len)
    start_s = time.perf_counter() - started
    runner, rng = engine.runner, np.random.default_rng(0)
    pieces = runner.piecewise
    full = capture_full(engine, max_tokens, max_model_len) if "full" in variants else None
    points = []
    print(f"{'decode rows':>11} {'prompt':>6} {'tokens':>6} {'bucket':>6} {'eager ms':>9} {'piecewise ms':>12} "
          f"{'speedup':>7} {'one kernel ms':>13} {'full ms':>8}")
    for b in rows:
        for p in prompts:
            point = {"decode_rows": b, "prompt_tokens": p, "tokens": b + p,
                     "bucket": pieces.bucket(b + p) if pieces else None}
            for name in variants:  # (the full graphs, the piecewise ones, the split of a mixed step's attention)
                full_graphs, piecewise, split = {"eager": (None, None, True), "piecewise": (None, pieces, True),
                                                 "one_kernel": (None, pieces, False), "full": (full, None, True)}[name]
                prompt_runner = full_graphs or piecewise
                if name != "eager" and prompt_runner is None:
                    continue
                runner.full_graphs, runner.piecewise, runner.mixed_step_decode_kernel = full_graphs, piecewise, split
                runs = prompt_runner.num_runs if prompt_runner else 0
                point[f"{name}_ms"] = round(step_ms(engine, rng, args.device, b, p, args.context, args.warmup,
                                                    args.steps), 3)
                if prompt_runner is not None:
                    point[f"{name}_steps"] = prompt_runner.num_runs - runs
            runner.full_graphs, runner.piecewise, runner.mixed_step_decode_kernel = None, pieces, True
            eager, piecewise = point.get("eager_ms"), point.get("piecewise_ms")
            speedup = f"{eager / piecewise:.2f}x" if eager and piecewise else "-"
            print(f"{b:>11} {p:>6} {b + p:>6} {point['bucket'] or '-':>6} {eager or float('nan'):>9.2f} "
                  f"{piecewise or float('nan'):>12.2f} {speedup:>7} {point.get('one_kernel_ms', float('nan')):>13.2f} "
                  f"{point.get('full_ms', float('nan')):>8.2f}")
            points.append(point)
    result = {"bench": "mixed_step", "model": args.model or args.random_model, "device": args.device,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "context": args.context, "warmup": args.warmup, "steps": args.steps,
              "engine_start_s": round(start_s, 1), "piecewise_graphs": pieces.num_graphs if pieces else 0,
              "buckets": pieces.buckets if pieces else [], "points": points}
    emit_json_line(result, args.out)


if __name__ == "__main__":
    main()
