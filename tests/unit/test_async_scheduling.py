"""Async scheduling gives exactly the synchronous loop's tokens: late stops discarded, placeholders filled on the
device, preemption, prefix hits, n > 1, aborts and the disaggregated handoff (CPU: no overlap, same logic)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine import Engine, EngineRequest, PulledKv
from deepinfer.engine.args import EngineArgs
from deepinfer.engine.async_scheduler import AsyncScheduler
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.request import Request

PROMPTS = [
    [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300, 6],
    [9, 8, 7],
    list(range(40, 75)),
    [100],
    [5, 17, 42, 99, 7, 250, 31, 64, 1, 2, 3],  # shares two blocks of 4 with the first prompt
]


@pytest.fixture(scope="module")
def engines(tiny_dir):
    return {mode: LLM(str(tiny_dir), block_size=4, progress=False, async_scheduling=mode) for mode in (False, True)}


def run_both(engines, prompts, params):
    """(sync, async) results as (token_ids, finish_reason, stop_reason, logprobs) per sequence."""
    results = []
    for mode in (False, True):
        outputs = engines[mode].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([
            [(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outputs
        ])
    return results


def free_blocks(llm: LLM) -> tuple[int, int]:
    scheduler = llm.engine.core.scheduler
    return scheduler.block_pool.num_free_blocks, llm.engine.core.kv_plan.num_blocks - 1


def first_tokens(engines, prompt, n=8):
    out = engines[False].generate([{"prompt_token_ids": prompt}], greedy(n), use_tqdm=False)
    return out[0].outputs[0].token_ids


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("params", [
    greedy(12),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, min_p=0.05, seed=3, max_tokens=10, ignore_eos=True, n=3),
    greedy(1),
    greedy(2),
    SamplingParams(temperature=1.0, seed=5, max_tokens=9, min_tokens=4, repetition_penalty=1.3,
                   presence_penalty=0.5),
    # Penalties read every output token on the host: the step after one that used them waits for its tokens.
    greedy(12, presence_penalty=2.0, frequency_penalty=1.5, logit_bias={300: 8.0}),
])
def test_async_matches_sync(engines, params):
    sync, async_ = run_both(engines, PROMPTS, params)
    assert async_ == sync
    if params.ignore_eos:
        assert all(len(seq[0]) == params.max_tokens for out in sync for seq in out)
    num_free, num_total = free_blocks(engines[True])
    assert num_free == num_total
    assert engines[True].engine.core.scheduler.num_output_placeholders == {}


def test_late_stop_tokens_are_discarded(engines):
    """A stop id (and eos) found only when the token reaches the host: the extra token of the next step is
    never emitted, blocks come back, and stop_reason matches the synchronous loop."""
    stops = [first_tokens(engines, p)[k] for p, k in zip(PROMPTS, (3, 0, 5, 1, 2), strict=True)]
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[s]) for s in stops]
    sync, async_ = run_both(engines, PROMPTS, params)
    assert async_ == sync
    assert [out[0][1] for out in sync] == ["stop"] * len(PROMPTS)
    assert [len(out[0][0]) for out in sync] == [4, 1, 6, 2, 3]
    llm = engines[True]
    num_free, num_total = free_blocks(llm)
    assert llm.engine.core.scheduler.num_running == 0 and llm.engine.core._in_flight is None
    # Blocks of finished requests stay only in the prefix cache (evictable): nothing is referenced.
    assert num_free == num_total


def test_eos_with_min_tokens(tiny_dir):
    """eos as a late stop, and min_tokens counting the in-flight placeholder: the same as sync."""
    from deepinfer.testing.checkpoints import EOS_TOKEN_ID

    results = []
    for mode in (False, True):
        llm = LLM(str(tiny_dir), block_size=4, progress=False, async_scheduling=mode)
        bias = {EOS_TOKEN_ID: 30.0}  # eos as soon as min_tokens allow it: the first unbanned draw
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=14, min_tokens=m, logit_bias=bias)
                  for s, m in zip((1, 2, 3, 4, 5), (0, 2, 5, 0, 3), strict=True)]
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs])
    assert results[1] == results[0]
    # eos ends each sequence right at min_tokens + 1 (the placeholder counts towards min_tokens).
    assert [(len(ids), reason) for ids, reason in results[0]] == [(1, "stop"), (3, "stop"), (6, "stop"),
                                                                  (1, "stop"), (4, "stop")]


def test_preemption_under_tiny_kv_budget(tiny_dir, engines):
    """A KV budget of a few blocks forces preemptions (some while a step is in flight): same tokens."""
    results, preempted = [], []
    for mode in (False, True):
        core = engines[mode].engine.core
        per_block = core.model_config.kv_bytes_per_token(core.dtype) * 4
        llm = LLM(str(tiny_dir), block_size=4, progress=False, async_scheduling=mode,
                  kv_cache_bytes=per_block * 26, max_model_len=64)
        counts = []
        scheduler = llm.engine.core.scheduler
        original = scheduler._preempt

        def counting(request, step, original=original, counts=counts, scheduler=scheduler):
            # (request, whether its token of the step in flight is still a placeholder)
            counts.append((request.request_id, bool(getattr(scheduler, "num_output_placeholders", {}).get(
                request.request_id))))
            original(request, step)

        llm.engine.core.scheduler._preempt = counting
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(16), use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outputs])
        preempted.append(counts)
        assert free_blocks(llm)[0] == free_blocks(llm)[1]
    assert preempted[0] and any(in_flight for _, in_flight in preempted[1]), preempted
    assert results[1] == results[0]


def test_prefix_cache_hits(engines):
    llm = engines[True]
    cold = llm.generate([{"prompt_token_ids": PROMPTS[2]}], greedy(), use_tqdm=False)[0]
    warm = llm.generate([{"prompt_token_ids": PROMPTS[2]}], greedy(), use_tqdm=False)[0]
    assert warm.num_cached_tokens == 32
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    # Blocks filled by decode (cached while a step was in flight) are hits too: prompt + 12 outputs.
    longer = PROMPTS[2] + cold.outputs[0].token_ids[:9]
    hit = llm.generate([{"prompt_token_ids": longer}], greedy(4), use_tqdm=False)[0]
    assert hit.num_cached_tokens == 40
    ref = engines[False].generate([{"prompt_token_ids": longer}], greedy(4), use_tqdm=False)[0]
    assert hit.outputs[0].token_ids == ref.outputs[0].token_ids


def test_abort_mid_run(tiny_dir):
    """Aborting while a step is in flight: the others' tokens equal sync; nothing of the aborted one leaks."""
    results = []
    for mode in (False, True):
        core = Engine(EngineArgs(model=str(tiny_dir), block_size=4, progress=False, async_scheduling=mode))
        for i, prompt in enumerate(PROMPTS):
            core.add_request(EngineRequest(f"r{i}", prompt, greedy(10)))
        tokens: dict[str, list[int]] = {}
        num_steps = 0
        while core.has_unfinished_requests():
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            num_steps += 1
            if num_steps == 4:
                core.abort(["r1", "r3"])
                # the same id again, while r1's step is in flight
                core.add_request(EngineRequest("r1", PROMPTS[3], greedy(5)))
        results.append(tokens)
        assert core.stats().num_free_blocks == core.num_kv_blocks - 1
    sync, async_ = results
    assert {k: v for k, v in async_.items() if k not in ("r1", "r3")} == {
        k: v for k, v in sync.items() if k not in ("r1", "r3")}
    assert async_["r1"][-5:] == sync["r1"][-5:]  # the new r1 gets exactly its own 5 tokens at the end
    assert len(async_["r3"]) < 10


@pytest.mark.parametrize("params", [
    greedy(12),
    SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=12, ignore_eos=True),
])
def test_disaggregated_handoff_with_async(tiny_dir, params):
    def engine(mode):
        return Engine(EngineArgs(model=str(tiny_dir), block_size=4, progress=False, async_scheduling=mode))

    def run(core):
        tokens: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens

    reference = engine(False)
    reference.add_request(EngineRequest("r", PROMPTS[0], params))
    expected = run(reference)["r"]
    prefill = engine(True)
    prefill.add_request(EngineRequest("r", PROMPTS[0], params.clone(max_tokens=1), hold_blocks=True))
    first = run(prefill)["r"]
    assert first == expected[:1]
    payloads = prefill.export_held("r", prefill.held_block_ids("r"))
    decode = engine(True)
    decode.add_request(EngineRequest("other", PROMPTS[2], params))  # a running batch the handoff joins mid-flight
    decode.step()
    admission = decode.add_request(EngineRequest("r", PROMPTS[0], params, output_token_ids=first, kv=PulledKv(payloads)))
    assert admission.kv == "pulled"
    assert first + run(decode)["r"] == expected
    assert prefill.release_held("r")


@dataclass(frozen=True)
class Params:
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


def async_scheduler() -> AsyncScheduler:
    return AsyncScheduler(EngineConfig(num_blocks=12, max_model_len=32, block_size=4, model_fingerprint=b"fp"))


def test_placeholder_positions_and_blocks():
    """schedule(N+1) before update(N): the placeholder decode feeds no known token at the right position, with
    its block allocated; a request whose pending tokens reach max_tokens is not scheduled again."""
    scheduler = async_scheduler()
    scheduler.add_request(Request("a", [1, 2, 3, 4], Params(max_tokens=3)))
    s1 = scheduler.schedule()
    assert [(s.token_ids, s.num_computed_tokens, s.new_block_ids, s.sample) for s in s1.scheduled] == [
        ([1, 2, 3, 4], 0, [1], True)]
    s2 = scheduler.schedule()
    assert [(s.token_ids, s.num_computed_tokens, s.num_new_tokens, s.new_block_ids, s.sample, s.is_new)
            for s in s2.scheduled] == [([], 4, 1, [2], True, False)]
    with pytest.raises(ValueError, match="oldest"):
        scheduler.update(s2, {"a": [11]})
    assert [u.new_token_ids for u in scheduler.update(s1, {"a": [10]})] == [[10]]
    s3 = scheduler.schedule()
    assert [(s.token_ids, s.num_computed_tokens) for s in s3.scheduled] == [([], 5)]
    assert [u.new_token_ids for u in scheduler.update(s2, {"a": [11]})] == [[11]]
    s4 = scheduler.schedule()
    assert s4.scheduled == []  # 2 known + 1 in flight = max_tokens
    (last,) = scheduler.update(s3, {"a": [12]})
    assert (last.new_token_ids, last.finish_reason) == ([12], "length")
    assert scheduler.update(s4, {}) == []
    assert scheduler.schedule().finished_request_ids == ["a"]
    assert scheduler.block_pool.num_free_blocks == 11 and scheduler.num_output_placeholders == {}


def test_update_without_a_token_for_a_sampling_request_changes_nothing():
    scheduler = async_scheduler()
    for request_id, prompt in (("a", [1, 2, 3, 4]), ("b", [5, 6])):
        scheduler.add_request(Request(request_id, prompt, Params(max_tokens=8)))
    s1 = scheduler.schedule()
    for bad in ({"a": [10]}, {"a": [10], "b": []}, {"b": [11], "c": [12]}):
        with pytest.raises(ValueError, match=r"no sampled token for requests \['(a|b)'\]"):
            scheduler.update(s1, bad)
    assert scheduler.num_output_placeholders == {"a": 1, "b": 1} and scheduler.num_in_flight == 1
    assert [r.output_token_ids for r in scheduler.running] == [[], []]
    assert [u.new_token_ids for u in scheduler.update(s1, {"a": [10], "b": [11]})] == [[10], [11]]


def test_late_stop_discards_the_extra_token():
    scheduler = async_scheduler()
    scheduler.add_request(Request("a", [1, 2, 3, 4], Params(max_tokens=8, stop_token_ids=(10,))))
    s1 = scheduler.schedule()
    s2 = scheduler.schedule()
    (stopped,) = scheduler.update(s1, {"a": [10]})
    assert (stopped.new_token_ids, stopped.finish_reason, stopped.stop_reason) == ([10], "stop", 10)
    assert scheduler.block_pool.num_free_blocks == 11  # freed at once, while step 2 is in flight
    assert scheduler.update(s2, {"a": [99]}) == []  # computed for nothing, never emitted
    assert not scheduler.has_unfinished_requests()


def test_batch_invariant_with_async(tiny_dir):
    results = []
    for mode in (False, True):
        llm = LLM(str(tiny_dir), block_size=4, progress=False, batch_invariant=True, async_scheduling=mode)
        params = SamplingParams(temperature=0.7, seed=9, max_tokens=8, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outputs])
    assert results[1] == results[0]


def test_max_model_len_reached(tiny_dir):
    """The length limit counts the in-flight token: no step runs past max_model_len."""
    results = []
    for mode in (False, True):
        llm = LLM(str(tiny_dir), block_size=4, progress=False, max_model_len=24, async_scheduling=mode)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], greedy(None), use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs])
    assert results[1] == results[0]
    assert [(len(ids), reason) for ids, reason in results[0]] == [(4, "length"), (21, "length")]


def test_a_request_finishing_on_its_first_token_still_caches_its_prompt(tiny_dir):
    # The prefill worker's requests (max_tokens=1) must leave their prompt blocks in the prefix cache.
    prompt = list(range(5, 26))
    for async_scheduling in (False, True):
        core = Engine(EngineArgs(model=str(tiny_dir), block_size=4, progress=False,
                                     async_scheduling=async_scheduling))
        cached = []
        for request_id in ("a", "b"):
            params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            core.add_request(EngineRequest(request_id, prompt, params))
            while core.has_unfinished_requests():
                cached += [o.num_cached_tokens for o in core.step() if o.finish_reason]
        assert cached == [0, 20], async_scheduling


@pytest.mark.parametrize(("setting", "device", "tp", "expected"), [
    (None, "cuda", 1, True),  # auto: one CUDA device overlaps host and device work
    (None, "cpu", 1, False),  # auto: nothing to overlap on the CPU
    (None, "cuda", 2, False),  # auto: not across tensor-parallel ranks
    (False, "cuda", 1, False),
    (True, "cpu", 1, True),
])
def test_async_scheduling_auto_resolves_per_device(setting, device, tp, expected):
    args = EngineArgs(model="m", async_scheduling=setting, tensor_parallel_size=tp)
    assert args.resolve_async_scheduling(torch.device(device)) is expected


@pytest.mark.parametrize("scheduler_class", ["sync", "async"])
def test_update_sampled_equals_update_with_the_tokens_attached(scheduler_class):
    # EngineCore's update_sampled must give the EngineOutputs update() gave once each one's SampledToken was attached
    # (what EngineCore did after update()): same requests, same tokens, stops (eos, max_tokens) at the same steps.
    from deepinfer.engine.outputs import SampledToken
    from deepinfer.engine.scheduler import Scheduler

    cls = AsyncScheduler if scheduler_class == "async" else Scheduler

    def run(sampled_api: bool) -> list:
        scheduler = cls(EngineConfig(num_blocks=64, max_model_len=64, block_size=4, max_num_seqs=8,
                                     max_num_batched_tokens=32))
        for i, prompt in enumerate(PROMPTS):
            params = SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=i == 0)
            scheduler.add_request(Request(f"r{i}", prompt, params, eos_token_ids=(1,)))
        history, step = [], 0
        while scheduler.has_unfinished_requests() and step < 60:
            output = scheduler.schedule()
            sampled = {s.request_id: SampledToken(1 if (step + int(s.request_id[1:])) % 7 == 6 else 2 + step,
                                                  -0.5 - step, [(3, -1.0)] if step % 2 else None)
                       for s in output.scheduled if s.sample}
            if sampled_api:
                outs = scheduler.update_sampled(output, sampled)
            else:
                outs = scheduler.update(output, {rid: [t.token_id] for rid, t in sampled.items()})
                for u in outs:
                    if u.new_token_ids and u.request_id in sampled:
                        u.new_logprobs = [sampled[u.request_id]]
            history.append([(u.request_id, u.new_token_ids, u.new_logprobs, u.finish_reason, u.stop_reason,
                             u.num_cached_tokens) for u in outs])
            step += 1
        return history

    expected = run(False)
    assert any(any(u[3] is not None for u in outs) for outs in expected)  # some requests did finish
    assert run(True) == expected
