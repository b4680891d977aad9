"""The admission window: a burst of new requests joins the running batch in one step, a lone one never waits."""

from __future__ import annotations

import pytest

from deepinfer.engine.admission_window import AdmissionWindow
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import Scheduler
from deepinfer.sampling.params import SamplingParams

WINDOW_S = 0.008
#: The scheduler tests' window: long, so that the real time between two statements (a loaded machine can take
#: milliseconds) never ends a burst; `age` moves the arrivals through it instead.
LONG_WINDOW_S = 10.0


def new_request(request_id: str, arrival_s: float) -> Request:
    prompt = [10 + sum(map(ord, request_id)) % 50, *range(10, 29)]
    return Request(request_id, prompt, SamplingParams(max_tokens=64, ignore_eos=True), arrival_time=arrival_s)


def test_holds_only_a_new_request_while_others_run_and_its_burst_goes_on():
    window = AdmissionWindow(WINDOW_S)
    head = new_request("a", arrival_s=100.0)
    window.note_arrival(100.001)
    assert window.holds(head, has_running=True, now_s=100.002)  # the last arrival 1 ms ago: the burst goes on
    assert not window.holds(head, has_running=False, now_s=100.002)  # nothing runs: a lone request never waits
    assert not window.holds(head, has_running=True, now_s=100.001 + WINDOW_S / 4 + 1e-6)  # quiet for a quarter
    window.note_arrival(100.0075)
    assert not window.holds(head, has_running=True, now_s=100.0081)  # never past the window from its arrival
    head.status = RequestStatus.PREEMPTED
    assert not window.holds(head, has_running=True, now_s=100.0076)  # a preempted request resumes at once
    assert not AdmissionWindow(0.0).holds(new_request("b", 100.0), has_running=True, now_s=100.0)
    with pytest.raises(ValueError, match=">= 0"):
        AdmissionWindow(-1.0)


def admitted(scheduler: Scheduler) -> list[str]:
    """Request ids a schedule() call gives their first tokens (newly admitted)."""
    output = scheduler.schedule()
    new = [s.request_id for s in output.scheduled if s.is_new]
    scheduler.update(output, {s.request_id: [7] for s in output.scheduled if s.sample})
    return new


def age(scheduler: Scheduler, seconds: float) -> None:
    """Move every arrival `seconds` into the past (the scheduler reads time.monotonic() itself)."""
    scheduler.admission_window.last_arrival_s -= seconds
    for request in scheduler.waiting:
        request.arrival_time -= seconds


def test_a_burst_arriving_while_one_runs_is_admitted_in_one_step():
    scheduler = Scheduler(EngineConfig(num_blocks=64, max_model_len=256, block_size=16,
                                       admission_window_s=LONG_WINDOW_S))
    scheduler.add_request(new_request("first", arrival_s=None))
    assert admitted(scheduler) == ["first"]  # nothing was running: at once
    scheduler.add_request(new_request("b1", arrival_s=None))
    scheduler.add_request(new_request("b2", arrival_s=None))
    assert admitted(scheduler) == []  # "first" decodes; the burst is still arriving
    scheduler.add_request(new_request("b3", arrival_s=None))
    assert admitted(scheduler) == []
    age(scheduler, LONG_WINDOW_S / 4)
    assert admitted(scheduler) == ["b1", "b2", "b3"]


def test_a_steady_stream_waits_no_longer_than_the_window():
    scheduler = Scheduler(EngineConfig(num_blocks=64, max_model_len=256, block_size=16,
                                       admission_window_s=LONG_WINDOW_S))
    scheduler.add_request(new_request("first", arrival_s=None))
    assert admitted(scheduler) == ["first"]
    scheduler.add_request(new_request("old", arrival_s=None))
    age(scheduler, LONG_WINDOW_S)
    scheduler.add_request(new_request("new", arrival_s=None))  # arrivals go on, but "old" waited the window
    assert admitted(scheduler) == ["old", "new"]


def test_no_window_admits_at_the_next_step():
    scheduler = Scheduler(EngineConfig(num_blocks=64, max_model_len=256, block_size=16))
    scheduler.add_request(new_request("first", arrival_s=None))
    assert admitted(scheduler) == ["first"]
    scheduler.add_request(new_request("next", arrival_s=None))
    assert admitted(scheduler) == ["next"]
    with pytest.raises(ValueError, match="admission_window_s"):
        EngineConfig(num_blocks=64, max_model_len=256, admission_window_s=-0.1)
