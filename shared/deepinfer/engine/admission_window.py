"""Admission window: a burst of new requests joins the running batch in one step instead of one step each.

Without it, requests that arrive while the engine is busy are admitted at the next step boundary, so a burst
spread over a few milliseconds (a closed-loop wave: many streams end in one step and their clients send the next
request together; the gateways, the router and the bus spread those over ~10 ms) is prefilled over several mixed
steps. Each one costs the running streams two to four decode steps of inter-token latency, and every arrival
waits for the mixed steps ahead of it. vLLM's V0 scheduler had the same lever (`scheduler_delay_factor`: new
prompts wait a fraction of the last prompt step's latency while others run).

The rule: while requests are running, a new request at the head of the queue waits while arrivals are still
coming (the last one less than `window_s / 4` ago), and never longer than `window_s` from its own arrival. An
engine with nothing running admits at once (a lone request never waits), and a preempted request resumes at once.
"""

from __future__ import annotations

import time

from deepinfer.engine.request import Request, RequestStatus

#: The burst counts as over once no request arrived for this fraction of the window.
QUIET_FRACTION = 0.25


class AdmissionWindow:
    """Decides, each step, whether the waiting queue's head is held back to gather the rest of its burst."""

    def __init__(self, window_s: float) -> None:
        if window_s < 0:
            raise ValueError(f"admission window must be >= 0 s, got {window_s}")
        self.window_s = window_s
        self.quiet_s = window_s * QUIET_FRACTION
        self.last_arrival_s = float("-inf")

    def note_arrival(self, now_s: float | None = None) -> None:
        """A new request was queued (monotonic seconds)."""
        self.last_arrival_s = time.monotonic() if now_s is None else now_s

    def holds(self, head: Request, has_running: bool, now_s: float | None = None) -> bool:
        """True: leave `head` (and the queue behind it: FCFS) waiting this step."""
        if self.window_s <= 0 or not has_running or head.status is not RequestStatus.WAITING:
            return False
        now_s = time.monotonic() if now_s is None else now_s
        return now_s - self.last_arrival_s < self.quiet_s and now_s - head.arrival_time < self.window_s
