"""`make demo`: start the whole stack (`deepinfer up`'s `Stack`), ask one question with the `openai` client."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletion

QUESTION = "What is the capital of France?"
MAX_TOKENS = 48


def main() -> int:
    """Chat once through gateway → scheduler → prefill → decode, print the answer, stop the stack."""
    return stack_main()


def stack_main() -> int:
    """The stack path: every service as a process over a private nats-server, on a free port."""
    from deepinfer.up.stack import Stack, StackError

    print("[demo: starting the stack (nats, scheduler, prefill, decode, gateway)]", file=sys.stderr)
    # No API keys: the stack binds 127.0.0.1 and lives only as long as this demo.
    stack = Stack(port=0, env_overrides={"DEEPINFER_GATEWAY_API_KEYS": ""})
    try:
        stack.start()
        import openai  # ~1 s of imports: while the children start, not before

        stack.wait_ready(on_ready=_report_ready, on_waiting=_report_waiting)
        client = openai.OpenAI(base_url=stack.base_url, api_key="demo", max_retries=0)
        started = time.perf_counter()
        response = client.chat.completions.create(
            model=stack.model_name,
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        # Printed before the stop: draining and stopping the stack takes another second or two.
        _print_answer(response, time.perf_counter() - started, stack.base_url)
    except StackError as exc:
        print(f"demo: the stack did not start: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
    return 0


def _print_answer(response: ChatCompletion, elapsed_s: float, base_url: str) -> None:
    choice = response.choices[0]
    print(f"user: {QUESTION}")
    print(f"assistant: {(choice.message.content or '').strip()}", flush=True)
    usage = response.usage
    num_tokens = usage.completion_tokens if usage is not None else "?"
    print(
        f"[via {base_url}: {num_tokens} tokens in {elapsed_s:.2f} s; finish_reason={choice.finish_reason}]",
        file=sys.stderr,
    )


def _report_ready(name: str, seconds: float) -> None:
    print(f"[demo: {name} ready in {seconds:.1f} s]", file=sys.stderr)


def _report_waiting(pending: dict[str, str], seconds: float) -> None:
    for name, reason in pending.items():
        print(f"[demo: still waiting for {name} after {seconds:.0f} s: {reason}]", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
