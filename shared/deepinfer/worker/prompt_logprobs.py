"""A request's prompt logprobs (vLLM's prompt_logprobs), from the engine's output to the wire: both workers send
them from where the prompt was computed, the prefill worker in its PrefillResult, the decode worker (computing
prompts itself) on the request's first TokenChunk."""

from __future__ import annotations

from deepinfer.engine import EngineOutput
from deepinfer.protocol import PromptLogprobs


def wire_prompt_logprobs(output: EngineOutput) -> PromptLogprobs | None:
    """The output's prompt logprobs as the wire message (the engine's own lists, not validated again: a long
    prompt's are tens of thousands of numbers); None when it carries none."""
    scores = output.prompt_logprobs
    if scores is None:
        return None
    return PromptLogprobs.model_construct(logprobs=scores.logprobs, ranks=scores.ranks,
                                          top_token_ids=scores.top_token_ids, top_logprobs=scores.top_logprobs)
