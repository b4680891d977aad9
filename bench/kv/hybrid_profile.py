"""Where a hybrid (KV by layer type) prefill's time goes against the all-layers engine's: one cold send of L random
tokens per mode under torch.profiler, the top ops by device and by host time, and each step's wall time.

    PYTHONPATH=shared:. python -m bench.kv.hybrid_profile --random-model gemma3-1b --device cuda --length 32000
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from deepinfer import LLM, SamplingParams


def cold_send(llm: LLM, length: int) -> list[float]:
    """Step times (s) of one cold prompt of `length` random tokens up to its first token."""
    rng = random.Random(length)
    core = llm.engine.core
    prompt = [rng.randrange(1000, core.model_config.vocab_size) for _ in range(length)]
    core.add_request("cold", prompt, SamplingParams(temperature=0, max_tokens=2))
    steps = []
    while True:
        started = time.perf_counter()
        outputs = core.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - started)
        if any(o.new_token_ids for o in outputs):
            break
    while core.scheduler.has_unfinished_requests():
        core.step()
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-model", default="gemma3-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--length", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=18)
    args = parser.parse_args()
    from deepinfer.testing.random_model import write_random_model

    model = str(write_random_model(args.random_model))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    for hybrid in (False, True):
        llm = LLM(model, load_format="dummy", device=args.device, kv_host_cache_bytes=0, progress=False,
                  max_model_len=args.length + 64, enable_hybrid_kv_cache=hybrid)
        cold_send(llm, 512)  # warm-up: kernels compiled, allocator primed
        with profile(activities=activities) as prof:
            steps = cold_send(llm, args.length)
        print(f"\n=== hybrid={hybrid} mode={llm.engine.core.execution_mode.value}: {len(steps)} steps, "
              f"{sum(steps):.3f} s: {[round(s, 4) for s in steps]}")
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                        max_name_column_width=60))
        llm.close()
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
