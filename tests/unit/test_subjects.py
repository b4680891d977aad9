"""Subjects: spelled as in docs/architecture.md §3, model names made subject-safe, unsafe ids refused."""

from __future__ import annotations

import pytest

from deepinfer import subjects as s


@pytest.mark.parametrize(
    ("name", "token"),
    [
        ("smollm2-135m-instruct", "smollm2-135m-instruct"),
        ("SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
        ("Qwen/Qwen3-8B", "qwen-qwen3-8b"),
        ("llama 3.1:70b*", "llama-3-1-70b-"),
        ("a_b", "a_b"),
        ("Ünï", "-n-"),
    ],
)
def test_model_token(name: str, token: str):
    assert s.model_token(name) == token
    assert s.model_token(token) == token  # idempotent


@pytest.mark.parametrize("name", ["", "kvcache", "KVCache"])
def test_model_token_refuses_empty_and_reserved(name: str):
    with pytest.raises(ValueError):
        s.model_token(name)


def test_subjects_match_the_architecture_table():
    m, w, g = "Qwen/Qwen3-8B", "decode-a_1", "gw-7"
    assert s.route(m) == "di.qwen-qwen3-8b.route"
    assert s.decisions(m) == "di.qwen-qwen3-8b.decisions"
    assert s.prefill(m, w) == "di.qwen-qwen3-8b.prefill.decode-a_1"
    assert s.decode(m, w) == "di.qwen-qwen3-8b.decode.decode-a_1"
    assert s.tokens(m, g) == "di.qwen-qwen3-8b.tokens.gw-7"
    assert s.release(m, w) == "di.qwen-qwen3-8b.release.decode-a_1"
    assert s.cancel(m) == "di.qwen-qwen3-8b.cancel"
    assert s.kv_events(m, w) == "di.qwen-qwen3-8b.kv_events.decode-a_1"
    assert s.kv_events_all(m) == "di.qwen-qwen3-8b.kv_events.*"
    assert s.snapshot(m, w) == "di.qwen-qwen3-8b.snapshot.decode-a_1"
    assert s.heartbeat(m, w) == "di.qwen-qwen3-8b.heartbeat.decode-a_1"
    assert s.heartbeat_all(m) == "di.qwen-qwen3-8b.heartbeat.*"
    assert s.kvcache_lookup("3") == "di.kvcache.3.lookup"
    assert s.kvcache_events("3") == "di.kvcache.events.3"
    assert s.kvcache_events_all() == "di.kvcache.events.*"
    assert s.kvcache_heartbeat("3") == "di.kvcache.heartbeat.3"
    assert s.kvcache_heartbeat_all() == "di.kvcache.heartbeat.*"
    assert s.SCHEDULER_QUEUE == "scheduler"


@pytest.mark.parametrize(
    ("func", "kwarg"),
    [
        (s.prefill, "worker_id"),
        (s.decode, "worker_id"),
        (s.release, "worker_id"),
        (s.kv_events, "worker_id"),
        (s.snapshot, "worker_id"),
        (s.heartbeat, "worker_id"),
        (s.tokens, "gateway_id"),
    ],
)
@pytest.mark.parametrize("bad", ["", "a.b", "a*", "a>", "A1", "x y"])
def test_unsafe_ids_are_refused_by_name(func, kwarg: str, bad: str):
    with pytest.raises(ValueError, match=kwarg) as info:
        func("m", bad)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", ["", "a.b", "*", "events", "heartbeat"])
def test_unsafe_shards_are_refused(bad: str):
    for subject in (s.kvcache_lookup, s.kvcache_events, s.kvcache_heartbeat):
        with pytest.raises(ValueError, match="shard"):
            subject(bad)


def test_per_worker_subjects_are_single_tokens_under_their_wildcard():
    # A worker's subject must match the wildcard the scheduler subscribes to: exactly one extra token.
    sub, wildcard = s.kv_events("m", "w-1"), s.kv_events_all("m")
    assert sub.split(".")[:-1] == wildcard.split(".")[:-1] and wildcard.endswith(".*")
    assert len(s.kvcache_events("0").split(".")) == len(s.kvcache_events_all().split("."))
