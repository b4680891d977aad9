"""OpenAI response bodies from running choices: one JSON object, or SSE chunks ending in `data: [DONE]`."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

from deepinfer.tokenizer import Tokenizer
from services.gateway.errors import ApiError, internal
from services.gateway.handler import GatewayHandler, RunningRequest
from services.gateway.metrics import RequestRecord
from services.gateway.openai_models import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    Usage,
)
from services.gateway.output import ChoiceDelta, ChoiceOutput, chat_logprobs, completion_logprobs
from services.gateway.recipe import GenerateRequest

logger = logging.getLogger(__name__)

DONE_EVENT = "data: [DONE]\n\n"

Disconnected = Callable[[], Awaitable[bool]]


@dataclass
class Generation:
    """One HTTP request's choices, running on the workers, and how to present them."""

    api: Literal["chat", "completions"]
    response_id: str
    created: int
    model_name: str
    tokenizer: Tokenizer
    runs: list[RunningRequest]
    outputs: list[ChoiceOutput]
    logprobs: bool
    top_logprobs: bool
    include_usage: bool
    record: RequestRecord

    def usage(self) -> Usage:
        """Token counts; the prompt counts once however many choices ran."""
        num_prompt_tokens = len(self.runs[0].request.prompt_token_ids)
        num_completion_tokens = sum(o.num_output_tokens for o in self.outputs)
        return Usage(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.outputs[0].num_cached_tokens or 0),
        )

    def end(self, status: int) -> None:
        """Close the request's metrics."""
        usage = self.usage()
        self.record.end(status, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens)


async def start_choices(handler: GatewayHandler, requests: list[GenerateRequest]) -> list[RunningRequest]:
    """Start every choice; if one fails, cancel those that started and raise its error."""
    results = await asyncio.gather(*(handler.start(r) for r in requests), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        for result in results:
            if isinstance(result, RunningRequest):
                result.stop("another choice failed")
        raise failures[0]
    return [r for r in results if isinstance(r, RunningRequest)]


async def choice_deltas(
    run: RunningRequest, output: ChoiceOutput, is_disconnected: Disconnected | None
) -> AsyncIterator[ChoiceDelta]:
    """One choice's deltas; a stop string found here cancels the request on the workers."""
    async with aclosing(run.chunks(is_disconnected)) as chunks:
        async for chunk in chunks:
            delta = output.add(chunk)
            if delta.stopped_by_string:
                run.stop("stop string")
            yield delta
            if delta.finish_reason is not None:
                return


async def merged_deltas(generation: Generation, is_disconnected: Disconnected | None) -> AsyncIterator[ChoiceDelta]:
    """Deltas of every choice, interleaved as they arrive; the first failure ends them all."""
    pairs = zip(generation.runs, generation.outputs, strict=True)
    iterators = [choice_deltas(run, output, is_disconnected) for run, output in pairs]
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


# ------------------------------------------------------------------------------------------------ non-stream


async def full_response(generation: Generation) -> dict[str, Any]:
    """Collect every choice and build the non-streamed response (ApiError on a failure mid-way)."""
    async for delta in merged_deltas(generation, None):
        if delta.text:
            generation.record.first_token()
    usage = generation.usage()
    if generation.api == "chat":
        chat_choices = [
            ChatChoice(
                index=o.index,
                message=AssistantMessage(content=o.text),
                logprobs=chat_logprobs(generation.tokenizer, o.logprobs) if generation.logprobs else None,
                finish_reason=o.finish_reason,
            )
            for o in generation.outputs
        ]
        body: Any = ChatCompletionResponse(
            id=generation.response_id, created=generation.created, model=generation.model_name,
            choices=chat_choices, usage=usage,
        )
    else:
        choices = [
            CompletionChoice(
                index=o.index,
                text=o.text,
                logprobs=completion_logprobs(generation.tokenizer, o.logprobs, 0, generation.top_logprobs)[0]
                if generation.logprobs
                else None,
                finish_reason=o.finish_reason,
            )
            for o in generation.outputs
        ]
        body = CompletionResponse(
            id=generation.response_id, created=generation.created, model=generation.model_name,
            choices=choices, usage=usage,
        )
    return body.model_dump(mode="json")


# ------------------------------------------------------------------------------------------------ streaming


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def stream_events(generation: Generation, is_disconnected: Disconnected | None) -> AsyncIterator[str]:
    """SSE events: role chunks (chat), content chunks, a final chunk per choice, usage if asked, [DONE].

    A failure after the stream started is an error event (`data: {"error": ...}`) followed by [DONE].
    """
    status = 200
    formatter = _ChunkFormatter(generation)
    try:
        if generation.api == "chat":
            for output in generation.outputs:
                yield sse(formatter.chat_chunk(output.index, DeltaMessage(role="assistant", content="")))
        async for delta in merged_deltas(generation, is_disconnected):
            if delta.text:
                generation.record.first_token()
            if delta.text or delta.finish_reason is not None or delta.logprobs:
                yield sse(formatter.delta_chunk(delta))
        if generation.include_usage:
            yield sse(formatter.usage_chunk())
    except ApiError as exc:
        status = exc.status_code
        yield exc.sse_event()
    except (asyncio.CancelledError, GeneratorExit):
        status = 499  # client closed the connection
        raise
    except Exception:
        status = 500
        logger.exception("stream %s failed", generation.response_id)
        yield internal(generation.response_id).sse_event()
    finally:
        generation.end(status)
    yield DONE_EVENT


class _ChunkFormatter:
    """Builds chunk objects of one stream (the completions text offsets advance per choice)."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.text_offsets = [0] * len(generation.outputs)

    def _base(self) -> dict[str, Any]:
        g = self.generation
        return {"id": g.response_id, "created": g.created, "model": g.model_name}

    def chat_chunk(self, index: int, delta: DeltaMessage, **choice: Any) -> dict[str, Any]:
        """A chat.completion.chunk with one choice (`delta` without its unset keys, as OpenAI sends)."""
        chunk = ChatCompletionChunk(**self._base(), choices=[ChatChunkChoice(index=index, delta=delta, **choice)])
        return self._dump(chunk, delta_keys=True)

    def delta_chunk(self, delta: ChoiceDelta) -> dict[str, Any]:
        """The chunk carrying one choice's delta."""
        g = self.generation
        if g.api == "chat":
            logprobs = chat_logprobs(g.tokenizer, delta.logprobs) if g.logprobs else None
            return self.chat_chunk(
                delta.index, DeltaMessage(content=delta.text), logprobs=logprobs, finish_reason=delta.finish_reason
            )
        logprobs = None
        if g.logprobs:
            logprobs, self.text_offsets[delta.index] = completion_logprobs(
                g.tokenizer, delta.logprobs, self.text_offsets[delta.index], g.top_logprobs
            )
        choice = CompletionChoice(
            index=delta.index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason
        )
        return self._dump(CompletionResponse(**self._base(), choices=[choice]))

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        g = self.generation
        chunk_type = ChatCompletionChunk if g.api == "chat" else CompletionResponse
        return chunk_type(**self._base(), choices=[], usage=g.usage()).model_dump(mode="json")

    def _dump(self, chunk: ChatCompletionChunk | CompletionResponse, delta_keys: bool = False) -> dict[str, Any]:
        data = chunk.model_dump(mode="json")
        if delta_keys:
            for choice, model in zip(data["choices"], chunk.choices, strict=True):  # type: ignore[arg-type]
                choice["delta"] = model.delta.model_dump(mode="json", exclude_none=True)  # type: ignore[union-attr]
        if not self.generation.include_usage:
            data.pop("usage", None)
        return data
