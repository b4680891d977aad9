"""Suffix decoding: the bounded-depth suffix tree (exact counts, drafts on hand-made sequences) and the drafter's
request and global trees (incremental insertion, retirement, bounds). No model."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from deepinfer.engine.drafter import make_drafter
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.spec_config import SpeculativeConfig
from deepinfer.engine.suffix_drafter import SuffixDrafter
from deepinfer.engine.suffix_tree import SuffixTree
from deepinfer.protocol import FinishReason


def substring_counts(seqs, max_depth):
    """Occurrences of every substring of at most max_depth tokens: what SuffixTree.counts must give."""
    counts = Counter()
    for seq in seqs:
        for start in range(len(seq)):
            for stop in range(start + 1, min(start + max_depth, len(seq)) + 1):
                counts[tuple(seq[start:stop])] += 1
    return dict(counts)


def speculate(seqs, pattern, max_depth=24, k=8, factor=1.0, min_prob=0.1):
    tree = SuffixTree(max_depth)
    for i, seq in enumerate(seqs):
        tree.add(i, seq)
    candidate = tree.speculate(pattern, k, factor, min_prob)
    return candidate.token_ids, round(candidate.score, 4), candidate.match_len


def test_counts_of_a_tree_grown_in_pieces_then_trimmed_are_the_substring_counts():
    # Random small vocabularies (many repeats: lazy tails expand, interleaved sequences cross each other's tails).
    rng = random.Random(0)
    for _ in range(200):
        max_depth = rng.randint(1, 7)
        vocab = rng.randint(1, 4)
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(1, 4))]
        tree, grown = SuffixTree(max_depth), [0] * len(seqs)
        while any(n < len(s) for n, s in zip(grown, seqs, strict=True)):
            i, n = rng.randrange(len(seqs)), rng.randint(1, 3)
            tree.extend(i, seqs[i][grown[i] : grown[i] + n])
            grown[i] = min(len(seqs[i]), grown[i] + n)
        assert tree.counts() == substring_counts(seqs, max_depth)
        kept = list(range(len(seqs)))
        for i in rng.sample(kept, rng.randint(1, len(seqs))):
            tree.remove(i)
            kept.remove(i)
            assert tree.counts() == substring_counts([seqs[j] for j in kept], max_depth)
        tree.add("whole", seqs[0])
        assert tree.counts() == substring_counts([*(seqs[j] for j in kept), seqs[0]], max_depth)


def test_lazy_tails_keep_a_tree_of_distinct_tokens_at_one_node_per_token():
    tree = SuffixTree(24)
    tree.extend(0, range(1000))
    assert len(tree.root.children) == 1000
    assert all(child.children is None for child in tree.root.children.values())  # all lazy, none expanded
    assert tree.speculate([500], 4, 8.0, 0.1).token_ids == [501, 502, 503, 504]


# The context is the tree's own sequence, as in a request tree: its suffix occurs at its end too, where nothing
# follows, and that occurrence takes no share of the continuations' probabilities.
CONTEXT = [1, 2, 3, 4, 5, 8, 2, 6, 8, 2, 6, 1, 2]


@pytest.mark.parametrize(("seqs", "pattern", "kwargs", "want"), [
    # The longest match wins: "1 2" once before, then "3 4" (2 tokens, prob 1); "2" alone would say 6 (2 of 3).
    ([CONTEXT], CONTEXT, {"k": 4}, ([3, 4], 2.0, 2)),
    # The spec factor bounds the draft by the match: 2 matched tokens x 2.0 = 4 drafted, within k.
    ([CONTEXT], CONTEXT, {"k": 4, "factor": 2.0}, ([3, 4, 5, 8], 4.0, 2)),
    ([CONTEXT], CONTEXT, {"k": 3, "factor": 2.0}, ([3, 4, 5], 3.0, 2)),  # and k bounds it
    # Frequency: after "5" came 1 once and 2 twice.
    ([[5, 1, 5, 2, 5, 2, 7, 5]], [5, 1, 5, 2, 5, 2, 7, 5], {}, ([2], 0.6667, 1)),
    # A tie of counts: the continuation seen first.
    ([[5, 1, 5, 2, 7, 5]], [5, 1, 5, 2, 7, 5], {}, ([1], 0.5, 1)),
    ([[5, 2, 5, 1, 7, 5]], [5, 2, 5, 1, 7, 5], {}, ([2], 0.5, 1)),
    # Depth bounds match + draft: with depth 3 "1 2 3" has nothing below it and "3" drafts 2 tokens (factor 2);
    # with depth 24 the 3-token match drafts 4.
    ([[1, 2, 3, 4, 1, 2, 3]], [1, 2, 3, 4, 1, 2, 3], {"max_depth": 3, "k": 4, "factor": 2.0}, ([4, 1], 2.0, 1)),
    ([[1, 2, 3, 4, 1, 2, 3]], [1, 2, 3, 4, 1, 2, 3], {"k": 4, "factor": 2.0}, ([4, 1, 2, 3], 4.0, 3)),
    # Nothing recurs; an empty pattern.
    ([[1, 2, 3]], [1, 2, 3], {}, ([], 0.0, 0)),
    ([[1, 2, 3]], [], {}, ([], 0.0, 0)),
])
def test_speculate(seqs, pattern, kwargs, want):
    assert speculate(seqs, pattern, **kwargs) == want


@pytest.mark.parametrize(("min_prob", "want"), [
    (0.5, ([1, 2], 1.25, 1)),  # "0" -> 1 in 3 of 4, then "0 1" -> 2 in 2 of 3: 0.75, then 0.5
    (0.6, ([1], 0.75, 1)),  # 0.5 < 0.6: the draft stops after its first token
    (0.8, ([], 0.0, 0)),
])
def test_a_draft_stops_where_its_probability_falls_below_min_token_prob(min_prob, want):
    seqs = [[0, 1, 2], [0, 1, 2], [0, 1, 3], [0, 4, 4]]
    assert speculate(seqs, [0], k=3, factor=3.0, min_prob=min_prob) == want


def request(request_id, prompt, output=()):
    r = Request(request_id, list(prompt), sampling_params=None)
    r.append_output_token_ids(output)
    return r


def finish(r):
    r.finish(RequestStatus.FINISHED_STOPPED, FinishReason.STOP)


PROMPT = list(range(100, 130))  # 30 distinct tokens: nothing recurs inside a request
OUTPUT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]


def test_a_request_tree_grows_from_its_cursor_and_equals_a_rebuild():
    drafter = SuffixDrafter(max_tree_depth=6)
    rng = random.Random(1)
    r = request("r", [rng.randrange(5) for _ in range(20)])
    for _ in range(15):
        drafter.propose(r, 4)
        r.append_output_token_ids([rng.randrange(5) for _ in range(rng.randint(1, 3))])
    drafter.propose(r, 4)
    rebuilt = SuffixTree(6)
    rebuilt.extend(0, r.all_token_ids)
    assert drafter.request_tree("r").counts() == rebuilt.counts() == substring_counts([r.all_token_ids], 6)


def test_a_request_drafts_from_its_own_prompt_and_output():
    drafter = SuffixDrafter()
    r = request("r", [*PROMPT, *OUTPUT], OUTPUT[:3])  # the output starts to repeat the prompt's tail
    assert drafter.propose(r, 5).token_ids == OUTPUT[3:6]  # 3 matched tokens, factor 1: 3 drafted
    assert drafter.propose(r, 0).token_ids == []


def test_a_finished_request_s_output_drafts_the_same_request_sent_again():
    drafter = SuffixDrafter()
    first = request("a", PROMPT, OUTPUT)
    assert drafter.propose(first, 4).token_ids == []
    finish(first)
    again = request("b", PROMPT)  # no output yet: its prompt's tail matches the global tree
    assert drafter.propose(again, 4).token_ids == OUTPUT[:4]
    assert (drafter.num_live_requests, drafter.num_cached_requests) == (1, 1)
    again.append_output_token_ids(OUTPUT[:6])
    assert drafter.propose(again, 8).token_ids == OUTPUT[6:]  # the rest of the earlier output


def test_without_a_global_tree_nothing_crosses_requests():
    drafter = make_drafter(SpeculativeConfig(method="suffix", suffix_decoding_max_cached_requests=0))
    first = request("a", PROMPT, OUTPUT)
    drafter.propose(first, 4)
    finish(first)
    assert drafter.propose(request("b", PROMPT), 4).token_ids == []
    assert drafter.num_cached_requests == 0


def test_the_global_tree_keeps_the_latest_max_cached_requests():
    drafter = SuffixDrafter(max_cached_requests=2)
    outputs = {name: [base + i for i in range(8)] for name, base in (("a", 10), ("b", 20), ("c", 30))}
    for name, output in outputs.items():
        r = request(name, [*PROMPT, ord(name)], output)  # one prompt token apart
        drafter.propose(r, 4)
        finish(r)
    drafter.propose(request("probe", [0]), 4)  # retires c
    assert drafter.num_cached_requests == 2 and drafter.global_tree.num_sequences == 2
    drafts = {name: drafter.propose(request(f"{name}2", [*PROMPT, ord(name)]), 4).token_ids for name in outputs}
    assert drafts == {"a": [], "b": outputs["b"][:4], "c": outputs["c"][:4]}  # a, the oldest, is gone


def test_live_request_trees_are_bounded_least_recently_proposed_first():
    drafter = SuffixDrafter(max_live_requests=2)
    a, b, c = request("a", PROMPT, OUTPUT), request("b", [1, 2, 3], [4]), request("c", [5, 6], [7])
    for r in (a, b, a, c):  # b is the least recently proposed when c comes
        drafter.propose(r, 4)
    assert (drafter.request_tree("a") is not None, drafter.request_tree("b"), drafter.num_live_requests) == (
        True, None, 2)
    assert drafter.num_cached_requests == 1  # b's output went into the global tree


def test_a_request_id_that_comes_again_with_another_request_starts_a_new_tree():
    drafter = SuffixDrafter()
    first = request("r", PROMPT, OUTPUT)
    drafter.propose(first, 4)
    second = request("r", [1, 2, 3])
    assert drafter.propose(second, 4).token_ids == []
    assert drafter.request_tree("r").counts() == substring_counts([[1, 2, 3]], 24)
    assert drafter.num_cached_requests == 1  # the first one's output was kept


def test_unfinished_requests_keep_their_trees():
    drafter = SuffixDrafter()
    live = [request(f"r{i}", [i, i + 1], [i + 2]) for i in range(5)]
    for _ in range(3):
        for r in live:
            drafter.propose(r, 4)
    assert (drafter.num_live_requests, drafter.num_cached_requests) == (5, 0)
    finish(live[2])
    for r in live[:2]:  # the sweep comes within len(live) calls
        drafter.propose(r, 4)
    for r in live[3:]:
        drafter.propose(r, 4)
    assert (drafter.num_live_requests, drafter.num_cached_requests) == (4, 1)


def test_suffix_config_defaults_as_vllm_but_a_smaller_global_tree():
    config = SpeculativeConfig.of({"method": "suffix"})
    assert (config.num_speculative_tokens, config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests, config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob) == (24, 24, 1000, 1.0, 0.1)  # vLLM: 10000 (~2 GB here)
    drafter = make_drafter(SpeculativeConfig.of({
        "method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 8,
        "suffix_decoding_max_cached_requests": 3, "suffix_decoding_max_spec_factor": 2,
        "suffix_decoding_min_token_prob": 0.0}))
    assert isinstance(drafter, SuffixDrafter) and not drafter.has_probs
    assert (drafter.max_tree_depth, drafter.max_cached_requests, drafter.max_spec_factor,
            drafter.min_token_prob) == (8, 3, 2, 0.0)


@pytest.mark.parametrize(("setting", "message"), [
    ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth must be an int >= 1, got 0"),
    ({"suffix_decoding_max_tree_depth": 4.0}, "suffix_decoding_max_tree_depth must be an int >= 1, got 4.0"),
    ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests must be an int >= 0"),
    ({"suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor must be a number > 0, got 0"),
    ({"suffix_decoding_max_spec_factor": True}, "suffix_decoding_max_spec_factor must be a number > 0"),
    ({"suffix_decoding_min_token_prob": 1.5}, r"suffix_decoding_min_token_prob must be a number in \[0, 1\]"),
    ({"suffix_decoding_min_token_prob": "0.1"}, "suffix_decoding_min_token_prob must be a number"),
    ({"suffix_decoding_max_depth": 4}, "unknown keys"),
])
def test_bad_suffix_settings_name_what_is_wrong(setting, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.of({"method": "suffix", "num_speculative_tokens": 4, **setting})
