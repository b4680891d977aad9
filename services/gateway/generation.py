"""One HTTP request's choices running on the workers, collected into a body or streamed as SSE events.

    runs = await start_choices(pipeline, requests)            # every choice accepted, or an ApiError
    generation = Generation(presenter, ..., runs, outputs)    # how the presenter sees the request
    body = await collect(generation)                          # non-stream
    async for event in stream_events(generation, ...): ...    # stream: presenter's events, error event on failure
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from deepinfer.telemetry.hops import Hops
from deepinfer.tokenizer import Tokenizer
from services.gateway.errors import ApiError, internal
from services.gateway.metrics import RequestRecord
from services.gateway.openai_models import PromptTokensDetails, Usage
from services.gateway.output import ChoiceDelta, ChoiceOutput
from services.gateway.pipeline import RequestPipeline
from services.gateway.presenters import Presenter
from services.gateway.recipe import GenerateRequest, Prompt
from services.gateway.running import RunningRequest
from services.gateway.structured import OutputRules

logger = logging.getLogger(__name__)



@dataclass
class Generation:
    """One HTTP request's choices, running on the workers, and the presenter that writes them."""

    presenter: Presenter
    response_id: str
    created: int
    model_name: str
    tokenizer: Tokenizer
    runs: list[RunningRequest]
    outputs: list[ChoiceOutput]
    logprobs: bool
    #: The alternatives asked per position (logprobs / top_logprobs; 0 without).
    num_top_logprobs: int
    include_usage: bool
    record: RequestRecord
    hops: Hops
    #: Structured output: the grammar and tool parsing the request asked for (None: free text).
    rules: OutputRules | None = None
    #: The request's prompts (a completions batch has several): output i is prompts[i // n]'s choice i % n.
    prompts: list[Prompt] = field(default_factory=list)
    n: int = 1
    #: Completions' echo: each choice starts with its prompt (text, and logprobs when asked).
    echo: bool = False
    #: vLLM's prompt_logprobs field was asked: the response carries them in vLLM's shape.
    prompt_logprobs: bool = False

    def prompt_of(self, output: ChoiceOutput) -> Prompt:
        """The prompt a choice continues."""
        return self.prompts[output.index // self.n]

    def usage(self) -> Usage:
        """Token counts; each prompt counts once however many choices ran."""
        usage = self.usage_dict()
        return Usage(**{**usage, "prompt_tokens_details": PromptTokensDetails(**usage["prompt_tokens_details"])})

    def usage_dict(self) -> dict[str, Any]:
        """`usage()` as the JSON object it dumps to, built without the models (a streamed response's last event)."""
        num_prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        num_completion_tokens = sum(o.num_output_tokens for o in self.outputs)
        by_tier: dict[str, int] = {}
        for first in self.outputs[:: self.n]:  # each prompt's first choice
            for tier, num_tokens in (first.cached_tokens_by_tier or {}).items():
                by_tier[tier] = by_tier.get(tier, 0) + num_tokens
        return {
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": _num_cached_tokens(self.outputs, self.n),
                                      "cached_tokens_by_tier": by_tier},
        }

    def delivered(self, delta: ChoiceDelta) -> None:
        """A delta's text goes out now: its choice's token timing (TTFT, inter-token latency)."""
        self.record.delivered(delta.index, self.outputs[delta.index].num_output_tokens)

    def end(self, status: int) -> None:
        """Close the request's metrics."""
        num_completion_tokens = sum(o.num_output_tokens for o in self.outputs)
        self.record.end(status, num_completion_tokens, _num_cached_tokens(self.outputs, self.n))


def _num_cached_tokens(outputs: list[ChoiceOutput], n: int) -> int:
    """Prompt tokens served from a cache, each prompt counted once (by its first choice)."""
    return sum(first.num_cached_tokens or 0 for first in outputs[::n])


async def start_choices(pipeline: RequestPipeline, requests: list[GenerateRequest]) -> list[RunningRequest]:
    """Start every choice; if one fails, cancel those that started and raise its error."""
    if len(requests) == 1:  # the usual case: no task per choice, no extra turn of the loop
        return [await pipeline.start(requests[0])]
    results = await asyncio.gather(*(pipeline.start(r) for r in requests), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        for result in results:
            if isinstance(result, RunningRequest):
                result.stop("another choice failed")
        raise failures[0]
    return [r for r in results if isinstance(r, RunningRequest)]


async def choice_deltas(run: RunningRequest, output: ChoiceOutput) -> AsyncIterator[ChoiceDelta]:
    """One choice's deltas; a stop string found here cancels the request on the workers."""
    async with aclosing(run.chunks()) as chunks:
        async for chunk in chunks:
            delta = output.add(chunk)
            if delta.stopped_by_string:
                run.stop("stop string")
            yield delta
            if delta.finish_reason is not None:
                return


async def merged_deltas(generation: Generation) -> AsyncIterator[ChoiceDelta]:
    """Deltas of every choice, interleaved as they arrive; the first failure ends them all."""
    pairs = zip(generation.runs, generation.outputs, strict=True)
    iterators = [choice_deltas(run, output) for run, output in pairs]
    if len(iterators) == 1:
        async with aclosing(iterators[0]) as only:
            async for delta in only:
                yield delta
        return
    queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

    async def pump(iterator: AsyncIterator[ChoiceDelta]) -> None:
        try:
            async with aclosing(iterator) as deltas:  # type: ignore[type-var]
                async for delta in deltas:
                    queue.put_nowait(delta)
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(iterator)) for iterator in iterators]
    try:
        num_running = len(tasks)
        while num_running:
            item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(generation: Generation) -> dict[str, Any] | None:
    """Run every choice to its end and build the non-streamed body (ApiError on a failure mid-way); None when the
    client went away meanwhile (the workers were told to drop the request: nobody is left to answer)."""
    async for delta in merged_deltas(generation):
        if delta.text:
            generation.delivered(delta)
    if any(output.finish_reason is None for output in generation.outputs):
        return None  # a choice ended without finishing: only a disconnect does that (failures raise)
    return generation.presenter.response(generation)


async def stream_events(generation: Generation) -> AsyncIterator[str]:
    """The presenter's SSE events: opening, those of each delta, closing; each item one body write (a socket send
    and an ASGI send through every middleware): the opening goes with the first delta's events, and the closing
    events (usage, [DONE]) in one, the stream's last write. A failure after the stream started is the presenter's
    error events (OpenAI: `data: {"error": ...}` then [DONE])."""
    status = 200
    formatter = generation.presenter.stream(generation)
    ending: list[str] = []
    write = _sse_writes(generation)
    pending = ""  # the opening, until the first delta's events carry it
    try:
        try:
            pending = "".join(formatter.opening())
            async for delta in merged_deltas(generation):
                if delta.text:
                    generation.delivered(delta)
                events = formatter.delta(delta)
                if events:
                    text = pending + "".join(events) if pending or len(events) > 1 else events[0]
                    pending = ""
                    started_s = time.monotonic()
                    yield text
                    write(started_s, False)
            ending = formatter.closing()
        except ApiError as exc:
            status = exc.status_code
            ending = formatter.error(exc)
        except Exception:
            status = 500
            logger.exception("stream %s failed", generation.response_id)
            ending = formatter.error(internal(generation.response_id))
        if pending or ending:
            started_s = time.monotonic()
            yield pending + "".join(ending)
            write(started_s, True)
    except (asyncio.CancelledError, GeneratorExit):
        status = 499  # client closed the connection
        raise
    finally:
        generation.end(status)  # after the last write: the request's span covers it


def _sse_writes(generation: Generation) -> Callable[[float, bool], None]:
    """What each SSE write (yield to resume: the ASGI send) costs, called with its start and whether it is the
    stream's last: with tracing on, a `sse_write` hop observation, and of a traced request the writes its
    `TokenSpans` picks (the first and the last by default) are `gateway.sse_write` spans; nothing with tracing off,
    so a stream then pays nothing per token."""
    hops, span = generation.hops, generation.record.span
    if not hops.recording:
        return lambda started_s, last: None
    if not span.is_recording():  # not sampled: the histogram only
        return lambda started_s, last: hops.observe("sse_write", time.monotonic() - started_s)
    spans = hops.token_spans(trace.set_span_in_context(span))

    def write(started_s: float, last: bool) -> None:
        ended_s = time.monotonic()
        if spans.wanted(last):
            hops.record("sse_write", started_s, ended_s, spans.context)
        else:
            hops.observe("sse_write", ended_s - started_s)

    return write
