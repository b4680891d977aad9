"""Stop strings over a text stream: found even when split across chunks, never half-emitted."""

from __future__ import annotations


class StopChecker:
    """Feeds text deltas through; stops at the first stop string and holds back a possible partial one.

    Invariant: emitted text never ends with a proper prefix of a stop string, so a stop string that
    straddles two chunks is still found whole in the held text plus the next chunk.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in dict.fromkeys(stop) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped = False
        self.matched_stop: str | None = None
        self._held = ""
        #: Per last character: the proper prefixes of the stop strings that end in it, longest first. A suffix of
        #: the text that is such a prefix ends in the text's last character, so only these are tried (a step
        #: tried every length of every stop string).
        prefixes: dict[str, list[str]] = {}
        for stop in self.stop:
            for size in range(1, len(stop)):
                prefixes.setdefault(stop[size - 1], []).append(stop[:size])
        self._prefixes_by_last = {char: sorted(set(p), key=len, reverse=True) for char, p in prefixes.items()}

    def step(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was reached)."""
        if self.stopped:
            return "", True
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            index, stop = match
            self.stopped, self.matched_stop, self._held = True, stop, ""
            return buffer[: index + len(stop)] if self.include_stop_str_in_output else buffer[:index], True
        num_held = self._partial_suffix_len(buffer)
        self._held = buffer[len(buffer) - num_held :] if num_held else ""
        return buffer[: len(buffer) - num_held], False

    def flush(self) -> str:
        """At the end of generation: the held text, which turned out not to be a stop string."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        # Earliest occurrence wins; at one position the shortest (the one a token-by-token stream completes first).
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = buffer.find(stop)
            if index >= 0 and (best is None or (index, len(stop)) < (best[0], len(best[1]))):
                best = (index, stop)
        return best

    def _partial_suffix_len(self, buffer: str) -> int:
        # Longest suffix of the buffer that is a proper prefix of some stop string.
        if not buffer:
            return 0
        for prefix in self._prefixes_by_last.get(buffer[-1], ()):  # longest first
            if buffer.endswith(prefix):
                return len(prefix)
        return 0
