"""The decode side of bench/gateway/admission_burst.py: a GPU-shaped stand-in for the model runner, and per-request
timestamps taken through public seams of the real DecodeHandler, EngineLoop, EngineCore and scheduler: the bus the
bench gives the handler, the EngineLoop's `on_commands` / `on_settled` hooks, and wrappers of public methods
(nothing in them changes: each wrapper calls the original)."""

from __future__ import annotations

import time
from collections import deque

from bench.serve.step_clock import host_work


class FakeDevice:
    """Stands in for ModelRunner.execute / execute_async: GPU-shaped steps on one device timeline."""

    def __init__(self, host_s: float, device_s: float, per_token_s: float) -> None:
        self.host_s, self.device_s, self.per_token_s = host_s, device_s, per_token_s
        self.free_at = 0.0

    def _launch(self, output) -> float:
        host_work(self.host_s)
        prefill_tokens = max(0, output.num_batched_tokens - len(output.scheduled))
        start_s = max(time.perf_counter(), self.free_at)
        self.free_at = start_s + self.device_s + self.per_token_s * prefill_tokens
        return self.free_at

    def execute(self, output, requests):
        done_s = self._launch(output)
        time.sleep(max(0.0, done_s - time.perf_counter()))
        return _sampled(output)

    def execute_async(self, output, requests):
        return FakePending(self._launch(output), _sampled(output))


class FakePending:
    needs_sync = False

    def __init__(self, done_s: float, tokens: dict) -> None:
        self.done_s, self.tokens = done_s, tokens

    def result(self) -> dict:
        time.sleep(max(0.0, self.done_s - time.perf_counter()))
        return self.tokens


def _sampled(output) -> dict:
    from deepinfer.engine.outputs import SampledToken

    return {s.request_id: SampledToken(5 + len(s.request_id) % 7, 0.0) for s in output.scheduled if s.sample}


class Probe:
    """Per-request timestamps (time.monotonic) on the decode side, from wrappers around the real objects."""

    def __init__(self) -> None:
        self.times: dict[str, dict[str, float]] = {}
        self.steps: dict[str, list[int]] = {}
        self.num_schedules = 0
        #: Engine-thread CPU seconds spent running commands (reset per burst).
        self.command_cpu_s = 0.0
        #: ... and wall seconds (the CPU time plus waits for the GIL).
        self.command_wall_s = 0.0
        #: Requests whose add_request ran and whose command is not settled yet (engine thread appends).
        self._ran: deque[str] = deque()
        #: Requests admitted whose first output the engine thread / the event loop has not seen yet.
        self._unsampled: set[str] = set()
        self._unlooped: set[str] = set()

    def mark(self, request_id: str, point: str) -> None:
        self.times.setdefault(request_id, {}).setdefault(point, time.monotonic())

    def install(self, handler) -> None:
        """Before handler.start(): its decode subscription's messages are marked as they arrive."""
        from deepinfer.protocol import DecodeRequest
        from deepinfer.telemetry import current_request_id

        decode, bus_subscribe = handler.decode, handler.bus.subscribe

        async def probed_subscribe(subject, callback, queue=None, message_type=None):
            if message_type is DecodeRequest:
                on_decode = callback

                async def callback(request, msg):
                    self.mark(request.request_id, "received")
                    await on_decode(request, msg)

            return await bus_subscribe(subject, callback, queue=queue, message_type=message_type)

        async def probed_decode(request):
            self.mark(request.request_id, "started")
            return await decode(request)

        handler.bus.subscribe, handler.decode = probed_subscribe, probed_decode
        bus_reply = handler.bus.reply

        async def probed_reply(msg, message, headers=None):
            await bus_reply(msg, message, headers)
            self.mark(message.request_id, "replied")

        handler.bus.reply = probed_reply
        outbox = getattr(handler.runtime, "outbox", None)
        if outbox is not None:  # replies queued for one write (where the hop ends, as bus.reply queues too)
            reply_soon = outbox.reply_soon

            def probed_reply_soon(msg, message):
                queued = reply_soon(msg, message)
                if queued:
                    self.mark(message.request_id, "replied")
                return queued

            outbox.reply_soon = probed_reply_soon
        self._current_request_id = current_request_id

    def install_engine(self, handler) -> None:
        """After load(): the engine loop, the core and the scheduler."""
        engine, core = handler.runtime.engine_loop, handler.runtime.engine.core
        call = engine.call
        current = self._current_request_id

        async def probed_call(fn):
            request_id = current()
            if request_id is not None:
                self.mark(request_id, "queued")
            result = await call(fn)
            if request_id is not None:
                self.mark(request_id, "resumed")
            return result

        def on_settled(num_commands: int) -> None:
            settled_s = time.monotonic()
            # Commands settle in the order they ran (one wakeup per batch of them).
            for _ in range(num_commands):
                if self._ran:
                    self.times[self._ran.popleft()].setdefault("settled", settled_s)

        def on_commands(num_commands: int, wall_s: float, cpu_s: float) -> None:
            self.command_cpu_s += cpu_s
            self.command_wall_s += wall_s

        engine.call, engine.on_settled, engine.on_commands = probed_call, on_settled, on_commands
        add_request = core.add_request

        def probed_add_request(request_id, *args, **kwargs):
            self.mark(request_id, "run")
            self.steps[request_id] = [self.num_schedules]
            self._ran.append(request_id)
            self._unsampled.add(request_id)
            self._unlooped.add(request_id)
            return add_request(request_id, *args, **kwargs)

        core.add_request = probed_add_request
        schedule, step = core.scheduler.schedule, core.step

        def probed_schedule():
            output = schedule()
            self.num_schedules += 1
            for s in output.scheduled:
                if s.is_new:
                    self.mark(s.request_id, "scheduled")
                if s.sample and len(self.steps.get(s.request_id, ())) == 1:  # its first sampling step
                    self.steps[s.request_id].append(self.num_schedules)
            return output

        def probed_step():
            outputs = step()
            if self._unsampled:
                for o in outputs:
                    if o.request_id in self._unsampled:
                        self._unsampled.discard(o.request_id)
                        self.mark(o.request_id, "sampled")
            return outputs

        core.scheduler.schedule, core.step = probed_schedule, probed_step
        on_outputs = handler.runtime.on_outputs

        def probed_on_outputs(outputs):
            if self._unlooped:
                for o in outputs:
                    if o.request_id in self._unlooped:
                        self._unlooped.discard(o.request_id)
                        self.mark(o.request_id, "looped")
            on_outputs(outputs)

        handler.runtime.on_outputs = probed_on_outputs
