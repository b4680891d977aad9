"""deepinfer.tokenizer against transformers' tokenizer on the prepared default model, plus streaming."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from deepinfer.tokenizer import ChatTemplateError, IncrementalDetokenizer, StopChecker, Tokenizer

TEXTS = [
    "Hello, world!",
    "  two leading spaces and\ttabs\n\nnew lines  ",
    "émigré café, naïve Zoë — àéîõü ÀÉÎÕÜ",
    "😀 👍🏽 👩‍💻 🇯🇵 ❤️",
    "中文分词测试，日本語のテキスト、한국어 문장",
    "def add(a, b):\n    return a + b  # sum\n",
    "<|im_start|>user\nhello<|im_end|>\n<|endoftext|>",
]
STREAM_TEXTS = [
    "Ça va? Très bien, merci — naïve façade, Zoë!",
    "東京は日本の首都です。中文：你好，世界！",
    "Party 🎉🎉 time 👩‍👩‍👧‍👦 with flags 🇫🇷🇩🇪 and skin 👋🏿",
]
CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is the capital of France?"}],
    "system_multi_turn": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And Japan? 🗾"},
    ],
}


@pytest.fixture(scope="module")
def ours(prepared_dir):
    return Tokenizer.from_dir(prepared_dir)


@pytest.fixture(scope="module")
def reference(prepared_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepared_dir)


def _copy_tokenizer_dir(prepared_dir, target, **config_changes):
    target.mkdir()
    (target / "tokenizer.json").symlink_to(prepared_dir / "tokenizer.json")
    (target / "generation_config.json").symlink_to(prepared_dir / "generation_config.json")
    config = json.loads((prepared_dir / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def test_encode_decode_match_transformers(ours, reference):
    for text in TEXTS:
        for add_special_tokens in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special_tokens)
            assert ids == reference.encode(text, add_special_tokens=add_special_tokens), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, reference, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == reference.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, return_dict=False
    )


def test_special_ids_and_sizes(ours, reference):
    assert ours.bos_token_id == reference.bos_token_id == 1
    assert ours.eos_token_ids == {reference.eos_token_id} == {2}
    assert ours.pad_token_id == reference.pad_token_id
    assert ours.vocab_size == len(reference)
    assert set(reference.all_special_ids) <= set(ours.all_special_ids)
    assert all(ours.decode([i]) == "" for i in ours.all_special_ids)


def test_template_features_match_transformers(ours, reference):
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
        "[{{ m.role }}]{{ m.content | tojson }}{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
        "{% set ns = namespace(n=0) %}{% for t in tools or [] %}{% set ns.n = ns.n + 1 %}{{ t | tojson(indent=1) }}"
        "{% endfor %}<{{ ns.n }}>{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    messages = [{"role": "user", "content": "<b>&'é😀\"</b>"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "Zürich"}}}]
    kwargs = {"chat_template": template, "tools": tools, "add_generation_prompt": True}
    text = ours.apply_chat_template(messages, **kwargs)
    assert text == reference.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text.startswith("<|im_start|>[user]") and "Zürich" in text
    with pytest.raises(ChatTemplateError, match="bad role") as excinfo:
        ours.apply_chat_template([{"role": "bad", "content": "x"}], chat_template=template)
    assert isinstance(excinfo.value, ValueError)
    with pytest.raises(ValueError, match="does not compile"):
        ours.apply_chat_template(messages, chat_template="{% for %}")
    with pytest.raises(ValueError, match="empty conversation"):
        ours.apply_chat_template([])
    assert ours.apply_chat_template(messages, chat_template="{{ strftime_now('%Y') }}") == time.strftime("%Y")


def test_template_from_jinja_file_and_named_list(prepared_dir, tmp_path):
    from transformers import AutoTokenizer

    named = [{"name": "default", "template": "D{{ messages[0].content }}"},
             {"name": "tool_use", "template": "T{{ messages[0].content }}"}]
    listed = _copy_tokenizer_dir(prepared_dir, tmp_path / "listed", chat_template=named)
    messages = [{"role": "user", "content": "x"}]
    assert Tokenizer.from_dir(listed).apply_chat_template(messages) == "Dx"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert Tokenizer.from_dir(listed).apply_chat_template(messages, tools=tools) == "Tx"
    assert AutoTokenizer.from_pretrained(listed).apply_chat_template(messages, tools=tools, tokenize=False) == "Tx"
    (listed / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert Tokenizer.from_dir(listed).apply_chat_template(messages) == "Jx"
    assert AutoTokenizer.from_pretrained(listed).apply_chat_template(messages, tokenize=False) == "Jx"


def test_bos_from_post_processor_and_no_double_bos_like_transformers(prepared_dir, tmp_path):
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import processors
    from transformers import AutoTokenizer

    template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    # transformers 5 ignores tokenizer_config's add_bos_token when there is a tokenizer.json: its
    # post-processor decides, so that is where a BOS-adding model says so.
    model_dir = _copy_tokenizer_dir(prepared_dir, tmp_path / "bos", add_bos_token=False, chat_template=template)
    backend = BackendTokenizer.from_file(str(prepared_dir / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|>:0 $A:0", pair="<|im_start|>:0 $A:0 <|im_start|>:1 $B:1", special_tokens=[("<|im_start|>", 1)]
    )
    (model_dir / "tokenizer.json").unlink()
    backend.save(str(model_dir / "tokenizer.json"))
    ours, reference = Tokenizer.from_dir(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert ours.encode("hi") == reference.encode("hi") == [ours.bos_token_id, *ours.encode("hi", False)]
    messages = [{"role": "user", "content": "hi"}]
    ids = ours.encode_chat(messages)
    assert ids == reference.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids.count(ours.bos_token_id) == 1


def test_eos_ids_include_generation_config(prepared_dir, tmp_path):
    model_dir = _copy_tokenizer_dir(prepared_dir, tmp_path / "eos")
    (model_dir / "generation_config.json").unlink()
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_dir(model_dir).eos_token_ids == {0, 2}


@pytest.mark.parametrize("text", STREAM_TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenizer_equals_full_decode(ours, text, chunk):
    output_ids = ours.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(ours, ours.encode("Say something:"), skip_special_tokens=True)
    deltas = [detokenizer.step(output_ids[i : i + chunk]) for i in range(0, len(output_ids), chunk)]
    assert "".join(deltas) == ours.decode(output_ids) == text
    assert not any("\ufffd" in delta for delta in deltas)
    if chunk == 1:
        assert "" in deltas  # some characters really did span several tokens and were held back
    assert detokenizer.flush() == ""


def test_output_text_is_every_delta_so_far_whenever_it_is_read(ours):
    from deepinfer.protocol import TokenChunk, WireSamplingParams
    from services.gateway.output import ChoiceOutput

    output_ids = ours.encode("".join(STREAM_TEXTS), add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(ours, [])
    choice = ChoiceOutput(0, ours, [], WireSamplingParams(max_tokens=None))
    emitted, chosen = "", ""
    for n, token_id in enumerate(output_ids):
        emitted += detokenizer.step([token_id])
        chosen += choice.add(TokenChunk(request_id="r", token_ids=[token_id])).text
        if n % 7 == 0:  # read between steps: the pieces so far are joined, later ones appended after them
            assert detokenizer.output_text == emitted and choice.text == chosen
    assert detokenizer.output_text == emitted == ours.decode(output_ids)
    assert choice.text == chosen == emitted


def test_incremental_detokenizer_skips_special_tokens_and_flushes(ours):
    middle = ours.encode("Paris 🇫🇷", add_special_tokens=False)
    output_ids = [*middle, ours.eos_token_id]
    for skip in (True, False):
        detokenizer = IncrementalDetokenizer(ours, [], skip_special_tokens=skip)
        text = "".join(detokenizer.step([i]) for i in output_ids)
        assert text == ours.decode(output_ids, skip_special_tokens=skip)
    # A stream that ends mid-character: held back while streaming, released (as U+FFFD) by flush.
    truncated = ours.encode("ok 😀", add_special_tokens=False)[:-1]
    detokenizer = IncrementalDetokenizer(ours, [])
    streamed = "".join(detokenizer.step([i]) for i in truncated)
    assert "\ufffd" not in streamed
    assert streamed + detokenizer.flush() == ours.decode(truncated)


def test_step_each_equals_one_step_per_token(ours):
    import random

    rng = random.Random(0)
    streams = [ours.encode("".join(STREAM_TEXTS), add_special_tokens=False),
               [*ours.encode("Paris 🇫🇷", add_special_tokens=False), ours.eos_token_id, *ours.encode(" ok 😀")[:-1]],
               [rng.randrange(ours.vocab_size) for _ in range(300)]]  # random ids: broken characters, specials
    for ids in streams:
        for skip in (True, False):
            one = IncrementalDetokenizer(ours, [], skip_special_tokens=skip)
            expected = [one.step([t]) for t in ids]
            for cut in (0, 1, 17, len(ids) // 2, len(ids)):  # token by token up to `cut`, then the rest at once
                each = IncrementalDetokenizer(ours, [], skip_special_tokens=skip)
                head = "".join(each.step([t]) for t in ids[:cut])
                assert head + each.step_each(ids[cut:]) == "".join(expected)
                assert (each._prefix_offset, each._read_offset) == (one._prefix_offset, one._read_offset)
                assert each.output_text == one.output_text and each.output_token_ids == one.output_token_ids
            assert each.flush() == one.flush()


def test_stop_checker_partial_suffix_equals_every_length_tried():
    import random

    def reference(stops, buffer):  # the scan before the by-last-character table
        longest = 0
        for stop in stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    rng = random.Random(1)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(0, 6))) for _ in range(rng.randint(0, 3))]
        buffer = "".join(rng.choice("ab\nc") for _ in range(rng.randint(0, 8)))
        checker = StopChecker(stops)
        assert checker._partial_suffix_len(buffer) == reference(checker.stop, buffer), (stops, buffer)


def _run_stop(chunks, stop, include=False):
    checker = StopChecker(stop, include_stop_str_in_output=include)
    emitted, stopped = [], False
    for chunk in chunks:
        text, stopped = checker.step(chunk)
        emitted.append(text)
        if stopped:
            break
    if not stopped:
        emitted.append(checker.flush())
    return emitted, stopped, checker.matched_stop


def test_stop_checker_across_chunk_boundaries():
    emitted, stopped, matched = _run_stop(["Hello ST", "O", "P and more"], ["STOP"])
    assert stopped and matched == "STOP" and "".join(emitted) == "Hello "
    assert emitted == ["Hello ", "", ""]  # "ST" and "STO" were held back, never emitted
    emitted, stopped, _ = _run_stop(["Hello ST", "O", "P and more"], ["STOP"], include=True)
    assert "".join(emitted) == "Hello STOP"
    emitted, stopped, _ = _run_stop(["a S", "T", "x end"], ["STOP"])
    assert not stopped and "".join(emitted) == "a STx end"
    emitted, stopped, _ = _run_stop(["tail S"], ["STOP"])
    assert not stopped and emitted == ["tail ", "S"]


def test_stop_checker_earliest_and_longest_match():
    emitted, _, matched = _run_stop(["one two three"], ["three", "two"])
    assert "".join(emitted) == "one " and matched == "two"
    emitted, _, matched = _run_stop(["ab", "cd"], ["abcd", "abc", "bc"])
    assert "".join(emitted) == "" and matched == "abc"
    emitted, _, matched = _run_stop(["xab", "cd"], ["bcd", "abcd"])
    assert "".join(emitted) == "x" and matched == "abcd"
    emitted, _, matched = _run_stop(["x\n\n", "y"], ["\n\n", ""])
    assert "".join(emitted) == "x" and matched == "\n\n"
    checker = StopChecker(["END"])
    assert checker.step("doneEND") == ("done", True)
    assert checker.step("more") == ("", True)


def test_stop_checker_with_detokenized_stream(ours):
    text = "The answer is 42.\nObservation: done"
    ids = ours.encode(text, add_special_tokens=False)
    detokenizer, checker = IncrementalDetokenizer(ours, []), StopChecker(["\nObservation:"])
    emitted = ""
    for token_id in ids:
        delta, stopped = checker.step(detokenizer.step([token_id]))
        emitted += delta
        if stopped:
            break
    assert stopped and emitted == "The answer is 42."


def test_works_without_torch_or_transformers(prepared_dir):
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "from deepinfer.tokenizer import Tokenizer, IncrementalDetokenizer, StopChecker\n"
        "t = Tokenizer.from_dir(sys.argv[1])\n"
        "ids = t.encode_chat([{'role': 'user', 'content': 'hi'}])\n"
        "d = IncrementalDetokenizer(t, ids)\n"
        "assert ''.join(d.step([i]) for i in t.encode('héllo 😀')) == 'héllo 😀'\n"
        "assert StopChecker(['!']).step('a!b') == ('a', True)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(prepared_dir)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_a_long_text_is_encoded_with_the_gil_released(ours):
    import threading

    text = "Hello, world! This is a long prompt. " * 20_000  # 740k characters, ~0.5 s of encoding
    assert len(text) > 4096
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:  # what an event loop beside the tokenizer thread sees
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.monotonic()
    token_ids = ours.encode(text, add_special_tokens=False)
    seconds = time.monotonic() - started
    done.set()
    ticker.join()
    assert token_ids == ours.backend.encode(text, add_special_tokens=False).ids
    assert max(gaps) < max(0.1, seconds / 4), (max(gaps), seconds)  # holding the GIL: one gap of `seconds`
