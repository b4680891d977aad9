"""Decode-side measurements of bench/gpu/gpu.py: tok/s with host phases, graph replay time, GPU-busy fraction, and
the decode + idle (+ serving) sections with async scheduling on (`run_async`)."""

from __future__ import annotations

import time

import torch

CONTEXT = 2048


def greedy(max_tokens: int):
    """Greedy, exactly max_tokens new tokens."""
    from deepinfer.sampling.params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=0)


def start_decodes(engine, rng, batch: int, num_tokens: int) -> list[str]:
    """`batch` requests whose first CONTEXT tokens are already in the cache (as a disaggregated decode)."""
    vocab, ids = engine.model_config.vocab_size, []
    for _ in range(batch):
        rid = f"d{rng.integers(1 << 62)}"
        request = engine.new_request(rid, rng.integers(0, vocab, CONTEXT + 1).tolist(), greedy(num_tokens))
        assert engine.scheduler.add_prefilled_request(request, CONTEXT) is not None, "KV cache too small"
        engine.scheduler.commit_prefilled(rid)
        ids.append(rid)
    return ids


def decode_ours(engine, rng, batch: int, steps: int, eager: bool) -> dict:
    """Decode tok/s at CONTEXT tokens of context: `steps` engine steps of `batch` one-token decodes."""
    graphs = engine.runner.graphs
    engine.runner.graphs = None if eager else graphs
    try:
        ids = start_decodes(engine, rng, batch, steps + 16)  # warm-up, timed and phase steps all decode
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()  # async scheduling: the last step is still in flight
        elapsed = time.perf_counter() - start
        phases = step_phases(engine, 8)
        engine.abort_requests(ids)
    finally:
        engine.runner.graphs = graphs
    return {"tok_s": round(batch * steps / elapsed, 1), "step_ms": round(1e3 * elapsed / steps, 3), **phases}


def step_phases(engine, steps: int) -> dict:
    """Host ms per step in schedule(), in execute() (which waits for the GPU; async scheduling: execute_async(),
    which only launches) and in update()."""
    execute = "execute_async" if engine.async_scheduling else "execute"
    totals = {"schedule": 0.0, execute: 0.0, "update": 0.0}
    owners = {"schedule": engine.scheduler, execute: engine.runner, "update": engine.scheduler}
    originals = {name: getattr(owner, name) for name, owner in owners.items()}

    def timed_call(name):
        def call(*a, **k):
            start = time.perf_counter()
            try:
                return originals[name](*a, **k)
            finally:
                totals[name] += time.perf_counter() - start
        return call

    for name, owner in owners.items():
        setattr(owner, name, timed_call(name))
    try:
        for _ in range(steps):
            engine.step()
    finally:
        for name, owner in owners.items():
            delattr(owner, name)  # the instance attribute shadowed the method
    return {f"{name}_ms": round(1e3 * t / steps, 3) for name, t in totals.items()}


def replay_ms(engine, batch: int, max_seq_len: int) -> float:
    """GPU time of the captured forward alone (back-to-back replays, CUDA events): the step's floor."""
    graphs = engine.runner.graphs
    graph = graphs.graphs[batch, graphs.bucket(max_seq_len)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 10


def busy_fraction(engine, rng, batch: int, steps: int, eager: bool) -> dict:
    """GPU busy time (union of kernel intervals from the torch profiler) over the span of `steps` decode steps."""
    from torch.profiler import ProfilerActivity

    prof = profiled_decode(engine, rng, batch, steps, eager, [ProfilerActivity.CPU, ProfilerActivity.CUDA])
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return {"error": "the profiler recorded no GPU events"}
    busy, cur_start, cur_end = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_end:
            busy, cur_start, cur_end = busy + cur_end - cur_start, s, e
        else:
            cur_end = max(cur_end, e)
    busy += cur_end - cur_start
    window = spans[-1][1] - spans[0][0]
    return {"gpu_busy_fraction": round(busy / window, 3), "idle_fraction": round(1 - busy / window, 3),
            "window_ms": round(window / 1e3, 2), "num_gpu_events": len(spans)}


def run_decode_idle(engine, rng, sections: set, out: dict, save, batches=((1, 64), (64, 48), (256, 32))) -> None:
    """The decode (graphs) and idle (B=64, graphs and eager) sections on `engine`, into `out`."""
    if "decode" in sections:
        out.setdefault("decode", {})
        for batch, steps in batches:
            d = decode_ours(engine, rng, batch, steps, eager=False)
            out["decode"][str(batch)] = {"graphs_tok_s": d["tok_s"], "graphs_step_ms": d["step_ms"],
                                         "graphs_phases_ms": {k: v for k, v in d.items()
                                                              if k.endswith("_ms") and k != "step_ms"}}
            save()
    if "idle" in sections:
        out["idle_b64"] = {"graphs": busy_fraction(engine, rng, 64, 20, eager=False),
                           "eager": busy_fraction(engine, rng, 64, 20, eager=True)}
        save()


def run_async(make_engine, model_dir, sections: set, res: dict, save, serving=None) -> None:
    """A second engine with async scheduling on: decode, idle and (when given) serving, into res["async"]."""
    import numpy as np

    engine, build_s = make_engine(model_dir, async_scheduling=True)
    out = res["async"] = {"build_s": round(build_s, 1)}
    run_decode_idle(engine, np.random.default_rng(3), sections, out, save)
    if serving is not None and "serving" in sections:
        out["serving"] = serving(engine)
        save()
    del engine


def profiled_decode(engine, rng, batch: int, steps: int, eager: bool, activities):
    """torch.profiler over `steps` decode steps of `batch` requests (after 3 warm-up steps); graphs off if eager."""
    from torch.profiler import profile

    graphs = engine.runner.graphs
    engine.runner.graphs = None if eager else graphs
    try:
        ids = start_decodes(engine, rng, batch, steps + 16)
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        engine.abort_requests(ids)
    finally:
        engine.runner.graphs = graphs
    return prof


def kernel_profile(engine, rng, batch: int, steps: int = 4, top: int = 12) -> dict:
    """Where an eager decode step's device time goes: the `top` CUDA kernels by time (torch.profiler), ms/step."""
    from torch.profiler import ProfilerActivity

    return top_kernels(profiled_decode(engine, rng, batch, steps, True, [ProfilerActivity.CUDA]), steps, top)


def top_kernels(prof, steps: int, top: int = 12) -> dict:
    """A profile's device ms per step and its `top` CUDA kernels by device time."""
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total_ms = sum(e.device_time_total for e in events) / 1e3 / steps
    rows = sorted(events, key=lambda e: e.device_time_total, reverse=True)[:top]
    return {"device_ms_per_step": round(total_ms, 3),
            "top_kernels": [{"name": e.key[:90], "ms_per_step": round(e.device_time_total / 1e3 / steps, 4),
                             "calls_per_step": e.count // steps} for e in rows]}
