"""Where a block written behind to the kvcache store costs a decode worker, per block, on this CPU.

    PYTHONPATH=shared:. python bench/kv/write_behind_cost.py [--steps 300] [--repeats 3] [--fake-step 300 2200]
        [--concurrency 64] [--shard-nice N] [--out FILE]

A real `DecodeHandler` (EngineLoop, StoreTier, host tier on through `kv_host_cache_bytes`), a real nats-server on a
free port, a real kvcache shard process (`services.kvcache`) and a subscriber process draining the token subject.
The model is a tiny random llama whose KV has llama-1b's block bytes (8 layers x 8 KV heads x 64 in float32 = 16
layers in bf16: 512 KiB a block of 16 tokens); its forward is replaced by a GPU-shaped step (bench/serve/loop_cost.py's
FakeStep: HOST_US of Python holding the GIL, then DEVICE_US waiting without it). The scheduler, the prefix cache,
the host tier and write-behind all run for real: at concurrency 64 each step completes 4 blocks of generated
tokens.

Each repeat runs the same window of `--steps` steps (every request running) twice, interleaved: `off`
(kv_store_write_generated false: nothing is written in the window) and `on` (true: every completed block is written
behind). Per block written in the window:

    engine   the engine thread's time in the commands it runs between steps (in the window only write-behind's
             export: before this change a copy of each payload, now pins of host slots), wall and thread CPU;
    loop     the event loop thread's CPU in the window, on minus off (has, put encode and send, metrics);
    process  the worker process's CPU in the window (every thread: engine, loop, writer threads), on minus off;
    kvcache  the shard process's CPU in the window, on minus off.

And per run: the step period (p50 / p99: the inter-token latency of every request), the blocks written and dropped.
On a small VM the shard process competes with the worker for the cores (a GPU host has cores to spare for it):
`--shard-nice 19` runs it at the lowest priority, so the step period shows the worker's own costs.
Prints a table and one JSON line (saved with --out).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results_io import emit_json_line
from bench.serve.loop_cost import GIL_SWITCH_INTERVAL_S
from bench.serve.serve_hops import cpu_seconds
from bench.serve.step_clock import StepClock

ROOT = Path(__file__).resolve().parents[2]

SECRET = "w" * 32
SHARD = "wb0"
GATEWAY = "gw-wb"
BLOCK_SIZE = 16
PROMPT_LEN = 30
WARMUP_STEPS = 20
#: llama-1b's KV bytes a block (16 layers x 8 heads x 64 x bf16 x K,V x 16 tokens), as 8 layers in float32.
MODEL_SHAPE = {"hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
               "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 4096}


class FakeRunner:
    """Stands for `runner.execute`: a GPU-shaped step (host_s of GIL-holding Python in slices, device_s waiting
    without the GIL), then one token for each request that samples."""

    def __init__(self, host_s: float, device_s: float) -> None:
        self.host_s, self.device_s = host_s, device_s

    def execute(self, output, requests):
        from bench.serve.step_clock import host_work
        from deepinfer.engine.outputs import SampledToken

        host_work(self.host_s)
        time.sleep(self.device_s)
        return {s.request_id: SampledToken(3 + (s.num_computed_tokens * 31 + len(s.request_id)) % 300, 0.0)
                for s in output.scheduled if s.sample}


class CommandClock:
    """EngineLoop.on_commands: wall and thread-CPU seconds of each batch of commands, by step index."""

    def __init__(self, engine, clock: StepClock) -> None:
        self.spans: list[tuple[int, float, float]] = []

        def timed(num_commands: int, wall_s: float, cpu_s: float) -> None:
            self.spans.append((len(clock.starts), wall_s, cpu_s))

        engine.on_commands = timed

    def window(self, first: int, last: int) -> tuple[float, float]:
        spans = [(w, c) for step, w, c in self.spans if first <= step < last]
        return sum(w for w, _ in spans), sum(c for _, c in spans)


def _requests(run: int, concurrency: int, max_tokens: int):
    """The run's requests: a first token of its own, so no block of another run's is held by the store already."""
    from deepinfer.protocol import DecodeRequest, WireSamplingParams

    return [DecodeRequest(request_id=f"r{run}-{i}", gateway_id=GATEWAY,
                          prompt_token_ids=[301 + run, *((7 * i + 13 * k) % 300 + 3 for k in range(PROMPT_LEN - 1))],
                          sampling=WireSamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, seed=i))
            for i in range(concurrency)]


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _metric(handler, name: str, **labels) -> float:
    return handler.ctx.registry.get_sample_value(f"deepinfer_{name}", labels) or 0.0


async def measure(server, shard_pid: int, model_dir: Path, cache_dir: Path, run: int, write_generated: bool,
                  concurrency: int, steps: int, fake_s: tuple[float, float]) -> dict:
    """One window of `steps` decode steps with write-behind of generated blocks on or off."""
    from opentelemetry.trace import NoOpTracer

    from deepinfer import subjects
    from deepinfer.bus import Bus
    from deepinfer.config import CommonSettings, DecodeSettings
    from deepinfer.service import ServiceContext
    from deepinfer.telemetry import new_registry
    from services.decode.handler import DecodeHandler

    first = WARMUP_STEPS + concurrency // 4
    max_tokens = first + steps + 10
    tokens = PROMPT_LEN + max_tokens + BLOCK_SIZE
    block_bytes = 2 * BLOCK_SIZE * MODEL_SHAPE["num_key_value_heads"] * MODEL_SHAPE["head_dim"] * 4 \
        * MODEL_SHAPE["num_hidden_layers"]
    common = CommonSettings(nats_url=server.url, nats_token=server.token, model=str(model_dir),
                            data_plane_secret=SECRET, model_cache_dir=cache_dir)
    settings = DecodeSettings(common=common, worker_id=f"wb-{run}", internal_port=0, data_plane_port=0,
                              block_size=BLOCK_SIZE, max_num_seqs=concurrency, async_scheduling=False,
                              kv_cache_bytes=(concurrency * (tokens // BLOCK_SIZE + 1) + 2) * block_bytes,
                              kv_host_cache_bytes=1024 * block_bytes, kv_store_write_generated=write_generated,
                              kv_store_shard_lease_s=600)
    bus = await Bus.connect(server.url, name=f"wb-bench-{run}", token=server.token)
    handler = DecodeHandler(ServiceContext("decode", settings, bus, new_registry(), NoOpTracer()))
    subject = subjects.tokens(settings.common.model_token, GATEWAY)
    drain = subprocess.Popen([sys.executable, str(ROOT / "bench" / "serve" / "loop_cost.py"), "--drain", server.url,
                              server.token, subject], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": f"{ROOT / 'shared'}:{ROOT}"})
    try:
        assert drain.stdout is not None and drain.stdout.readline().strip() == "ready"
        await handler.load()
        await handler.start()
        store = handler.runtime.store
        for _ in range(200):
            if store.client.has_shards():
                break
            await asyncio.sleep(0.05)
        assert store.client.has_shards(), "the worker never saw the shard"
        core, loop = handler.runtime.engine.core, asyncio.get_running_loop()
        core.runner.execute = FakeRunner(*fake_s).execute
        clock = StepClock()
        clock.wrap(core)
        commands = CommandClock(handler.runtime.engine_loop, clock)
        start_mark, end_mark = clock.mark(loop, first), clock.mark(loop, first + steps)
        accepted = await asyncio.gather(*(handler.decode(r) for r in _requests(run, concurrency, max_tokens)))
        assert all(a.error is None for a in accepted), next(a.error for a in accepted if a.error)
        loop_start = await start_mark
        process_start = _process_cpu_s()
        shard_start, written_start = cpu_seconds({"s": shard_pid})["s"], _metric(handler, "worker_store_written_blocks_total")
        loop_end = await end_mark
        process_end = _process_cpu_s()
        shard_end, written_end = cpu_seconds({"s": shard_pid})["s"], _metric(handler, "worker_store_written_blocks_total")
        while len(clock.starts) <= first + steps:
            await asyncio.sleep(0.001)
        assert all(b == concurrency for b in clock.batches[first:first + steps]), "batch changed in the window"
        periods = [clock.starts[k + 1] - clock.starts[k] for k in range(first, first + steps)]
        engine_wall, engine_cpu = commands.window(first, first + steps)
        while handler.num_streams:
            await asyncio.sleep(0.02)
        await store.flush(30)
        dropped = {reason: _metric(handler, "worker_store_write_dropped_blocks_total", reason=reason)
                   for reason in ("queue_full", "evicted", "error")}
        result = {
            "write_generated": write_generated,
            "blocks_written": written_end - written_start,
            "blocks_written_total": _metric(handler, "worker_store_written_blocks_total"),
            "dropped": dropped,
            "engine_cmd_wall_us": 1e6 * engine_wall,
            "engine_cmd_cpu_us": 1e6 * engine_cpu,
            "loop_cpu_us": 1e6 * sum(e - s for s, e in zip(loop_start, loop_end, strict=True)),
            "process_cpu_us": 1e6 * (process_end - process_start),
            "shard_cpu_us": 1e6 * (shard_end - shard_start),
            "step_period_p50_us": 1e6 * statistics.median(periods),
            "step_period_p99_us": 1e6 * sorted(periods)[int(0.99 * len(periods))],
            "step_period_max_us": 1e6 * max(periods),
            "step_wall_us": clock.window(first, first + steps)["step_wall_us"],
        }
    finally:
        await handler.close()
        await bus.close()
        drain.stdin.close()
        drain.stdout.read()
        drain.wait(10)
    return result


async def start_shard(server, data_dir: Path, nice: int = 0) -> subprocess.Popen:
    """A real kvcache shard process; returns once it heartbeats."""
    from deepinfer import subjects
    from deepinfer.bus import Bus
    from deepinfer.protocol import KvStoreHeartbeat

    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'shared'}:{ROOT}", "DEEPINFER_NATS_URL": server.url,
           "DEEPINFER_NATS_TOKEN": server.token, "DEEPINFER_DATA_PLANE_SECRET": SECRET,
           "DEEPINFER_DATA_DIR": str(data_dir), "DEEPINFER_KVCACHE_INTERNAL_PORT": "0",
           "DEEPINFER_KVCACHE_DATA_PLANE_PORT": "0", "DEEPINFER_KVCACHE_SHARD": SHARD,
           "DEEPINFER_KVCACHE_RAM_BYTES": "1GiB", "DEEPINFER_KVCACHE_DISK_BYTES": "2GiB",
           "DEEPINFER_LOG_FORMAT": "text"}
    bus = await Bus.connect(server.url, name="wb-bench-beats", token=server.token)
    beats: asyncio.Queue[KvStoreHeartbeat] = asyncio.Queue()

    async def on_beat(beat: KvStoreHeartbeat, msg) -> None:
        beats.put_nowait(beat)

    sub = await bus.subscribe(subjects.kvcache_heartbeat(SHARD), on_beat, message_type=KvStoreHeartbeat)
    shard = subprocess.Popen([sys.executable, "-m", "services.kvcache"], env=env, cwd=ROOT,
                             stdout=(data_dir / "kvcache.log").open("ab"), stderr=subprocess.STDOUT,
                             preexec_fn=(lambda: os.nice(nice)) if nice else None)
    try:
        await asyncio.wait_for(beats.get(), 60)
    except TimeoutError:
        shard.kill()
        raise RuntimeError((data_dir / "kvcache.log").read_text()[-3000:]) from None
    finally:
        await sub.unsubscribe()
        await bus.close()
    return shard


def run(concurrency: int, steps: int, repeats: int, fake_s: tuple[float, float], shard_nice: int = 0) -> dict:
    import torch

    from deepinfer.nats_server import NatsServer
    from deepinfer.testing.checkpoints import make_tiny_checkpoint

    torch.set_num_threads(1)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="wb-cost-") as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp) / "llama", "llama", **MODEL_SHAPE)
        (Path(tmp) / "data").mkdir()
        server = NatsServer()
        server.start()
        shard = asyncio.run(start_shard(server, Path(tmp) / "data", shard_nice))
        try:
            index = 0
            for _ in range(repeats):
                for write_generated in (False, True):
                    index += 1
                    runs[write_generated].append(asyncio.run(measure(
                        server, shard.pid, model_dir, Path(tmp), index, write_generated, concurrency, steps, fake_s)))
        finally:
            shard.terminate()
            shard.wait(30)
            server.close()
    return {"bench": "write_behind_cost", "device": "cpu", "concurrency": concurrency, "steps": steps,
            "repeats": repeats, "fake_step_us": [round(1e6 * v) for v in fake_s], "block_bytes": 512 << 10,
            "shard_nice": shard_nice,
            "per_block": per_block(runs), "runs": {"off": runs[False], "on": runs[True]}}


def per_block(runs: dict[bool, list[dict]]) -> dict:
    """Medians over the repeats; each `on` run against the `off` run of its repeat."""
    rows = []
    for off, on in zip(runs[False], runs[True], strict=True):
        blocks = max(on["blocks_written"], 1)
        rows.append({
            "blocks_written": on["blocks_written"],
            "engine_wall_us": on["engine_cmd_wall_us"] / blocks,
            "engine_cpu_us": on["engine_cmd_cpu_us"] / blocks,
            "loop_cpu_us": (on["loop_cpu_us"] - off["loop_cpu_us"]) / blocks,
            "process_cpu_us": (on["process_cpu_us"] - off["process_cpu_us"]) / blocks,
            "shard_cpu_us": (on["shard_cpu_us"] - off["shard_cpu_us"]) / blocks,
            "step_p50_us_off": off["step_period_p50_us"], "step_p50_us_on": on["step_period_p50_us"],
            "step_p99_us_off": off["step_period_p99_us"], "step_p99_us_on": on["step_period_p99_us"],
        })
    return {key: round(statistics.median(r[key] for r in rows), 1) for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fake-step", type=float, nargs=2, default=[300.0, 2200.0], metavar=("HOST_US", "DEVICE_US"))
    parser.add_argument("--shard-nice", type=int, default=0, help="the shard process's niceness (0-19)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = run(args.concurrency, args.steps, args.repeats, (args.fake_step[0] / 1e6, args.fake_step[1] / 1e6),
                 args.shard_nice)
    p = result["per_block"]
    print(f"per block written behind (median of {args.repeats}; c={args.concurrency}, fake step "
          f"{result['fake_step_us'][0]}+{result['fake_step_us'][1]} µs, {args.steps} steps):")
    for key, value in p.items():
        print(f"  {key}: {value}")
    emit_json_line(result, args.out)


if __name__ == "__main__":
    main()
