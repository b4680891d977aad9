"""`make demo`: chat once with the default model through the offline engine and print the answer.

When the services land this becomes the whole stack (`deepinfer up` + the `openai` client).
"""

from __future__ import annotations

import sys
import time

QUESTION = "What is the capital of France?"


def main() -> int:
    """Load the default model (prepared once from its GGUF), ask one question greedily, print the answer."""
    import torch

    from deepinfer import LLM, SamplingParams

    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    started = time.perf_counter()
    llm = LLM()
    loaded = time.perf_counter()
    out = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(temperature=0, max_tokens=48))
    done = time.perf_counter()
    completion = out[0].outputs[0]
    print(f"user: {QUESTION}")
    print(f"assistant: {completion.text.strip()}")
    print(
        f"[{len(completion.token_ids)} tokens in {done - loaded:.2f} s; model ready in {loaded - started:.1f} s; "
        f"finish_reason={completion.finish_reason}]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
