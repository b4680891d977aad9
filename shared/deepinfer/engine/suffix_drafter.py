"""`SuffixDrafter`: suffix decoding (vLLM's `suffix` method; SuffixDecoding, Oliaro et al. 2024). No torch.

Two kinds of bounded-depth suffix trees (engine/suffix_tree.py) answer each `propose`:

    request tree   one per live request: its prompt and output so far, extended from a cursor by the tokens
                   appended since its last propose (never rebuilt)
    global tree    the last `max_cached_requests` retired requests, each as its prompt's last max_tree_depth
                   tokens and its output (so a request sent again is drafted from its first output token on);
                   oldest out first; none when max_cached_requests = 0

Each tree drafts its best candidate for the context's last max_tree_depth tokens (SuffixTree.speculate: at most
min(k, max_spec_factor * match length) tokens, cut where the draft's probability falls below min_token_prob); the
higher score wins, the request tree on a tie.

Retiring a request (its tree dropped, its tokens into the global tree). Drafters are not told when a request ends,
so the drafter keeps the `Request` it was asked about and retires it once that request is finished (looked at when
a new request is first proposed for, and every len(live) calls otherwise), when the same request id comes with
another Request (its tokens are not a continuation), or when more than `max_live_requests` are live (the least
recently proposed goes). A preempted request keeps its tree (its tokens only grow). vLLM / Arctic Inference add
a live request's output to the global tree as it is generated; here it goes in when the request retires, so
concurrent requests do not draft from each other.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import count
from typing import TYPE_CHECKING

from deepinfer.engine.drafter import NO_DRAFT, Draft
from deepinfer.engine.suffix_tree import SuffixTree

if TYPE_CHECKING:
    from deepinfer.engine.request import Request

#: Request trees kept at most (the least recently proposed retires first): a bound for requests the drafter never
#: sees finish (moved away, dropped), far above any batch.
MAX_LIVE_REQUESTS = 4096


class _RequestTree:
    """A live request's tree and how many of its tokens it holds."""

    __slots__ = ("request", "tree", "num_inserted")

    def __init__(self, request: Request, max_depth: int) -> None:
        self.request = request
        self.tree = SuffixTree(max_depth)
        self.num_inserted = 0

    def catch_up(self) -> None:
        """Insert the tokens appended since the last call."""
        token_ids = self.request.all_token_ids
        if len(token_ids) > self.num_inserted:
            self.tree.extend(0, token_ids[self.num_inserted :])
            self.num_inserted = len(token_ids)


class SuffixDrafter:
    """Drafts from the request's own tokens and from recent requests' outputs (module docstring)."""

    has_probs = False

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 1000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, max_live_requests: int = MAX_LIVE_REQUESTS) -> None:
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_live_requests = max_live_requests
        self.global_tree = SuffixTree(max_tree_depth)
        #: Global tree sequence ids, oldest first (ids of their own: a request id may come again).
        self._cached: deque[int] = deque()
        self._next_seq_id = count()
        #: request_id -> its tree, least recently proposed first.
        self._live: OrderedDict[str, _RequestTree] = OrderedDict()
        self._calls_until_sweep = 0

    @property
    def num_live_requests(self) -> int:
        """Requests with a tree of their own."""
        return len(self._live)

    @property
    def num_cached_requests(self) -> int:
        """Retired requests in the global tree."""
        return len(self._cached)

    def request_tree(self, request_id: str) -> SuffixTree | None:
        """The live request's tree (None when it has none): for tests and debugging."""
        state = self._live.get(request_id)
        return None if state is None else state.tree

    def propose(self, request: Request, num_tokens: int) -> Draft:
        """The better of the request tree's and the global tree's drafts (NO_DRAFT when neither has one)."""
        state = self._request_tree(request)
        state.catch_up()
        if num_tokens <= 0:
            return NO_DRAFT
        pattern = request.all_token_ids[-self.max_tree_depth :]
        args = (pattern, num_tokens, self.max_spec_factor, self.min_token_prob)
        best = state.tree.speculate(*args)
        if self._cached:
            other = self.global_tree.speculate(*args)
            if other.score > best.score:
                best = other
        return Draft(best.token_ids) if best.token_ids else NO_DRAFT

    def _request_tree(self, request: Request) -> _RequestTree:
        """The request's tree (a new one for a request not live, or live under its id as another Request), after
        retiring finished requests when it is due (module docstring)."""
        request_id = request.request_id
        state = self._live.get(request_id)
        if state is not None and state.request is not request:
            self._retire(request_id)
            state = None
        self._calls_until_sweep -= 1
        if state is None or self._calls_until_sweep <= 0:
            self._retire_finished()
            self._calls_until_sweep = len(self._live) + 1
        if state is None:
            state = self._live[request_id] = _RequestTree(request, self.max_tree_depth)
            while len(self._live) > self.max_live_requests:
                self._retire(next(iter(self._live)))
        else:
            self._live.move_to_end(request_id)
        return state

    def _retire_finished(self) -> None:
        for request_id in [rid for rid, state in self._live.items() if state.request.is_finished]:
            self._retire(request_id)

    def _retire(self, request_id: str) -> None:
        """Drop the request's tree; its prompt's tail and its output join the global tree (oldest out beyond
        max_cached_requests)."""
        request = self._live.pop(request_id).request
        if self.max_cached_requests == 0 or not request.output_token_ids:
            return
        seq_id = next(self._next_seq_id)
        self.global_tree.add(seq_id, [*request.prompt_token_ids[-self.max_tree_depth :], *request.output_token_ids])
        self._cached.append(seq_id)
        while len(self._cached) > self.max_cached_requests:
            self.global_tree.remove(self._cached.popleft())
