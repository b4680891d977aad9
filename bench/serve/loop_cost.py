"""Per-step host cost of the decode worker's service path, on this CPU, at concurrency 1 and 64.

    PYTHONPATH=shared:. python bench/serve/loop_cost.py [--concurrency 1 64] [--steps 600] [--repeats 3]
        [--fake-step HOST_US DEVICE_US] [--trace [--token-spans first_last|all] [--unsampled]] [--out FILE]

The real decode side: `DecodeHandler` (EngineLoop, the token batch path, heartbeats, KV events) on a tiny
random llama, a real nats-server on a free port and a subscriber process draining the token subject. Requests
are admitted without a KV handle (the prompt is computed here), then a window of `--steps` decode steps with
every request running is measured:

    (a) engine thread outside `core.step()`: its CPU time (thread clock) and its wall time between two steps
        (which adds the GIL waits behind the event loop) — service-only bookkeeping in EngineLoop;
    (b) the event-loop thread's CPU time per step (outputs → token batches → NATS, metrics, heartbeats);
    (c) `core.step()` itself (wall and CPU), and the same steps in the offline `LLM` for reference.

With `--fake-step HOST_US DEVICE_US` the model is replaced, from the window on, by a step shaped like an
accelerator's: HOST_US of Python holding the GIL, then DEVICE_US of waiting without it (the same in the offline
run). On the CPU a real step computes with the GIL released and its cost swamps the service's; the fake step
shows what the service's host work does to a GPU-like step, and with far less noise: "step ratio" is then the
service's tokens/s over the offline engine's at equal steps.

With `--trace` the decode worker runs the file exporter (`DEEPINFER_OTEL_EXPORTER=file`) and every request is
admitted inside a sampled trace, as a gateway's `traceparent` brings it (`decode.admission` under a remote
parent): its token batches become spans as `--token-spans` says (unset: the code's default; the setting is only
passed when given, so the bench also runs an older checkout through PYTHONPATH); with `--unsampled` the parent
is one a gateway left out (`parentbased_traceidratio`: the traceparent's sampled flag off). "spans" is what the
exporter wrote per window step (all of the run's spans / the run's steps after the prompts).

The GIL switch interval is the services' (0.5 ms). Prints a table and one JSON line (saved with --out).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.results_io import emit_json_line
from bench.serve.step_clock import FakeStep, StepClock

PROMPT_LEN = 30
#: The tiny model's context: room for long windows of steps.
MAX_MODEL_LEN = 4096
WARMUP_STEPS = 20
GATEWAY = "gw-bench"
GIL_SWITCH_INTERVAL_S = 0.0005


@dataclass
class Tracing:
    """`--trace`: the file exporter into `directory`, and `token_spans` (None: the code's default)."""

    directory: Path
    token_spans: str | None = None
    #: The gateway's traceparent says sampled (else: a request the gateway's sampler left out).
    sampled: bool = True

    def settings(self) -> dict:
        """CommonSettings keywords."""
        extra = {} if self.token_spans is None else {"otel_token_spans": self.token_spans}
        return {"otel_exporter": "file", "otel_file_dir": self.directory, **extra}


def _settings(nats_url: str, nats_token: str, model_dir: Path, cache_dir: Path, concurrency: int,
              tracing: Tracing | None = None):
    from deepinfer.config import CommonSettings, DecodeSettings

    common = CommonSettings(nats_url=nats_url, nats_token=nats_token, model=str(model_dir), model_cache_dir=cache_dir,
                            **({} if tracing is None else tracing.settings()))
    return DecodeSettings(common=common, worker_id="decode-bench", internal_port=0, kv_store=False,
                          max_num_seqs=max(64, concurrency), kv_cache_bytes=256 << 20)


def _requests(concurrency: int, max_tokens: int):
    from deepinfer.protocol import DecodeRequest, WireSamplingParams

    return [
        DecodeRequest(request_id=f"r{i}", gateway_id=GATEWAY,
                      prompt_token_ids=[(7 * i + 13 * k) % 300 + 3 for k in range(PROMPT_LEN)],
                      sampling=WireSamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, seed=i))
        for i in range(concurrency)
    ]


async def measure_service(server, model_dir: Path, cache_dir: Path, concurrency: int, steps: int,
                          fake_s: tuple[float, float] | None = None, tracing: Tracing | None = None) -> dict:
    """One window of `steps` decode steps of a DecodeHandler serving `concurrency` requests."""
    from deepinfer import subjects
    from deepinfer.bus import Bus
    from deepinfer.service import ServiceContext
    from deepinfer.telemetry import new_registry
    from deepinfer.telemetry.tracing import setup_tracer_provider
    from services.decode.handler import DecodeHandler

    settings = _settings(server.url, server.token, model_dir, cache_dir, concurrency, tracing)
    bus = await Bus.connect(server.url, name="decode-bench", token=server.token)
    provider = setup_tracer_provider(settings.common, "decode")
    handler = DecodeHandler(ServiceContext("decode", settings, bus, new_registry(),
                                           provider.get_tracer("deepinfer.decode")))
    subject = subjects.tokens(handler.runtime.model, GATEWAY)
    drain = subprocess.Popen([sys.executable, __file__, "--drain", server.url, server.token, subject],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert drain.stdout is not None and drain.stdout.readline().strip() == "ready"
        await handler.load()
        await handler.start()
        loop = asyncio.get_running_loop()
        # The window starts once every request is past its prompt (prompts go in the first steps).
        first = WARMUP_STEPS + concurrency // 4
        clock = StepClock(fake=_fake(fake_s, first, steps))
        clock.wrap(handler.runtime.engine.core)
        start_mark, end_mark = clock.mark(loop, first), clock.mark(loop, first + steps)
        max_tokens = first + steps + 10
        admit = handler.decode if tracing is None else lambda r: _admit_traced(handler, r, tracing.sampled)
        accepted = await asyncio.gather(*(admit(r) for r in _requests(concurrency, max_tokens)))
        assert all(a.error is None for a in accepted), next(a.error for a in accepted if a.error)
        loop_cpu_start = await start_mark
        loop_cpu_end = await end_mark
        while len(clock.starts) <= first + steps:  # the mark fires just before the step's clock is read
            await asyncio.sleep(0.001)
        assert all(b == concurrency for b in clock.batches[first:first + steps]), "batch changed in the window"
        result = clock.window(first, first + steps)
        loop_user_us, loop_sys_us = (1e6 * (end - start) / steps
                                     for start, end in zip(loop_cpu_start, loop_cpu_end, strict=True))
        result.update(loop_cpu_us=loop_user_us + loop_sys_us, loop_sys_us=loop_sys_us)
        while handler.num_streams:
            await asyncio.sleep(0.02)
    finally:
        await handler.close()
        await bus.close()
        provider.shutdown()  # the file exporter's last spans
        drain.stdin.close()
        received = drain.stdout.read().strip()
        drain.wait(10)
    result["token_messages_received"] = int(received or 0)
    if tracing is not None:
        result["spans_per_step"] = _spans_written(tracing.directory) / (len(clock.starts) - first)
    return result


async def _admit_traced(handler, request, sampled: bool):
    """`handler.decode(request)` as the worker runs it for a traced caller: a `decode.admission` span under the
    remote parent a gateway's traceparent makes (its sampled flag as given)."""
    from opentelemetry import context as otel_context
    from opentelemetry import propagate

    headers = {"traceparent": f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-{'01' if sampled else '00'}"}
    token = otel_context.attach(propagate.extract(headers))
    try:
        with handler.runtime.hops.span("admission"):
            return await handler.decode(request)
    finally:
        otel_context.detach(token)


def _spans_written(directory: Path) -> int:
    """Spans in the exporter's files, which are then removed (the next run counts its own)."""
    count = 0
    for path in directory.glob("*.jsonl"):
        with path.open("rb") as lines:
            count += sum(1 for _ in lines)
        path.unlink()
    return count


def measure_offline(model_dir: Path, concurrency: int, steps: int, fake_s: tuple[float, float] | None = None) -> dict:
    """The same requests through the offline LLM: step() time over the same window of steps."""
    from deepinfer import LLM
    from deepinfer.sampling.params import SamplingParams

    first = WARMUP_STEPS + concurrency // 4
    llm = LLM(str(model_dir), max_num_seqs=max(64, concurrency), kv_cache_bytes=256 << 20, progress=False)
    clock = StepClock(fake=_fake(fake_s, first, steps))
    clock.wrap(llm.engine)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in _requests(concurrency, 1)]
    params = [SamplingParams(temperature=0, max_tokens=first + steps + 10, ignore_eos=True, seed=i)
              for i in range(concurrency)]
    llm.generate(prompts, params, use_tqdm=False)
    assert all(b == concurrency for b in clock.batches[first:first + steps]), "batch changed in the window"
    return clock.window(first, first + steps)


def _fake(fake_s: tuple[float, float] | None, first: int, steps: int) -> FakeStep | None:
    return None if fake_s is None else FakeStep(*fake_s, first=first, last=first + steps + 1)


def run(concurrencies: list[int], steps: int, repeats: int, fake_s: tuple[float, float] | None = None,
        trace: bool = False, token_spans: str | None = None, sampled: bool = True) -> dict:
    """Median over `repeats` of each number, per concurrency."""
    import torch

    from deepinfer.nats_server import NatsServer
    from deepinfer.testing.checkpoints import make_tiny_checkpoint

    torch.set_num_threads(1)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    points = []
    with tempfile.TemporaryDirectory(prefix="loop-cost-") as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp) / "llama", "llama", max_position_embeddings=MAX_MODEL_LEN)
        tracing = Tracing(Path(tmp) / "traces", token_spans, sampled) if trace else None
        server = NatsServer()
        server.start()
        try:
            for concurrency in concurrencies:
                runs = [asyncio.run(measure_service(server, model_dir, Path(tmp), concurrency, steps, fake_s,
                                                    tracing)) for _ in range(repeats)]
                offline = [measure_offline(model_dir, concurrency, steps, fake_s) for _ in range(repeats)]
                points.append({"concurrency": concurrency, "service": _median(runs), "offline": _median(offline),
                               "service_min": _least(runs), "offline_min": _least(offline)})
        finally:
            server.close()
    return {"bench": "loop_cost", "model": "tiny-llama", "device": "cpu", "steps": steps, "repeats": repeats,
            "gil_switch_interval_s": GIL_SWITCH_INTERVAL_S,
            "fake_step_us": None if fake_s is None else [round(1e6 * v) for v in fake_s],
            "trace": trace, "token_spans": token_spans, "sampled": sampled, "points": points}


def _median(runs: list[dict]) -> dict:
    return {key: round(statistics.median(r[key] for r in runs), 1) for key in runs[0]}


def _least(runs: list[dict]) -> dict:
    """The least of each number: other processes on a shared CPU only ever add to a cost."""
    return {key: round(min(r[key] for r in runs), 1) for key in runs[0]}


def print_table(result: dict) -> None:
    """One row per concurrency, µs per step."""
    fake = result["fake_step_us"]
    model = result["model"] if fake is None else f"fake step: {fake[0]} µs host + {fake[1]} µs device"
    traced = ""
    if result.get("trace"):
        unsampled = "" if result.get("sampled", True) else ", not sampled"
        traced = f", traced (token spans: {result['token_spans'] or 'default'}{unsampled})"
    print(f"µs per decode step ({model} on {result['device']}{traced}, median [least] of {result['repeats']} "
          f"windows of {result['steps']} steps); step ratio: offline step period / service step period")
    header = ("c", "(a) eng cpu out", "(a) eng wall out", "(b) loop cpu", "of it sys", "step wall", "step cpu",
              "offline step wall", "offline wall out", "period", "step ratio", "spans/step")
    print(" | ".join(header))
    for p in result["points"]:
        s, o, s_min, o_min = p["service"], p["offline"], p["service_min"], p["offline_min"]
        service_keys = ("outside_step_cpu_us", "outside_step_wall_us", "loop_cpu_us", "loop_sys_us", "step_wall_us",
                        "step_cpu_us")
        cells = [f"{s[k]} [{s_min[k]}]" for k in service_keys]
        cells += [f"{o[k]} [{o_min[k]}]" for k in ("step_wall_us", "outside_step_wall_us")]
        cells += [f"{s['period_us']} [{s_min['period_us']}]", str(round(o["period_us"] / s["period_us"], 3)),
                  str(s.get("spans_per_step", "-"))]
        print(" | ".join([str(p["concurrency"]), *cells]))


def drain_subject(url: str, token: str, subject: str) -> None:
    """Subscriber process: count messages on `subject` until stdin closes, then print the count."""
    import nats

    async def main() -> None:
        count = 0

        async def on_msg(msg) -> None:
            nonlocal count
            count += 1

        nc = await nats.connect(url, token=token)
        await nc.subscribe(subject, cb=on_msg)
        await nc.flush()
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await nc.drain()
        print(count, flush=True)

    asyncio.run(main())


def main() -> None:
    """Measure, print the table and one JSON line."""
    if len(sys.argv) > 1 and sys.argv[1] == "--drain":
        drain_subject(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fake-step", type=float, nargs=2, metavar=("HOST_US", "DEVICE_US"),
                        help="after the prompts, replace the model by an accelerator-like step: HOST_US of Python "
                        "holding the GIL, then DEVICE_US waiting without it (e.g. 300 1000)")
    parser.add_argument("--trace", action="store_true", help="the file exporter on, every request traced")
    parser.add_argument("--token-spans", choices=["first_last", "all"],
                        help="with --trace: otel_token_spans (unset: the code's default)")
    parser.add_argument("--unsampled", action="store_true",
                        help="with --trace: every request's traceparent says not sampled (a gateway left it out)")
    parser.add_argument("--out", type=Path, help="also write the JSON here (e.g. bench/results/...json)")
    args = parser.parse_args()
    fake_s = None if args.fake_step is None else (args.fake_step[0] / 1e6, args.fake_step[1] / 1e6)
    result = run(args.concurrency, args.steps, args.repeats, fake_s, args.trace, args.token_spans, not args.unsampled)
    print_table(result)
    emit_json_line(result, args.out)


if __name__ == "__main__":
    main()
