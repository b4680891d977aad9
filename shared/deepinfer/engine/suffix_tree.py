"""`SuffixTree`: the bounded-depth suffix tree of suffix decoding (SuffixDecoding, Oliaro et al. 2024; vLLM's
`suffix` method, after Arctic Inference's tree). No torch.

Every substring of at most `max_depth` tokens of the sequences it holds is a path from the root, and a node's
`count` is the number of occurrences of its path's string. Sequences grow a token at a time (`extend`): each suffix
still shorter than max_depth ("active", at most max_depth of them) extends by the new token, O(max_depth) a token.

Lazy tails: a string seen once has one continuation, the rest of its one occurrence, so a node of count 1 is not
expanded: it references that occurrence (its tokens and start) and its subtree is read from the tokens, growing
with them for free. A second occurrence expands it one token at a time. Invariant: along any occurrence's path the
first node not expanded references that occurrence. The tree then holds about one node per repeated substring and
one per suffix, not max_depth per token.

    tokens a b c a b d, max_depth 3        (n) count, ~ lazy: reads its occurrence's tokens
    root ┬ a(2) ─ b(2) ┬ c ~            "a b c" once
         │             └ d ~            "a b d" once (its tail ends with the tokens)
         ├ b(2) ┬ c ~ [a]               "b c a" once: the tail reads one token past the node
         │      └ d ~
         ├ c ~ [a b]
         └ d ~

`speculate` matches every suffix of a pattern (a request's last tokens: engine/suffix_drafter.py) and walks each
match's most frequent continuation; the draft whose tokens' probabilities sum highest wins (the longest match on a
tie).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass


class _Node:
    """One token of a path. Expanded: `children` maps the next token to its node. Lazy (count 1, children None):
    the path's one occurrence starts at `ref_start` in `ref_tokens`, which give the subtree."""

    __slots__ = ("count", "children", "ref_tokens", "ref_start")

    def __init__(self, ref_tokens: list[int] | None = None, ref_start: int = 0) -> None:
        self.count = 1
        self.children: dict[int, _Node] | None = None if ref_tokens is not None else {}
        self.ref_tokens = ref_tokens
        self.ref_start = ref_start


class _Sequence:
    """A sequence's tokens and its active suffixes: [deepest expanded node on the path, its depth, start]."""

    __slots__ = ("tokens", "active")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.active: list[tuple[_Node, int, int]] | None = []


@dataclass(slots=True)
class Candidate:
    """A draft and how it was found: `score` = the sum of its tokens' estimated probabilities (the expected number
    accepted if the tree's counts hold), `match_len` = the pattern suffix it continues."""

    token_ids: list[int]
    score: float = 0.0
    match_len: int = 0


class SuffixTree:
    """Suffix tree of depth at most `max_depth` over sequences keyed by id (module docstring)."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()
        self._seqs: dict[Hashable, _Sequence] = {}

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def num_sequences(self) -> int:
        """Sequences held."""
        return len(self._seqs)

    def num_nodes(self) -> int:
        """Nodes held, expanded and lazy (the root not counted): what the tree's memory grows with."""
        num_nodes, stack = 0, [self.root]
        while stack:
            children = stack.pop().children
            if children:
                num_nodes += len(children)
                stack.extend(children.values())
        return num_nodes

    def extend(self, seq_id: Hashable, token_ids: Iterable[int]) -> None:
        """Append tokens to a sequence (a new one if `seq_id` is not held yet)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = _Sequence()
        if seq.active is None:
            raise ValueError(f"sequence {seq_id!r} was added whole and cannot grow")
        for token_id in token_ids:
            self._append(seq, token_id)

    def add(self, seq_id: Hashable, token_ids: Iterable[int]) -> None:
        """Hold a whole sequence that will not grow (its active suffixes are not kept)."""
        self.extend(seq_id, token_ids)
        self._seqs[seq_id].active = None

    def remove(self, seq_id: Hashable) -> None:
        """Forget a sequence: every node on its suffixes' paths loses an occurrence; nodes left with none go."""
        tokens = self._seqs.pop(seq_id).tokens
        num_tokens = len(tokens)
        for start in range(num_tokens):
            node = self.root
            for pos in range(start, min(start + self.max_depth, num_tokens)):
                child = node.children[tokens[pos]]
                if child.ref_tokens is not None or child.count == 1:  # this occurrence's alone (lazy: its own)
                    del node.children[tokens[pos]]
                    break
                child.count -= 1
                node = child

    def speculate(self, pattern: Sequence[int], max_spec_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> Candidate:
        """The best draft continuing a suffix of `pattern`: each suffix of m <= max_depth tokens found in the tree
        drafts at most min(max_spec_tokens, m * max_spec_factor) tokens (match and draft within max_depth), each
        the most frequent next token (the first seen on a tie), until the draft's probability (the product of the
        continuations' shares of their node's occurrences that continue) falls below `min_token_prob`."""
        best = Candidate([])
        for match_len in range(1, min(len(pattern), self.max_depth) + 1):
            cursor = self._match(pattern, len(pattern) - match_len)
            if cursor is None:  # a longer suffix contains this one: none of them occurs either
                break
            max_tokens = min(max_spec_tokens, int(match_len * max_spec_factor + 1e-6))
            token_ids, score = self._walk(*cursor, max_tokens, min_token_prob)
            if token_ids and score >= best.score:
                best = Candidate(token_ids, score, match_len)
        return best

    def counts(self) -> dict[tuple[int, ...], int]:
        """Every string held (lazy tails read out) and its number of occurrences: for tests and debugging."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[_Node, tuple[int, ...]]] = [(child, (token,)) for token, child in self.root.children.items()]
        while stack:
            node, path = stack.pop()
            if node.ref_tokens is not None:
                end = min(len(node.ref_tokens), node.ref_start + self.max_depth)
                for stop in range(node.ref_start + len(path), end + 1):
                    out[tuple(node.ref_tokens[node.ref_start : stop])] = 1
                continue
            out[path] = node.count
            stack.extend((child, (*path, token)) for token, child in node.children.items())
        return out

    def _append(self, seq: _Sequence, token_id: int) -> None:
        """Extend every active suffix of `seq` (and the one the token starts) by `token_id`."""
        tokens = seq.tokens
        tokens.append(token_id)
        end = len(tokens) - 1  # the new token's index
        active = []
        for node, depth, start in (*seq.active, (self.root, 0, end)):
            # Catch up over nodes another occurrence expanded since this suffix last moved.
            while start + depth < end:
                child = node.children[tokens[start + depth]]
                if child.ref_tokens is not None:  # this suffix's own lazy tail: it grew with the tokens
                    break
                node, depth = child, depth + 1
            else:
                node, depth = self._extend_suffix(node, depth, token_id, tokens, start)
            if end + 1 - start < self.max_depth:
                active.append((node, depth, start))
        seq.active = active

    def _extend_suffix(self, node: _Node, depth: int, token_id: int, tokens: list[int],
                       start: int) -> tuple[_Node, int]:
        """The suffix at `start` of `tokens`, expanded to `node` (its end), takes `token_id`: its new deepest
        expanded node and depth."""
        child = node.children.get(token_id)
        if child is None:
            node.children[token_id] = _Node(tokens, start)
            return node, depth
        if child.ref_tokens is not None:
            if child.ref_tokens is tokens and child.ref_start == start:  # another suffix expanded into ours
                return node, depth
            self._expand(child, depth + 1)
        child.count += 1
        return child, depth + 1

    def _expand(self, node: _Node, depth: int) -> None:
        """A lazy node at `depth` becomes an expanded one; its occurrence's next token, if any, a lazy child."""
        ref_tokens, ref_start = node.ref_tokens, node.ref_start
        node.children, node.ref_tokens = {}, None
        if depth < self.max_depth and ref_start + depth < len(ref_tokens):
            node.children[ref_tokens[ref_start + depth]] = _Node(ref_tokens, ref_start)

    def _match(self, pattern: Sequence[int], start: int) -> tuple[_Node, int] | None:
        """Where pattern[start:] ends in the tree: (the deepest node on its path, the depth), or None."""
        node, depth = self.root, 0
        for pos in range(start, len(pattern)):
            token_id = pattern[pos]
            if node.ref_tokens is not None:
                ref_pos = node.ref_start + depth
                if ref_pos >= len(node.ref_tokens) or node.ref_tokens[ref_pos] != token_id:
                    return None
            else:
                child = node.children.get(token_id)
                if child is None:
                    return None
                node = child
            depth += 1
        return node, depth

    def _walk(self, node: _Node, depth: int, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation from (node, depth) and its score (`speculate`)."""
        token_ids: list[int] = []
        prob, score = 1.0, 0.0
        while len(token_ids) < max_tokens and depth < self.max_depth:
            if node.ref_tokens is not None:  # one occurrence: its next token, if it has one, with probability 1
                ref_pos = node.ref_start + depth
                if ref_pos >= len(node.ref_tokens):
                    break
                token_id = node.ref_tokens[ref_pos]
            else:
                if not node.children:
                    break
                token_id, child = max(node.children.items(), key=_count)
                prob *= child.count / sum(c.count for c in node.children.values())
                if prob < min_token_prob:
                    break
                node = child
            token_ids.append(token_id)
            score += prob
            depth += 1
        return token_ids, score


def _count(item: tuple[int, _Node]) -> int:
    return item[1].count
