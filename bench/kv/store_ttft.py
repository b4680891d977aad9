"""TTFT of long prompts served from the kvcache store after a restart of the whole stack, vs recomputed.

    PYTHONPATH=shared:. python bench/kv/store_ttft.py [--prompts 3] [--facts 150] [--max-tokens 8]

Runs `deepinfer up`'s Stack (the default model, one kvcache shard, a fresh data dir) twice on the same data dir:

    run 1   each prompt once: recomputed (TTFT "recompute"), its blocks written behind to the store
    run 2   the stack restarted (device caches empty), each prompt again: loaded from the store (TTFT "store")

TTFT = request sent → first streamed content token, via the openai client. Prints a table and one JSON line;
saves the JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import httpx
import openai

from deepinfer.bench.kv_workload import prompt
from deepinfer.up import Stack


def ttft(client: openai.OpenAI, model: str, messages, max_tokens: int) -> tuple[float, dict, str]:
    started = time.perf_counter()
    first, text, usage = None, "", None
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    first = first or time.perf_counter()  # no content token (an answer of special tokens): the end
    details = usage.prompt_tokens_details
    return (first - started, {"prompt_tokens": usage.prompt_tokens, "cached_tokens": details.cached_tokens,
                              "by_tier": details.model_extra.get("cached_tokens_by_tier"),
                              "completion_tokens": usage.completion_tokens}, text)


def run(env: dict[str, str], messages_list, max_tokens: int) -> list[tuple[float, dict, str]]:
    with Stack(port=0, env_overrides=env, start_timeout_s=300) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="bench", max_retries=0, timeout=300)
        ttft(client, stack.model_name, [{"role": "user", "content": "warm up"}], 2)
        results = [ttft(client, stack.model_name, m, max_tokens) for m in messages_list]
        time.sleep(2.0)  # write-behind of the last prompt's blocks (draining flushes it too)
        metrics = httpx.get(f"http://127.0.0.1:{stack.services['prefill-0'].internal_port}/metrics").text
        print("\n".join(line for line in metrics.splitlines() if line.startswith("deepinfer_worker_store")
                         and not line.startswith("deepinfer_worker_store_load_seconds_bucket")
                         and not line.startswith("deepinfer_worker_store_write_seconds_bucket")))
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--facts", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    messages_list = [prompt(i, args.facts) for i in range(args.prompts)]
    with tempfile.TemporaryDirectory() as data_dir:
        env = {"DEEPINFER_DATA_DIR": data_dir, "DEEPINFER_GATEWAY_API_KEYS": ""}
        cold = run(env, messages_list, args.max_tokens)
        warm = run(env, messages_list, args.max_tokens)
    rows = []
    for (t_cold, u_cold, text_cold), (t_store, u_store, text_store) in zip(cold, warm, strict=True):
        rows.append({"prompt_tokens": u_cold["prompt_tokens"], "ttft_recompute_s": round(t_cold, 4),
                     "ttft_store_s": round(t_store, 4), "cached_by_tier_after_restart": u_store["by_tier"],
                     "same_text": text_cold == text_store})
    print(f"{'prompt tokens':>14} {'TTFT recompute':>15} {'TTFT store':>11} {'store tokens':>13} same text")
    for row in rows:
        print(f"{row['prompt_tokens']:>14} {row['ttft_recompute_s']:>14.3f}s {row['ttft_store_s']:>10.3f}s "
              f"{(row['cached_by_tier_after_restart'] or {}).get('store', 0):>13} {row['same_text']}")
    result = {"bench": "store_ttft", "date": date.today().isoformat(), "host": platform.node(),
              "median_ttft_recompute_s": statistics.median(r["ttft_recompute_s"] for r in rows),
              "median_ttft_store_s": statistics.median(r["ttft_store_s"] for r in rows), "rows": rows,
              "args": vars(args)}
    print(json.dumps(result))
    out = Path(__file__).resolve().parents[1] / "results" / f"store-ttft-cpu-{rows[0]['prompt_tokens']}tok-{result['date']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
