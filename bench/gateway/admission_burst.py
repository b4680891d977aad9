"""Where a decode admission's time goes when a wave of requests arrives at once, on this CPU.

    PYTHONPATH=shared:. python bench/gateway/admission_burst.py [--burst 64] [--running 64] [--bursts 6] [--repeats 3]
        [--fake-step HOST_US DEVICE_US] [--device-us-per-token US] [--prompt-len 35] [--sync] [--kvstore]
        [--shared-prefix N] [--distinct-prompts] [--out FILE] [--profile FILE]

The real decode side (`DecodeHandler`: NATS subscription, EngineLoop, scheduler, token batches, heartbeats) on a
tiny random llama and a real nats-server on a free port. The model is replaced by a GPU-shaped runner: each step
HOST_US of Python holding the GIL (in slices that release it, as torch calls do) to launch, then the device runs
DEVICE_US (+ US per prefill token) without the GIL, one step after another on one device timeline; async
scheduling (the GPU default) overlaps the next step's launch with it unless --sync. With `--kvstore` the worker
uses a real kvcache shard process (as `deepinfer up` starts one): every admission asks the store about its prompt's
blocks (`StoreTier`), and the prompts' blocks are written behind; `--shared-prefix N` makes each burst's prompts
start with the same N tokens, which the first burst writes behind and the later bursts' requests then find there.

`--running` requests decode throughout; a client process then sends `--burst` DecodeRequests over NATS at once
(as a gateway does at a closed-loop wave), `--bursts` times. Per request, in ms (one monotonic clock, both
processes), the admission (the `decode.admission` hop: received → reply sent) and what follows:

    nats_in     client send → handler called (NATS, the subscription's one-at-a-time dispatch)
    task        handler called → admission task running
    to_queue    → engine command queued (sampling checks, stream)
    queue_wait  → the command runs on the engine thread (it waits for the step in progress)
    settle      → its future resolved on the event loop
    resume      → the admission task resumed
    reply       → reply published
    admission   handler called → reply published (decode.admission)
    to_schedule engine command ran → first scheduled in a step
    to_sample   first scheduled → first token on the host (the step's outputs)
    to_loop     → the event loop took those outputs
    to_client   → its first TokenBatch received by the client
    to_engine   client send → engine command ran (what the first token waits for)
    client_reply  client send → reply received (the gateway's decode_admission hop)
    ttft        client send → first TokenBatch received

Also: how many schedule() calls it took from the command to the step that samples the request's first token (1:
no extra step), the event loop's CPU per admission beyond the running batch's own, and the engine thread's CPU
and wall time running commands per admission (wall above CPU: waits for the GIL). Prints a table (p50 / p99 over
every request of every burst, median over repeats) and one JSON line. The decode-side stand-ins and wrappers
are in bench/gateway/admission_probe.py.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gateway.admission_probe import FakeDevice, Probe
from bench.results_io import emit_json_line

GATEWAY = "gw-burst"
GIL_SWITCH_INTERVAL_S = 0.0005
STORE_SECRET = "burst-" + "s" * 26
MAX_MODEL_LEN = 4096
BURST_MAX_TOKENS = 16
SEGMENTS = (("nats_in", "sent", "received"), ("task", "received", "started"), ("to_queue", "started", "queued"),
            ("queue_wait", "queued", "run"), ("settle", "run", "settled"), ("resume", "settled", "resumed"),
            ("reply", "resumed", "replied"), ("admission", "received", "replied"),
            ("to_schedule", "run", "scheduled"), ("to_sample", "scheduled", "sampled"), ("to_loop", "sampled", "looped"),
            ("to_client", "looped", "first_token"), ("to_engine", "sent", "run"), ("client_reply", "sent", "client_reply"),
            ("ttft", "sent", "first_token"))


async def measure(server, model_dir: Path, args, data_dir: Path) -> dict:
    """One run: `args.running` requests decode while `args.bursts` bursts of `args.burst` arrive."""
    from deepinfer import subjects
    from deepinfer.bus import Bus
    from deepinfer.config import CommonSettings, DecodeSettings
    from deepinfer.protocol import DecodeRequest, WireSamplingParams
    from deepinfer.service import ServiceContext
    from deepinfer.telemetry import new_registry
    from deepinfer.telemetry.tracing import setup_tracing
    from services.decode.handler import DecodeHandler

    common = CommonSettings(nats_url=server.url, nats_token=server.token, model=str(model_dir),
                            model_cache_dir=model_dir.parent, data_plane_secret=STORE_SECRET)
    settings = DecodeSettings(common=common, worker_id="decode-burst", internal_port=0, kv_store=args.kvstore,
                              max_num_seqs=256, kv_cache_bytes=512 << 20, async_scheduling=not args.sync)
    bus = await Bus.connect(server.url, name="decode-burst", token=server.token)
    shard = _start_shard(server, data_dir) if args.kvstore else None
    handler = DecodeHandler(ServiceContext("decode", settings, bus, new_registry(),
                                           setup_tracing(settings.common, "decode")))
    probe = Probe()
    probe.install(handler)
    model = handler.runtime.model
    client = subprocess.Popen([sys.executable, __file__, "--client", server.url, server.token,
                               subjects.decode(model, "decode-burst"), subjects.tokens(model, GATEWAY)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None and client.stdin is not None
        assert client.stdout.readline().strip() == "ready"
        await handler.load()
        if shard is not None:
            await _wait_for_shard(handler, shard)
        fake = FakeDevice(args.fake_step[0] / 1e6, args.fake_step[1] / 1e6, args.device_us_per_token / 1e6)
        core = handler.runtime.engine.core
        core.runner.execute, core.runner.execute_async = fake.execute, fake.execute_async
        probe.install_engine(handler)
        await handler.start()
        running = [DecodeRequest(request_id=f"bg{i}", gateway_id="gw-background",
                                 prompt_token_ids=_prompt(10_000 + i, args.prompt_len, 0, args.distinct_prompts),
                                 sampling=WireSamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - 2 * args.prompt_len,
                                                         ignore_eos=True))
                   for i in range(args.running)]
        accepted = await asyncio.gather(*(handler.decode(r) for r in running))
        assert all(a.error is None for a in accepted)
        await asyncio.sleep(0.3)  # their prompts are in; the batch decodes
        quiet_cpu_s, quiet_s = await _loop_cpu(asyncio.sleep(0.5))  # the running batch's own loop work
        client_times: dict[str, dict[str, float]] = {}
        loop_cpu_s, bursts_s, engine_cpu_s, engine_wall_s = 0.0, 0.0, 0.0, 0.0
        profiler = cProfile.Profile() if args.profile is not None else None
        if profiler is not None:
            profiler.enable()  # this thread only: the event loop's work
        for burst in range(args.bursts):
            command = {"burst": burst, "n": args.burst, "prompt_len": args.prompt_len, "gateway": GATEWAY,
                       "shared_prefix": args.shared_prefix, "distinct": args.distinct_prompts}
            client.stdin.write(json.dumps(command) + "\n")
            client.stdin.flush()
            probe.command_cpu_s = probe.command_wall_s = 0.0
            (line, cpu_s, wall_s) = await _loop_cpu(_read_line(client.stdout))
            loop_cpu_s, bursts_s = loop_cpu_s + cpu_s, bursts_s + wall_s
            engine_cpu_s, engine_wall_s = engine_cpu_s + probe.command_cpu_s, engine_wall_s + probe.command_wall_s
            client_times.update(json.loads(line))
            await asyncio.sleep(0.1)
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
    finally:
        await handler.close()
        await bus.close()
        if client.stdin is not None:
            client.stdin.close()
        client.wait(10)
        if shard is not None:
            shard.terminate()
            shard.wait(10)
    result = _segments(probe, client_times)
    if handler.runtime.store is not None:
        result["store_lookups"] = {
            outcome: handler.ctx.registry.get_sample_value("deepinfer_worker_store_lookups_total",
                                                           {"result": outcome}) or 0.0
            for outcome in ("hit", "miss", "error")}
        # Lookups sent (one per request before they were coalesced: no such counter then).
        result["store_lookups"]["round_trips"] = handler.ctx.registry.get_sample_value(
            "deepinfer_worker_store_lookup_round_trips_total")
    num_admitted = args.bursts * args.burst
    # The loop's CPU beyond the running batch's (the quiet rate over the same time), per admission.
    result["loop_cpu_us_per_admission"] = 1e6 * (loop_cpu_s - quiet_cpu_s / quiet_s * bursts_s) / num_admitted
    result["engine_command_cpu_us_per_admission"] = 1e6 * engine_cpu_s / num_admitted
    result["engine_command_wall_us_per_admission"] = 1e6 * engine_wall_s / num_admitted
    return result


def _start_shard(server, data_dir: Path) -> subprocess.Popen:
    """A kvcache shard process (the service as `deepinfer up` runs it), its data under data_dir."""
    env = {**os.environ, "DEEPINFER_NATS_URL": server.url, "DEEPINFER_NATS_TOKEN": server.token,
           "DEEPINFER_DATA_PLANE_SECRET": STORE_SECRET, "DEEPINFER_DATA_DIR": str(data_dir),
           "DEEPINFER_KVCACHE_INTERNAL_PORT": "0", "DEEPINFER_KVCACHE_DATA_PLANE_PORT": "0",
           "DEEPINFER_KVCACHE_SHARD": "burst", "DEEPINFER_LOG_FORMAT": "text"}
    return subprocess.Popen([sys.executable, "-m", "services.kvcache"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


async def _wait_for_shard(handler, shard: subprocess.Popen) -> None:
    store = handler.runtime.store
    assert store is not None, "kv_store on but the worker has no store tier"
    for _ in range(600):
        if store.client.has_shards():
            return
        if shard.poll() is not None:
            raise RuntimeError(f"the kvcache shard exited ({shard.returncode})")
        await asyncio.sleep(0.05)
    raise RuntimeError("no heartbeat from the kvcache shard in 30 s")


async def _read_line(stream) -> str:
    return await asyncio.to_thread(stream.readline)


async def _loop_cpu(awaitable):
    """(result,) + this thread's CPU seconds and the wall seconds while awaiting it; (cpu, wall) for None."""
    cpu_s, wall_s = time.thread_time(), time.monotonic()
    result = await awaitable
    cpu_s, wall_s = time.thread_time() - cpu_s, time.monotonic() - wall_s
    return (cpu_s, wall_s) if result is None else (result, cpu_s, wall_s)


def _prompt(seed: int, length: int, shared_prefix: int = 0, distinct: bool = False) -> list[int]:
    """A prompt per seed. By default an arithmetic run whose offset repeats (about 40 distinct ones, so most
    prompts' first blocks are in the prefix cache already); `distinct`: random tokens, no block shared."""
    prefix = [(11 * k + 5) % 300 + 3 for k in range(min(shared_prefix, length))]
    if distinct:
        rng = random.Random(seed)
        return prefix + [rng.randrange(3, 303) for _ in range(len(prefix), length)]
    return prefix + [(7 * seed + 13 * k + seed // 7) % 300 + 3 for k in range(len(prefix), length)]


def _segments(probe: Probe, client_times: dict[str, dict[str, float]]) -> dict:
    """ms per segment: every request's value, and how many schedule() calls its admission took."""
    values: dict[str, list[float]] = {name: [] for name, _, _ in SEGMENTS}
    steps_to_schedule: list[int] = []
    for request_id, sent in client_times.items():
        points = {**probe.times.get(request_id, {}), **sent}
        for name, start, end in SEGMENTS:
            if start in points and end in points:
                values[name].append(1e3 * (points[end] - points[start]))
        if len(probe.steps.get(request_id, ())) == 2:  # schedule() calls until the step that samples it
            steps_to_schedule.append(probe.steps[request_id][1] - probe.steps[request_id][0])
    return {"values": values, "num_requests": len(client_times),
            "first_schedule_steps": statistics.mean(steps_to_schedule) if steps_to_schedule else None}


def summarize(runs: list[dict]) -> dict:
    """p50 / p99 per segment: each run's, then the median over runs."""
    out = {}
    for name, _, _ in SEGMENTS:
        per_run = [r["values"][name] for r in runs if r["values"][name]]
        if not per_run:
            continue
        out[name] = {"p50": round(statistics.median(_pct(v, 50) for v in per_run), 3),
                     "p99": round(statistics.median(_pct(v, 99) for v in per_run), 3)}
    return out


def _pct(values: list[float], pct: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def client(url: str, token: str, decode_subject: str, tokens_subject: str) -> None:
    """Client process: per command line on stdin, send a burst at once; print per-request times (JSON)."""
    import nats

    from deepinfer.protocol import DecodeRequest, TokenBatch, WireSamplingParams

    async def main() -> None:
        nc = await nats.connect(url, token=token)
        times: dict[str, dict[str, float]] = {}
        done: dict[str, asyncio.Future] = {}

        async def on_tokens(msg) -> None:
            now_s = time.monotonic()
            for chunk in TokenBatch.from_bytes(msg.data).chunks:
                times.get(chunk.request_id, {}).setdefault("first_token", now_s)
                future = done.get(chunk.request_id)
                if chunk.finish_reason is not None and future is not None and not future.done():
                    future.set_result(None)

        await nc.subscribe(tokens_subject, cb=on_tokens)
        await nc.flush()
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        while line := await asyncio.to_thread(sys.stdin.readline):
            command = json.loads(line)
            times.clear()
            done.clear()
            burst = command["burst"]
            requests = {f"b{burst}-{i}": DecodeRequest(
                request_id=f"b{burst}-{i}", gateway_id=command["gateway"],
                prompt_token_ids=_prompt(1000 * burst + i, command["prompt_len"], command["shared_prefix"],
                                         command["distinct"]),
                sampling=WireSamplingParams(temperature=0, max_tokens=BURST_MAX_TOKENS, ignore_eos=True)).to_bytes()
                for i in range(command["n"])}

            async def send(request_id: str, payload: bytes) -> None:
                times[request_id] = {"sent": time.monotonic()}
                done[request_id] = loop.create_future()
                await nc.request(decode_subject, payload, timeout=30)
                times[request_id]["client_reply"] = time.monotonic()

            await asyncio.gather(*(send(r, p) for r, p in requests.items()))
            await asyncio.wait_for(asyncio.gather(*done.values()), 30)
            print(json.dumps(times), flush=True)
        await nc.close()

    asyncio.run(main())


def run(args) -> dict:
    import torch

    from deepinfer.nats_server import NatsServer
    from deepinfer.testing.checkpoints import make_tiny_checkpoint

    torch.set_num_threads(1)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    with tempfile.TemporaryDirectory(prefix="admission-burst-") as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp) / "llama", "llama", max_position_embeddings=MAX_MODEL_LEN)
        server = NatsServer()
        server.start()
        try:  # a fresh store per run: what one run wrote behind is not there for the next
            runs = [asyncio.run(measure(server, model_dir, args, Path(tmp) / f"data-{i}"))
                    for i in range(args.repeats)]
        finally:
            server.close()
    return {"bench": "admission_burst", "model": "tiny-llama (fake GPU-shaped runner)", "device": "cpu",
            "burst": args.burst, "running": args.running, "bursts": args.bursts, "repeats": args.repeats,
            "prompt_len": args.prompt_len, "fake_step_us": args.fake_step,
            "device_us_per_token": args.device_us_per_token, "async_scheduling": not args.sync,
            "kvstore": args.kvstore, "shared_prefix": args.shared_prefix, "distinct_prompts": args.distinct_prompts,
            **({"store_lookups": [r["store_lookups"] for r in runs]} if args.kvstore else {}),
            "first_schedule_steps": statistics.median(r["first_schedule_steps"] for r in runs),
            "loop_cpu_us_per_admission": round(statistics.median(r["loop_cpu_us_per_admission"] for r in runs), 1),
            **{key: round(statistics.median(r[key] for r in runs), 1)
               for key in ("engine_command_cpu_us_per_admission", "engine_command_wall_us_per_admission")},
            "segments_ms": summarize(runs)}


def print_table(result: dict) -> None:
    print(f"decode admission of a burst of {result['burst']} beside {result['running']} running "
          f"(fake step {result['fake_step_us']} µs + {result['device_us_per_token']} µs/prefill token, "
          f"async={result['async_scheduling']}); ms, median over {result['repeats']} runs of {result['bursts']} "
          f"bursts; schedule() calls from admission to its first sampling step: {result['first_schedule_steps']:.2f}")
    print(f"event-loop CPU per admission (beyond the running batch's): {result['loop_cpu_us_per_admission']} µs; "
          f"engine thread running commands, per admission: {result['engine_command_cpu_us_per_admission']} µs CPU, "
          f"{result['engine_command_wall_us_per_admission']} µs wall")
    print(f"{'segment':<12} {'p50':>8} {'p99':>8}")
    for name, value in result["segments_ms"].items():
        print(f"{name:<12} {value['p50']:>8.2f} {value['p99']:>8.2f}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client(*sys.argv[2:6])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=35)
    parser.add_argument("--fake-step", type=float, nargs=2, metavar=("HOST_US", "DEVICE_US"), default=[300, 3000])
    parser.add_argument("--device-us-per-token", type=float, default=3.0,
                        help="device time per prefill token in a step (llama-1b on a H200: a few µs)")
    parser.add_argument("--sync", action="store_true", help="synchronous scheduling (default: async, as on a GPU)")
    parser.add_argument("--kvstore", action="store_true", help="the worker on a real kvcache shard process")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                        help="every burst's prompts start with the same N tokens")
    parser.add_argument("--distinct-prompts", action="store_true",
                        help="random prompts (no block in common) instead of the default's ~40 repeating ones")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile", type=Path, help="cProfile the event loop thread during the bursts (to FILE)")
    args = parser.parse_args()
    result = run(args)
    print_table(result)
    emit_json_line(result, args.out)


if __name__ == "__main__":
    main()
