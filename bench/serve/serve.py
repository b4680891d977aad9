"""Serving path vs offline engine on the same device share, over a concurrency sweep, in one run.

    PYTHONPATH=shared:. python bench/serve/serve.py                                        # default model, CPU or GPU, sweep 1,4
    PYTHONPATH=shared:. python bench/serve/serve.py --random-model llama-1b --sweep 1,16,64,256 --max-tokens 256 [--trace]
    PYTHONPATH=shared:. python bench/serve/serve.py --base-url http://host:8000/v1 --model NAME --no-offline

Without --base-url it starts the whole stack (`deepinfer up`'s Stack: nats, scheduler, prefill, decode, gateway;
prefill on GPU 0 and decode on GPU 1 when two GPUs are there). `--random-model SHAPE` serves a random-weight
checkpoint of that shape with the default model's tokenizer (shared/deepinfer/testing/random_model.py; workers and the offline
engine use load_format=dummy, so nothing is downloaded or read). The load comes from `serve_clients.py`:
several client processes, each reporting its CPU (a warning when one nears a core). Client-side metrics as
ANCHORS.md defines them: TTFT, ITL (every gap between streamed chunks), TPOT per request. After the stack
stops, the offline engine (`deepinfer.LLM`) runs the same prompts with max_num_seqs = the concurrency on the
decode worker's device and memory share. Per point: a hop breakdown from the services' hop histograms, and from
the spans with --trace (the file exporter; per-token spans slow the service a little). Prints tables and one JSON
line; writes the JSON under bench/results/ (or --out).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from bench.serve.serve_clients import CPU_WARN_FRACTION, LoadResult, run_load
from bench.serve.serve_hops import (
    cpu_fractions,
    cpu_seconds,
    engine_counts,
    histogram_breakdown,
    print_hops,
    scrape,
    span_breakdown,
    step_breakdown,
)

#: Engine settings a flag changes on both sides (the workers' env, the offline engine's options):
#: flag -> (EngineArgs / worker setting, its value with the flag, help).
ENGINE_FLAGS = {
    "decode_graphs_only": ("execution_mode", "decode",
                           "prompt and mixed steps eager (workers and offline engine: execution_mode decode)"),
    "one_attention_kernel": ("mixed_step_decode_kernel", False,
                             "mixed steps attend every row with the prefill kernel (mixed_step_decode_kernel off)"),
    "no_graph_sampling": ("graph_sampling", False,
                          "graphs end at the hidden states; the sampler runs every step (graph_sampling off)"),
    "piecewise_graphs": ("execution_mode", "piecewise",
                         "prompt and mixed steps as piecewise graphs, attention eager (execution_mode piecewise)"),
}

TOPICS = ["the sea", "volcanoes", "a lighthouse", "bread baking", "the moon", "trains", "bees", "chess"]
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def conversations(num: int, offset: int = 0) -> list[list[dict]]:
    """Deterministic short chat prompts (~30 tokens with the template), varied."""
    return [[{"role": "user", "content": f"Tell me {i % 3 + 2} things about {TOPICS[i % len(TOPICS)]}, part {i}."}]
            for i in range(offset, offset + num)]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))] if ordered else float("nan")


def requests_per_point(args, concurrency: int) -> int:
    """--num-requests, else --rounds per stream (at least 16)."""
    return args.num_requests or max(args.rounds * concurrency, 16)


def service_point(args, stack, base_url: list[str], model: str, concurrency: int) -> dict:
    """One concurrency point through the service: client metrics, client CPU, hop breakdowns."""
    num_requests = requests_per_point(args, concurrency)
    # 8 clients a process by default, at most 3/4 of the cores (the services need the rest: ~3.5 cores at c=256
    # on the H200 host; with half, 8 processes of 32 streams each reached 70-81% of a core there).
    procs = args.client_procs or max(1, min(math.ceil(concurrency / 8), (os.cpu_count() or 2) * 3 // 4))
    # Warm-up at this concurrency: the first steps of a new batch width compile kernels and capture graphs
    # (a stall of up to ~1 s seen at 64 on an H200), which must not land in the measured window.
    run_load(base_url, model, conversations(concurrency, 10_000), concurrency, 8, procs, args.client)
    ports = {name: info.internal_port for name, info in stack.services.items() if info.internal_port} if stack else {}
    pids = {name: info.pid for name, info in stack.services.items() if info.pid} if stack else {}
    before, cpu_before = (scrape(ports) if ports else {}), cpu_seconds(pids)
    steps_before = engine_counts(ports) if ports else {}
    print(f"concurrency {concurrency}: measured load starts ({num_requests} requests)", flush=True)
    since_ns = time.time_ns()
    load = run_load(base_url, model, conversations(num_requests), concurrency, args.max_tokens, procs, args.client,
                    temperature=args.temperature)
    until_ns = time.time_ns()
    point = summarize(load, concurrency, procs)
    point["service_cpu"] = cpu_fractions(cpu_before, cpu_seconds(pids), (until_ns - since_ns) / 1e9)
    point["hops"] = histogram_breakdown(before, scrape(ports)) if ports else []
    point["engine_steps"] = step_breakdown(steps_before, engine_counts(ports), load.wall_s) if ports else {}
    if args.trace and stack is not None:
        from deepinfer.telemetry.trace_file import read_spans

        time.sleep(1.0)  # the batch span processors export every 0.2 s
        point["spans"] = span_breakdown(read_spans(stack.trace_dir), since_ns, until_ns)
    return point


def summarize(load: LoadResult, concurrency: int, procs: int) -> dict:
    """Client-side metrics of one point."""
    results = load.requests
    ttft = [r.ttft_s * 1000 for r in results]
    itl = [g * 1000 for r in results for g in r.gaps_s]
    tpot = [(r.e2e_s - r.ttft_s) * 1000 / (r.num_tokens - 1) for r in results if r.num_tokens > 1]
    tokens = sum(r.num_tokens for r in results)
    return {
        "concurrency": concurrency, "requests": len(results), "client_procs": procs,
        "client_cpu_max": round(load.max_cpu_fraction, 3), "service_output_tok_s": round(tokens / load.wall_s, 1),
        "ttft_ms_p50": round(percentile(ttft, 50), 1), "ttft_ms_p99": round(percentile(ttft, 99), 1),
        "itl_ms_p50": round(percentile(itl, 50), 2), "itl_ms_p99": round(percentile(itl, 99), 2),
        "tpot_ms_mean": round(statistics.fmean(tpot), 2) if tpot else None,
        "ttft_ms_mean": round(statistics.fmean(ttft), 1), "ttft_ms_max": round(max(ttft), 1),
        # a client's time outside any request, per request: the window's stream-seconds not inside a request's
        # send -> last byte (the client's own turn-around, and the start/end skew of its streams)
        "client_gap_ms_mean": round(1000 * (load.wall_s * concurrency - sum(r.e2e_s for r in results))
                                    / len(results), 2),
    }


def offline_point(args, model: str, concurrency: int, engine_options: dict, gc_freeze: bool = False) -> dict:
    """The offline engine on the same prompts, at most `concurrency` at a time; `gc_freeze`: the loaded engine's
    objects frozen out of the collector's walks for the measured window, as the workers freeze theirs."""
    import torch

    from deepinfer import LLM, SamplingParams

    if not torch.cuda.is_available():
        torch.set_num_threads(args.offline_threads)
    prompts = conversations(requests_per_point(args, concurrency))
    llm = LLM(model, progress=False, max_num_seqs=concurrency, **engine_options)
    try:
        llm.chat(prompts[: min(len(prompts), 8)], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        if gc_freeze:
            gc.collect()
            gc.freeze()
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True)
        ttft = time_first_tokens(llm.engine)
        graphs = llm.engine.core.runner.graphs
        replays_before, steps_before = (graphs.num_replays if graphs else 0), ttft.steps
        started = time.perf_counter()
        outputs = llm.chat(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        steps = ttft.steps - steps_before
        graph_share = ((graphs.num_replays if graphs else 0) - replays_before) / max(1, steps)
    finally:
        gc.unfreeze()  # else the collect below cannot free the engine's KV cache
        llm.close()
        del llm
        gc.collect()  # the engine's reference cycles hold its KV cache until collected
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"offline_output_tok_s": round(tokens / seconds, 1), "offline_step_ms": round(seconds * 1000 /
            max(1, math.ceil(len(prompts) / concurrency) * args.max_tokens), 2),
            "offline_ttft_ms_p50": round(percentile(ttft, 50), 2), "offline_ttft_ms_p99": round(percentile(ttft, 99), 2),
            "offline_steps": steps, "offline_graph_share": round(graph_share, 3),
            "offline_mean_step_ms": round(seconds * 1000 / max(1, steps), 3),
            "offline_kinds": {kind: {"count": len(ms), "p50_ms": round(percentile(ms, 50), 3),
                                     "p99_ms": round(percentile(ms, 99), 3)}
                              for kind, ms in sorted(ttft.step_ms.items()) if kind != "empty"}}


class FirstTokens(list):
    """Offline TTFT per request (ms); `steps`: the engine steps taken since `time_first_tokens`; `step_ms`: each
    step's wall ms by kind (`EngineCore.last_step_kind`, as the workers' step-time histogram)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.step_ms: dict[str, list[float]] = {}


def time_first_tokens(engine) -> FirstTokens:
    """Offline TTFT per request (ms), filled as `engine` steps: from the step that first schedules the request
    (a free slot: where a closed-loop client's request would arrive) to its first token on the host."""
    ttft_ms = FirstTokens()
    seen: set[str] = set()
    step = engine.step

    def timed_step():
        started = time.monotonic()
        outputs = step()
        ttft_ms.steps += 1
        now = time.monotonic()
        ttft_ms.step_ms.setdefault(engine.last_step_kind, []).append((now - started) * 1000)
        for out in outputs:
            if out.new_token_ids and out.first_scheduled_time is not None and out.request_id not in seen:
                seen.add(out.request_id)
                ttft_ms.append((now - out.first_scheduled_time) * 1000)
        return outputs

    engine.step = timed_step
    return ttft_ms


def start_stack(args, model: str):
    """The whole stack on `model` (dummy weights for a random model), ready; with --trace, the file exporter."""
    from deepinfer.up import Stack

    env = {"DEEPINFER_GATEWAY_API_KEYS": ""}
    if args.random_model:
        env |= {"DEEPINFER_PREFILL_LOAD_FORMAT": "dummy", "DEEPINFER_DECODE_LOAD_FORMAT": "dummy"}
    if args.trace:
        env |= {"DEEPINFER_OTEL_EXPORTER": "file", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    env |= {f"DEEPINFER_{role}_{name.upper()}": str(value).lower() for name, value in engine_options(args).items()
            for role in ("PREFILL", "DECODE")}
    env |= dict(item.split("=", 1) for item in args.env)
    stack = Stack(model=model, device=args.device, port=0, env_overrides=env, start_timeout_s=900, log_dir=args.log_dir,
                  num_gateways=args.gateways, num_prefill=args.prefill, num_decode=args.decode,
                  **({"num_schedulers": args.schedulers} if args.schedulers else {}))
    stack.start()
    stack.wait_ready()
    return stack, [stack.base_url]


def engine_options(args) -> dict[str, bool]:
    """The engine settings the command line's ENGINE_FLAGS change."""
    return {name: value for flag, (name, value, _) in ENGINE_FLAGS.items() if getattr(args, flag)}


def default_num_gateways() -> int:
    """What the stack starts when --gateways is not given."""
    from deepinfer.up.stack import default_num_gateways as default

    return default()


def main() -> None:
    """Service side for every point, then the offline side for every point; tables, JSON line, JSON file."""
    args = parse_args()
    model = args.model
    if args.random_model:
        from deepinfer.testing.random_model import write_random_model

        model = str(write_random_model(args.random_model, args.cache_dir))
    sweep = [int(c) for c in args.sweep.split(",")]
    stack, urls = (None, [args.base_url]) if args.base_url else start_stack(args, model)
    points = []
    try:
        base_url = urls
        served = stack.model_name if stack else model
        points = [service_point(args, stack, base_url, served, c) for c in sweep]
        share = stack.devices.get("decode-0") if stack else None
        num_prefill = stack.num_prefill if stack else args.prefill
    finally:
        if stack is not None:
            stack.stop()
    if not args.no_offline:
        options = ({"load_format": "dummy"} if args.random_model else {}) | engine_options(args)
        if share is not None and share.device.startswith("cuda"):
            options["device"] = share.device
            if share.gpu_memory_utilization:
                options["gpu_memory_utilization"] = share.gpu_memory_utilization
        for point in points:
            try:
                point |= offline_point(args, model, point["concurrency"], options)
            except Exception as exc:  # keep the service side of the run; say why the offline side is missing
                print(f"offline at concurrency {point['concurrency']} failed: {exc!r}", file=sys.stderr)
                point["offline_error"] = repr(exc)
                continue
            point["service_over_offline"] = round(point["service_output_tok_s"] / point["offline_output_tok_s"], 3)
    report(args, points, num_prefill)


def report(args, points: list[dict], num_prefill: int | None) -> None:
    """Tables, the JSON line, and the JSON file."""
    print(f"\nservice vs offline: {args.random_model or args.model}, {args.max_tokens} output tokens, "
          f"temperature {args.temperature:g}, client {args.client}, device {args.device}, "
          f"engine {engine_options(args) or 'defaults'}")
    header = ["conc", "procs", "cpu max", "service tok/s", "offline tok/s", "ratio", "TTFT p50", "TTFT p99",
              "off TTFT p50", "ITL p50", "ITL p99", "TPOT", "off step"]
    print("".join(f"{h:>14}" for h in header))
    for p in points:
        row = [p["concurrency"], p["client_procs"], f"{p['client_cpu_max']:.0%}", p["service_output_tok_s"],
               p.get("offline_output_tok_s", "-"), p.get("service_over_offline", "-"), p["ttft_ms_p50"],
               p["ttft_ms_p99"], p.get("offline_ttft_ms_p50", "-"), p["itl_ms_p50"], p["itl_ms_p99"],
               p["tpot_ms_mean"], p.get("offline_step_ms", "-")]
        print("".join(f"{str(v):>14}" for v in row))
    for p in points:
        if p["client_cpu_max"] > CPU_WARN_FRACTION:
            print(f"WARNING: a client process used {p['client_cpu_max']:.0%} of a core at concurrency "
                  f"{p['concurrency']}: raise --client-procs", file=sys.stderr)
        print(f"\nconcurrency {p['concurrency']}: CPU per service (1.0 = a core): "
              + ", ".join(f"{name} {share:.2f}" for name, share in p.get("service_cpu", {}).items()))
        for name, row in p.get("engine_steps", {}).items():
            print(f"  {name}: {row['steps']} steps, {row['graph_share']:.0%} CUDA-graph replays, "
                  f"{row['step_ms']:.2f} ms a step (wall / steps); {kinds_text(row.get('kinds', {}))}")
        if "offline_steps" in p:
            print(f"  offline: {p['offline_steps']} steps, {p['offline_graph_share']:.0%} CUDA-graph replays, "
                  f"{p['offline_mean_step_ms']:.2f} ms a step; {kinds_text(p.get('offline_kinds', {}))}")
        print_hops("hop (histograms)", p.get("hops", []))
        print_hops("hop (spans)", p.get("spans", []))
    result = {"bench": "serve", "model": args.random_model or args.model, "max_tokens": args.max_tokens,
              "client": args.client, "device": args.device, "trace": args.trace,
              "gateways": args.gateways or default_num_gateways(), "prefill": num_prefill, "decode": args.decode,
              "env": args.env, "temperature": args.temperature, "engine_options": engine_options(args),
              "points": points}
    save_result(result, args.out or RESULTS_DIR / f"serve-{args.random_model or 'default'}-"
                f"{time.strftime('%Y-%m-%d-%H%M')}.json")


def kinds_text(kinds: dict[str, dict]) -> str:
    """Steps by kind as printed: count and p50 / p99 ms of each."""
    return "by kind, count and p50 / p99 ms: " + ", ".join(
        f"{kind} {k['count']} {k['p50_ms']:.2f} / {k['p99_ms']:.2f}" for kind, k in kinds.items())


def save_result(result: dict, out: Path) -> None:
    """The JSON line on stdout, and the JSON file."""
    print(json.dumps(result))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"saved {out}")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --random-model, --cache-dir, --device: what the stack serves, on what."""
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--random-model", default=None, help="a random-weight shape: llama-1b, llama-8b")
    parser.add_argument("--cache-dir", type=Path, default=Path(".bench-models"), help="where --random-model is written")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--base-url", default=None, help="an already running stack (else one is started)")
    parser.add_argument("--sweep", default="1,4", help="comma-separated concurrencies (default 1,4)")
    parser.add_argument("--num-requests", type=int, default=0, help="per point (default: --rounds x concurrency, >= 16)")
    parser.add_argument("--rounds", type=int, default=4, help="requests per stream and point (default 4)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--client", default="httpx", choices=("httpx", "openai"))
    parser.add_argument("--client-procs", type=int, default=0, help="client processes (default: concurrency / 8, at most 3/4 of the cores)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the stack's services, e.g. DEEPINFER_DECODE_ASYNC_SCHEDULING=true")
    parser.add_argument("--prefill", type=int, default=None,
                        help="prefill workers (0: decode workers take both roles; default: deepinfer up's)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument("--gateways", type=int, default=None,
                        help="gateway processes on the API port (default: deepinfer up's, one per 4 cores)")
    parser.add_argument("--schedulers", type=int, default=None, help="scheduler processes (default: deepinfer up's)")
    parser.add_argument("--trace", action="store_true", help="file span exporter on every service; span breakdown")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the services' logs here (default: removed)")
    parser.add_argument("--no-offline", action="store_true")
    for flag, (_, _, text) in ENGINE_FLAGS.items():
        parser.add_argument(f"--{flag.replace('_', '-')}", action="store_true", help=text)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of every request, both sides (default 0: greedy)")
    parser.add_argument("--offline-threads", type=int, default=1,
                        help="torch threads offline on the CPU (default 1: what each worker gets on 2 cores)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: bench/results/serve-*.json)")
    args = parser.parse_args()
    if args.out is None and os.environ.get("OUT"):
        args.out = Path(os.environ["OUT"]) / "serve.json"
    return args


if __name__ == "__main__":
    main()
