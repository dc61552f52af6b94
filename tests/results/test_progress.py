"""Progress lines and the live status line, on a terminal and off one."""

from __future__ import annotations

import dataclasses
import io

from rich.console import Console

from dsat.constants import LINGERED_KEY, RUN_ALONE
from dsat.experiment.metric import Metric
from dsat.results.progress import SearchProgress, format_elapsed
from dsat.trial import TrialKind, TrialOutcome, TrialStatus
from dsat.trial_failure import MACHINE_ATTEMPTS, FailureCause
from tests.search.test_tracker import record, tracker


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def outcome(rid: str, status: TrialStatus) -> TrialOutcome:
    return TrialOutcome(rid, status, {}, None, 0.0, 1.0)


def start(progress: SearchProgress, rid: str) -> None:
    """As the driver does: the method marks the trial running, then the listener hears of it."""
    t = progress.tracker
    t.mark_running(t.dequeue(rid).request_id)
    progress.trial_started(rid)


def finish(progress: SearchProgress, rid: str, status: TrialStatus, value: float | None) -> None:
    t = progress.tracker
    t.mark_finished(rid, status, {"throughput": value} if value is not None else {})
    progress.trial_finished(rid, outcome(rid, status))


def test_plain_lines_count_every_outcome_and_name_the_best() -> None:
    out = io.StringIO()
    clock = FakeClock()
    t = tracker(Metric.THROUGHPUT)
    for rid, mbs in [("p", 1), ("a", 2), ("b", 4), ("c", 8), ("d", 16)]:
        kind = TrialKind.MODEL_PROFILE if rid == "p" else TrialKind.SEARCH
        t.add(record(rid, mbs, kind=kind))
    progress = SearchProgress(t, Console(file=out, width=300), clock)
    with progress:
        assert progress._live is None  # a StringIO is not a terminal
        for rid in "pabcd":
            start(progress, rid)
        clock.now += 75
        finish(progress, "p", TrialStatus.COMPLETED, None)
        finish(progress, "a", TrialStatus.COMPLETED, 10.0)
        finish(progress, "b", TrialStatus.COMPLETED, 30.0)
        finish(progress, "c", TrialStatus.OOM, None)
        finish(progress, "d", TrialStatus.TIMEOUT, None)
    lines = out.getvalue().splitlines()
    assert (
        lines[0]
        == "dsat: trial 1 model profile: completed | running 4, done 1, oom 0, error 0 (1 of at most "
        "10 trials), 01:15"
    )
    assert lines[2].startswith("dsat: trial 1 z1_mb4: completed, 30 samples/s |")
    assert lines[2].endswith("best z1_mb4 30 samples/s, 01:15")
    assert lines[4].startswith("dsat: trial 1 z1_mb16: timeout |")
    # A hang is counted as one, not as a crash.
    assert "running 0, done 3, oom 1, error 0, timeout 1 (5 of at most 10 trials)" in lines[4]
    assert "\x1b[" not in out.getvalue()


def test_a_failed_trial_says_why_and_where_its_log_is_and_a_retry_says_so() -> None:
    out = io.StringIO()
    t = tracker(Metric.THROUGHPUT)
    t.add(record("a", 8))
    progress = SearchProgress(t, Console(file=out, width=400), FakeClock())
    start(progress, "a")
    port = TrialOutcome(
        "a", TrialStatus.ERROR, {}, "a port was taken (EADDRINUSE)\ntail", 0.0, 1.0,
        FailureCause.MACHINE, "/r/logs/001-a.log",
    )  # fmt: skip
    progress.trial_retried("a", port, 1)
    memory = dataclasses.replace(port, metrics={RUN_ALONE: True}, error="the host's memory ran out")
    progress.trial_retried("a", memory, 2)
    error = "ValueError: bad shape (exit code 1)\nTraceback ..."
    t.mark_finished("a", TrialStatus.ERROR, error=error, log="/r/logs/002-a.log")
    progress.trial_finished("a", outcome("a", TrialStatus.ERROR))
    retried, alone, failed = out.getvalue().splitlines()
    # Each run named by its log's number, as logs/ and trials/ name it.
    assert retried == (
        "dsat: trial 1 z1_mb8: the machine failed it, not its configuration: a port was "
        f"taken (EADDRINUSE) (log: /r/logs/001-a.log); running it again (attempt 2 of "
        f"{MACHINE_ATTEMPTS})"
    )
    assert alone.endswith(
        "the host's memory ran out (log: /r/logs/001-a.log); running it again, alone, once the "
        f"trials running beside it end (attempt 3 of {MACHINE_ATTEMPTS})"
    )
    assert failed.startswith(
        "dsat: trial 2 z1_mb8: error: ValueError: bad shape (exit code 1) "
        "(log: /r/logs/002-a.log) | "
    )


def test_a_trial_stopped_after_its_result_says_how_long_it_ran_on() -> None:
    """A script whose code after training blocked made each trial a minute longer, and only the
    end of each trial's log said why."""
    out = io.StringIO()
    t = tracker(Metric.THROUGHPUT)
    t.add(record("a", 8))
    progress = SearchProgress(t, Console(file=out, width=400), FakeClock())
    start(progress, "a")
    metrics = {"throughput": 10.0, LINGERED_KEY: 60}
    t.mark_finished("a", TrialStatus.COMPLETED, metrics, log="/r/logs/001-a.log")
    progress.trial_finished("a", outcome("a", TrialStatus.COMPLETED))
    (line,) = out.getvalue().splitlines()
    assert line.startswith(
        "dsat: trial 1 z1_mb8: completed, 10 samples/s (stopped 60 s after its result: its code "
        "after training blocked, or something it started kept it alive (log: /r/logs/001-a.log))"
    )


def test_smaller_is_better_best_so_far() -> None:
    t = tracker(Metric.LATENCY)
    t.add(record("a", 2))
    t.add(record("b", 4))
    progress = SearchProgress(t, Console(file=io.StringIO()), FakeClock())
    for rid, value in [("a", 5.0), ("b", 9.0)]:
        t.mark_running(t.dequeue(rid).request_id)
        t.mark_finished(rid, TrialStatus.COMPLETED, {"latency": value})
    assert "best z1_mb2 5 ms a step" in progress.status_line()


def test_terminal_gets_a_live_line_that_is_gone_at_the_end() -> None:
    out = io.StringIO()
    t = tracker()
    t.add(record("a", 2))
    console = Console(file=out, force_terminal=True, width=200)
    progress = SearchProgress(t, console, FakeClock())
    with progress:
        assert progress._live is not None
        start(progress, "a")
        finish(progress, "a", TrialStatus.COMPLETED, 3.0)
    assert progress._live is None
    text = out.getvalue()
    assert "trial 1 z1_mb2: completed, 3 samples/s" in text
    assert "running 1, done 0" in text  # the live line as it was while the trial ran
    assert "\x1b[" in text  # cursor control: the live line is redrawn in place


def test_elapsed_format() -> None:
    assert format_elapsed(5) == "00:05"
    assert format_elapsed(3725) == "1:02:05"


def test_the_users_own_config_and_a_confirmation_run_show_what_they_measured() -> None:
    out = io.StringIO()
    t = tracker(Metric.FLOPS_PER_GPU)
    t.add(record("y", 8, kind=TrialKind.BASELINE))
    t.add(record("c", 16, kind=TrialKind.CONFIRM))
    progress = SearchProgress(t, Console(file=out, width=300), FakeClock())
    for rid, value in (("y", 6.113e10), ("c", 2.5e13)):
        start(progress, rid)
        t.mark_finished(rid, TrialStatus.COMPLETED, {"FLOPS_per_gpu": value})
        progress.trial_finished(rid, outcome(rid, TrialStatus.COMPLETED))
    lines = out.getvalue().splitlines()
    assert "your config (z1_mb8): completed, 61.1 GFLOP/s per GPU |" in lines[0]
    assert ": completed, 25 TFLOP/s per GPU |" in lines[1]


def test_a_resumed_searchs_clock_carries_on_as_its_rows_do() -> None:
    """It restarted at 00:00 while trials.jsonl's times carried on (01:07 beside 124 s)."""
    clock = FakeClock()
    t = tracker(Metric.THROUGHPUT)
    t.add(record("p", 1, kind=TrialKind.MODEL_PROFILE))
    progress = SearchProgress(t, Console(file=io.StringIO(), width=300), clock)
    progress.carry_on(124.0)
    clock.now += 7
    assert progress.status_line().endswith(", 02:11")
