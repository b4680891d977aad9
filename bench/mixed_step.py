"""Mixed prefill+decode steps, eager vs piecewise CUDA graphs, split vs one attention kernel: ms per engine step.

    PYTHONPATH=shared:. python bench/mixed_step.py --random-model llama-1b [--out FILE] \
        [--decode-rows 0,64,256] [--prompt-tokens 32,512,1536] [--steps 20]

One engine (dummy weights, bf16, CUDA graphs on, sync scheduling, no host tier). For each (B decode rows,
P prompt tokens): B requests whose --context tokens are already in the cache decode while, every step, one new
request of P random tokens (max_tokens 1) is admitted whole, so each step is one forward of B + P tokens
(B = 0: a prefill-only step). Each engine.step() is timed with a CUDA sync after it, after --warmup steps,
once with the piecewise graphs and once with them set aside (`runner.piecewise = None`: the eager forward),
and with the piecewise graphs once more with the mixed step's attention in one kernel (the runner's
`mixed_step_decode_kernel` off: the decode rows go through the prefill kernel; the "one kernel" column), and with
the piecewise graphs and each layer's attention through `paged_attention` and a copy into the static buffer instead
of the step's AttentionPlan (its launches recorded on layer 0 and launched again for the others; "plan off").
Prints a table and one JSON line (`--out`: also written there). `--model DIR --device cpu`: a dry run of the
code paths on a small checkpoint (no graphs: both columns eager).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import emit_json_line  # noqa: E402


def make_engine(model_dir: str, device: str, max_decode_rows: int, max_tokens: int, max_model_len: int):
    """EngineCore over the config alone (load_format=dummy), piecewise graphs on where the device has graphs."""
    from deepinfer.engine.args import EngineArgs
    from deepinfer.engine.core import EngineCore

    args = EngineArgs(model=model_dir, load_format="dummy", dtype="bfloat16" if device == "cuda" else "float32",
                      device=device, max_model_len=max_model_len, max_num_seqs=max_decode_rows + 1,
                      max_num_batched_tokens=max_tokens, async_scheduling=False, kv_host_cache_bytes=0,
                      enable_kv_events=False, progress=False, piecewise_cuda_graphs=True)
    return EngineCore(args)


class PlainAttention:
    """The session-11 eager attention of a piecewise step, as an attention plan: paged_attention per layer, copied."""

    def __init__(self, paged_attention, query, out, meta) -> None:
        self.paged_attention, self.query, self.out, self.meta = paged_attention, query, out, meta

    def __call__(self, kv_cache, scale, sliding_window=None) -> None:
        self.out.copy_(self.paged_attention(self.query, kv_cache, self.meta, scale, sliding_window))


def plan_off(pieces):
    """Swap the piecewise runner's attention plan for PlainAttention; returns the attention module and its ops."""
    import dataclasses
    import functools

    attn = pieces.layers[0].self_attn
    ops = attn.ops
    attn.ops = dataclasses.replace(ops, attention_plan=functools.partial(PlainAttention, ops.paged_attention))
    return attn, ops


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
    parser.add_argument("--random-model", default="llama-1b", help="a random-weight shape (bench/random_model.py)")
    parser.add_argument("--model", default=None, help="a checkpoint directory instead of --random-model")
    parser.add_argument("--cache-dir", type=Path, default=Path(".bench-models"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--decode-rows", default="0,64,256")
    parser.add_argument("--prompt-tokens", default="32,512,1536")
    parser.add_argument("--context", type=int, default=512, help="tokens in the cache of each decode row")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = [int(b) for b in args.decode_rows.split(",")]
    prompts = [int(p) for p in args.prompt_tokens.split(",")]
    model = args.model
    if model is None:
        from random_model import write_random_model

        model = str(write_random_model(args.random_model, args.cache_dir))
    max_tokens = max(2048, max(rows) + max(prompts))
    started = time.perf_counter()
    max_model_len = max(args.context + args.warmup + args.steps + 8, max(prompts) + 8)
    engine = make_engine(model, args.device, max(rows), max_tokens, max_model_len)
    start_s = time.perf_counter() - started
    runner, rng = engine.runner, np.random.default_rng(0)
    pieces = runner.piecewise
    points = []
    print(f"{'decode rows':>11} {'prompt':>6} {'tokens':>6} {'bucket':>6} {'eager ms':>9} {'piecewise ms':>12} "
          f"{'speedup':>7} {'one kernel ms':>13} {'plan off ms':>11}")
    for b in rows:
        for p in prompts:
            point = {"decode_rows": b, "prompt_tokens": p, "tokens": b + p}
            runner.piecewise = None
            point["eager_ms"] = round(step_ms(engine, rng, args.device, b, p, args.context, args.warmup,
                                              args.steps), 3)
            runner.piecewise = pieces
            if pieces is not None:
                runs = pieces.num_runs
                point["bucket"] = pieces.bucket(b + p)
                point["piecewise_ms"] = round(step_ms(engine, rng, args.device, b, p, args.context, args.warmup,
                                                      args.steps), 3)
                point["piecewise_steps"] = pieces.num_runs - runs
            runner.mixed_step_decode_kernel = False
            point["one_kernel_ms"] = round(step_ms(engine, rng, args.device, b, p, args.context, args.warmup,
                                                   args.steps), 3)
            runner.mixed_step_decode_kernel = True
            if pieces is not None:
                attn, ops = plan_off(pieces)
                point["plan_off_ms"] = round(step_ms(engine, rng, args.device, b, p, args.context, args.warmup,
                                                     args.steps), 3)
                attn.ops = ops
            piecewise = point.get("piecewise_ms")
            speedup = f"{point['eager_ms'] / piecewise:.2f}x" if piecewise else "-"
            print(f"{b:>11} {p:>6} {b + p:>6} {point.get('bucket') or '-':>6} {point['eager_ms']:>9.2f} "
                  f"{piecewise or float('nan'):>12.2f} {speedup:>7} {point['one_kernel_ms']:>13.2f} "
                  f"{point.get('plan_off_ms', float('nan')):>11.2f}")
            points.append(point)
    result = {"bench": "mixed_step", "model": args.model or args.random_model, "device": args.device,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "context": args.context, "warmup": args.warmup, "steps": args.steps,
              "engine_start_s": round(start_s, 1), "piecewise_graphs": pieces.num_graphs if pieces else 0,
              "buckets": pieces.buckets if pieces else [], "points": points}
    emit_json_line(result, args.out)


if __name__ == "__main__":
    main()
