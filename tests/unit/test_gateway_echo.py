"""Completions' echo and the prompt's logprobs over scripted workers (FakeWorkers score a prompt's position i at
-i/8, rank k + 1, alternatives 1..k at -1/32, -2/32, ...): OpenAI's legacy logprobs with the prompt first, vLLM's
prompt_logprobs on completions and chat, batched prompts, max_tokens 0, streaming, and the 400s and 413s."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from deepinfer.testing import FakeBroker, FakeBus
from deepinfer.testing.checkpoints import write_tokenizer_dir
from tests.gateway_harness import MODEL, Harness, make_harness

PROMPT = "The quick brown fox"
IDS = [70, 80, 90, 100, 110]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(params=[True, False], ids=["prefill", "decode-only"])
async def harness(model_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """Prompts computed by the prefill worker, or by the decode worker when there is none."""
    h = await make_harness(model_dir, use_prefill=request.param)
    yield h
    await h.fake.stop()


def text(h: Harness, token_id: int) -> str:
    return h.tokenizer.decode([token_id], skip_special_tokens=False)


async def completion(h: Harness, **body) -> dict:
    async with h.http() as http:
        response = await http.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def prompt_positions(h: Harness, ids: list[int], k: int) -> dict:
    """The legacy lists of a prompt as the fake workers score it."""
    tokens = [text(h, t) for t in ids]
    tops = [None] + [{tokens[i]: -i / 8, **{text(h, j): -j / 32 for j in range(1, k + 1)}} for i in range(1, len(ids))]
    return {"tokens": tokens, "token_logprobs": [None] + [-i / 8 for i in range(1, len(ids))], "top_logprobs": tops}


async def test_echo_text_and_logprobs_put_the_prompt_first(harness: Harness):
    h = harness
    body = await completion(h, prompt=PROMPT, max_tokens=3, echo=True, logprobs=2)
    ids, answer = h.tokenizer.encode(PROMPT), h.fake.output_token_ids[:3]
    choice = body["choices"][0]
    assert choice["text"] == PROMPT + h.tokenizer.decode(answer)
    logprobs, expected = choice["logprobs"], prompt_positions(h, ids, 2)
    assert logprobs["tokens"] == expected["tokens"] + [text(h, t) for t in answer]
    assert logprobs["token_logprobs"] == expected["token_logprobs"] + [-0.5] * 3
    assert logprobs["top_logprobs"][: len(ids)] == expected["top_logprobs"]
    # a generated token: its own, then the top 2 (the fake's own id is its first alternative: merged)
    assert logprobs["top_logprobs"][len(ids)] == {text(h, answer[0]): -0.5, text(h, answer[0] + 1): -1.0}
    assert logprobs["text_offset"] == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(ids) + 3)]
    assert "prompt_logprobs" not in choice  # vLLM's field only when asked
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 3
    sampling = (h.fake.prefill_requests or h.fake.decode_requests)[0].sampling
    assert sampling.prompt_logprobs == 2  # echo with logprobs asks the prompt's scores of the worker computing it
    if h.fake.prefill_requests:  # ... and only of it: the decode worker continues from the prefill's KV
        assert h.fake.decode_requests[0].sampling.prompt_logprobs is None


async def test_echo_without_logprobs_asks_no_scores(harness: Harness):
    h = harness
    body = await completion(h, prompt=IDS, max_tokens=2, echo=True)
    assert body["choices"][0]["text"] == h.tokenizer.decode(IDS, skip_special_tokens=False) + h.tokenizer.decode(
        h.fake.output_token_ids[:2])
    assert body["choices"][0]["logprobs"] is None
    assert all(r.sampling.prompt_logprobs is None for r in h.fake.prefill_requests + h.fake.decode_requests)


async def test_max_tokens_0_scores_the_prompt_alone(harness: Harness):
    """lm-eval's loglikelihood_rolling asks this: the prompt's logprobs, nothing generated."""
    h = harness
    body = await completion(h, prompt=[IDS, IDS[:2]], max_tokens=0, echo=True, logprobs=1)
    for choice, ids in zip(body["choices"], [IDS, IDS[:2]], strict=True):
        expected = prompt_positions(h, ids, 1)
        assert choice["text"] == h.tokenizer.decode(ids, skip_special_tokens=False)
        assert choice["finish_reason"] == "length"
        assert choice["logprobs"]["tokens"] == expected["tokens"]
        assert choice["logprobs"]["token_logprobs"] == expected["token_logprobs"]
        assert choice["logprobs"]["top_logprobs"] == expected["top_logprobs"]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0, "cached_tokens_by_tier": {}}}
    assert {r.sampling.max_tokens for r in h.fake.prefill_requests + h.fake.decode_requests} == {1}


async def test_a_batch_of_prompts_numbers_choices_by_prompt_then_n(model_dir: Path):
    """lm-eval's local-completions batches its requests: choice i * n + j is prompt i's j-th."""
    h = await make_harness(model_dir, num_cached_tokens=2)
    prompts = [IDS, IDS[:3], [120, 130]]
    body = await completion(h, prompt=prompts, max_tokens=2, n=2, echo=True, logprobs=0, seed=5)
    assert [c["index"] for c in body["choices"]] == list(range(6))
    answer = h.tokenizer.decode(h.fake.output_token_ids[:2])
    for choice in body["choices"]:
        ids = prompts[choice["index"] // 2]
        assert choice["text"] == h.tokenizer.decode(ids, skip_special_tokens=False) + answer
        assert choice["logprobs"]["tokens"][: len(ids)] == [text(h, t) for t in ids]
        assert all(top is None or len(top) == 1 for top in choice["logprobs"]["top_logprobs"])  # logprobs 0: its own
    assert body["usage"]["prompt_tokens"] == 10 and body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 6  # once per prompt
    seeds = {r.request_id: r.sampling.seed for r in h.fake.prefill_requests}
    assert len(seeds) == 6 and len(set(seeds.values())) == 2  # prompt alone's seeds: choice j of each prompt alike
    await h.fake.stop()


async def test_a_streamed_echo_starts_each_choice_with_its_prompt(harness: Harness):
    h = harness
    client = h.openai()
    stream = await client.completions.create(model=MODEL, prompt=[PROMPT, "Hi there"], max_tokens=4, echo=True,
                                             logprobs=1, stream=True)
    texts, tokens, offsets = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}
    firsts: dict[int, str] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice.text)
            texts[choice.index] += choice.text
            if choice.logprobs is not None:
                tokens[choice.index] += choice.logprobs.tokens
                offsets[choice.index] += choice.logprobs.text_offset
    answer = h.tokenizer.decode(h.fake.output_token_ids[:4])
    prompts = {0: PROMPT, 1: "Hi there"}
    for index, prompt_ids in ((0, h.tokenizer.encode(PROMPT)), (1, h.tokenizer.encode("Hi there"))):
        assert firsts[index].startswith(prompts[index])
        assert texts[index] == prompts[index] + answer
        assert tokens[index] == [text(h, t) for t in prompt_ids + h.fake.output_token_ids[:4]]
        assert offsets[index] == [sum(len(t) for t in tokens[index][:i]) for i in range(len(tokens[index]))]


async def test_vllm_prompt_logprobs_on_completions_and_chat(harness: Harness):
    h = harness
    body = await completion(h, prompt=IDS, max_tokens=2, prompt_logprobs=2)
    choice = body["choices"][0]
    assert choice["text"] == h.tokenizer.decode(h.fake.output_token_ids[:2])  # no echo: the completion alone
    assert choice["prompt_logprobs"][0] is None
    for i, position in enumerate(choice["prompt_logprobs"][1:], start=1):
        assert position == {
            str(IDS[i]): {"logprob": -i / 8, "rank": 3, "decoded_token": text(h, IDS[i])},
            "1": {"logprob": -1 / 32, "rank": 1, "decoded_token": text(h, 1)},
            "2": {"logprob": -2 / 32, "rank": 2, "decoded_token": text(h, 2)},
        }
    async with h.http() as http:
        chat = (await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 2, "prompt_logprobs": 0,
            "max_tokens": 2})).json()
    ids = h.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert len(chat["prompt_logprobs"]) == len(ids) and chat["prompt_logprobs"][0] is None  # once, beside choices
    assert chat["prompt_logprobs"][1] == {str(ids[1]): {"logprob": -1 / 8, "rank": 1, "decoded_token": text(h, ids[1])}}
    assert all("prompt_logprobs" not in c for c in chat["choices"])
    plain = await completion(h, prompt=IDS, max_tokens=2)
    assert "prompt_logprobs" not in plain["choices"][0]


async def test_a_resumed_request_asks_no_scores_again(model_dir: Path):
    """Migrated after a token was sent: the new decode worker continues; the prompt's scores came already."""
    fast = {"stream_timeout_s": 0.3, "first_token_timeout_s": 0.3, "poll_interval_s": 0.02, "retry_after_s": 0.05}
    h = await make_harness(model_dir, settings=fast, use_prefill=False, tokens_per_step=1, stall_after=2,
                           num_stalls=1)
    body = await completion(h, prompt=IDS, max_tokens=5, echo=True, logprobs=1)
    first, resumed = h.fake.decode_requests
    assert first.sampling.prompt_logprobs == 1 and resumed.sampling.prompt_logprobs is None
    assert resumed.output_token_ids == h.fake.output_token_ids[:2]
    assert body["choices"][0]["logprobs"]["token_logprobs"][: len(IDS)] == prompt_positions(h, IDS, 1)[
        "token_logprobs"]
    assert body["choices"][0]["text"] == (h.tokenizer.decode(IDS, skip_special_tokens=False)
                                          + h.tokenizer.decode(h.fake.output_token_ids[:5]))
    await h.fake.stop()


async def test_a_worker_that_sends_no_scores_is_an_error_not_a_null(model_dir: Path, monkeypatch):
    """A worker of protocol < 2.7 ignores prompt_logprobs: the client gets a 502, never a silent null."""
    import deepinfer.testing.fake_workers as fake_workers

    monkeypatch.setattr(fake_workers, "fake_prompt_logprobs", lambda prompt_token_ids, sampling: None)
    h = await make_harness(model_dir)
    async with h.http() as http:
        response = await http.post("/v1/completions", json={"model": MODEL, "prompt": IDS, "echo": True,
                                                              "logprobs": 1, "max_tokens": 1})
    assert response.status_code == 502
    assert "prompt logprobs" in response.json()["error"]["message"]
    await h.fake.stop()


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": IDS, "max_tokens": 0}, "max_tokens"),  # nothing to generate and nothing echoed
    ({"prompt": IDS, "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),  # vLLM: not streamed
    ({"prompt": IDS, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": IDS, "prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's "every token": refused, not 150k entries
    ({"prompt": IDS, "echo": True, "suffix": "!"}, "suffix"),
    ({"prompt": IDS, "echo": True, "best_of": 2}, "best_of"),
    ({"prompt": [IDS] * 257}, "prompt"),
    ({"prompt": [IDS, [999]]}, "prompt"),  # a batch's token ids are checked like one prompt's
    ({"prompt": [PROMPT, ""], "echo": True}, "prompt"),
])
async def test_bad_input_is_a_400_naming_the_field(model_dir: Path, body: dict, param: str):
    h = await make_harness(model_dir)
    async with h.http() as http:
        response = await http.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert h.fake.route_requests == []
    await h.fake.stop()


async def test_chat_prompt_logprobs_are_not_streamed(model_dir: Path):
    h = await make_harness(model_dir)
    async with h.http() as http:
        response = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 1, "stream": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs"
    await h.fake.stop()


async def test_scores_too_large_for_one_message_are_a_413(model_dir: Path):
    broker = FakeBroker(max_payload=16 << 10)  # 90 positions x 20 alternatives do not fit, x 1 do
    h = await make_harness(model_dir, gateway_bus=FakeBus(broker, "gateway"), worker_bus=FakeBus(broker, "workers"))
    async with h.http() as http:
        response = await http.post("/v1/completions", json={"model": MODEL, "prompt": [7] * 90, "max_tokens": 1,
                                                              "prompt_logprobs": 20})
        assert response.status_code == 413, response.text
        assert response.json()["error"]["param"] == "prompt_logprobs"
        fits = await http.post("/v1/completions", json={"model": MODEL, "prompt": [7] * 90, "max_tokens": 1,
                                                          "prompt_logprobs": 1})
        assert fits.status_code == 200, fits.text
    await h.fake.stop()


def test_alike_texts_keep_the_larger_logprob():
    """Two tokens of one text (parts of a character) share a top_logprobs key: it keeps the larger logprob, so the
    largest value is the position's most likely token's (lm-eval's greedy check)."""
    from types import SimpleNamespace

    from services.gateway.output import completion_logprobs

    texts = {1: "\ufffd", 2: "\ufffd", 3: "a"}
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: texts[ids[0]])
    logprobs, offset = completion_logprobs(tokenizer, [(1, -9.0, [(2, -0.5), (3, -1.0)]), (3, float("-inf"), [])],
                                           0, 2)
    assert logprobs.top_logprobs == [{"\ufffd": -0.5, "a": -1.0}, {"a": -9999.0}]
    assert logprobs.token_logprobs == [-9.0, -9999.0]  # -inf has no JSON form: OpenAI's and vLLM's floor
    assert offset == 2
