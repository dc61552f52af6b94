"""What the search writes as it goes, kept whole when it is stopped."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from dsat.constants import STATE_FILE
from dsat.results.cost import INTERRUPTED_KEY, search_cost
from dsat.results.directory import TRIALS_FILE
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.search.method_state import INTERRUPTED_STATE_KEY
from dsat.search_run import resumes_without_trials, run_search, stops_held
from dsat.trial import TrialOutcome
from tests.search.helpers import cliff_function, search_settings, spec


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_between_a_trials_row_and_its_state_waits_for_both(sig: signal.Signals) -> None:
    """A Ctrl-C after the row, before the state, left the trial "running" on disk: the resume
    ran it again and lost its first measurement. SIGHUP (the terminal closed) stops a search
    as Ctrl-C does, and was not held."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # as the CLI's handlers do

    previous = signal.signal(sig, stop)
    written: list[str] = []
    try:
        with pytest.raises(KeyboardInterrupt), stops_held():
            written.append("row")
            os.kill(os.getpid(), sig)
            time.sleep(0.05)  # a handler not held off would have raised by now
            written.append("state")
    finally:
        signal.signal(sig, previous)
    assert written == ["row", "state"]


def test_only_a_search_that_has_ended_resumes_without_trials(tmp_path: Path) -> None:
    """Where none would run, the launch opens no runner (no cluster, no slots, no op build)."""
    settings = search_settings("binary", max_trials=6, max_concurrent_trials=1)
    run_search(settings, spec(), SimulatedRunner(cliff_function(12), 1), tmp_path, max_events=3)
    assert not resumes_without_trials(settings, spec(), tmp_path)  # stopped mid-search
    run_search(settings, spec(), SimulatedRunner(cliff_function(12), 1), tmp_path)
    assert resumes_without_trials(settings, spec(), tmp_path)
    (tmp_path / STATE_FILE).write_text("{")  # run_search says what is wrong with it
    assert not resumes_without_trials(settings, spec(), tmp_path)


class CtrlCHalfwayThrough(SimulatedRunner):
    """Ctrl-C halfway through the trial the search waits for at its ``at``-th wait."""

    def __init__(self, at: int, *args: Any) -> None:
        super().__init__(*args)
        self.at, self.waits = at, 0

    def wait(self) -> TrialOutcome:
        self.waits += 1
        if self.waits == self.at:
            end, _, outcome = self._events[0]
            self.now = (outcome.start + end) / 2
            raise KeyboardInterrupt
        return super().wait()


def test_the_time_of_runs_a_ctrl_c_cut_short_counts_in_the_resumed_searchs_cost(
    tmp_path: Path,
) -> None:
    """The trials a Ctrl-C stopped ran again on the resume, and the cost left out the time they
    had held their slots before the stop."""
    settings = search_settings("binary", max_trials=8, max_concurrent_trials=2)
    with pytest.raises(KeyboardInterrupt):
        run_search(settings, spec(), CtrlCHalfwayThrough(4, cliff_function(12), 1), tmp_path)
    state = json.loads((tmp_path / STATE_FILE).read_text())
    stopped = state[INTERRUPTED_STATE_KEY]
    assert len(stopped) == 2  # both trials that ran, each once
    run_search(settings, spec(), SimulatedRunner(cliff_function(12), 1), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / TRIALS_FILE).read_text().splitlines()]
    cut_short = {row["request_id"]: row[INTERRUPTED_KEY] for row in rows if INTERRUPTED_KEY in row}
    assert cut_short == stopped  # in each trial's row, as its earlier run
    runs = [run for kept in cut_short.values() for run in kept]
    assert all(run["end"] > run["start"] for run in runs)
    stop = max(run["end"] for run in runs)
    assert all(row["start"] >= stop for row in rows if row["request_id"] in cut_short)
    held = sum(row["end"] - row["start"] for row in rows)
    held += sum(run["end"] - run["start"] for run in runs)
    assert search_cost(rows).trial_seconds == pytest.approx(held)
    assert INTERRUPTED_STATE_KEY not in json.loads((tmp_path / STATE_FILE).read_text())


def test_a_ctrl_c_as_the_search_decides_to_end_keeps_its_decision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C while the method decided that the search ends (its confirmation round) and
    before the state was saved with the round's first run left the state without the decision:
    the resume then took more --max-trials, ran none of them, and gave a false reason."""
    from dsat.search.ending import SearchEnding

    decide = SearchEnding._start_confirmation

    def decide_then_ctrl_c(self: SearchEnding, *args: Any) -> bool:
        decided = decide(self, *args)
        if decided:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # a Ctrl-C not held off would have raised by now
        return decided

    monkeypatch.setattr(SearchEnding, "_start_confirmation", decide_then_ctrl_c)
    settings = search_settings("binary", max_trials=6, max_concurrent_trials=1, confirm_top=2)
    with pytest.raises(KeyboardInterrupt):
        run_search(settings, spec(), SimulatedRunner(cliff_function(12), 1), tmp_path)
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert state.get("confirmation_candidates"), "the decision was lost"
    assert [r["kind"] for r in state["tracker"]["records"] if r["status"] == "running"] == [
        "confirm"
    ]


def test_a_row_a_kill_9_left_ahead_of_its_state_leaves_no_hole_in_the_clock(
    tmp_path: Path,
) -> None:
    """A kill -9 after a trial's row, before the state that said it finished: the resume runs
    the trial again and replaces its row, but carried its clock on after the row it replaced,
    shifting every later trial by that trial's time."""
    settings = search_settings("binary", max_trials=6, max_concurrent_trials=1)
    runner = SimulatedRunner(cliff_function(12), 1)
    run_search(settings, spec(), runner, tmp_path, max_events=3)  # the 4th trial runs
    state = json.loads((tmp_path / STATE_FILE).read_text())
    (running,) = [r["request_id"] for r in state["tracker"]["records"] if r["status"] == "running"]
    rows = [json.loads(line) for line in (tmp_path / TRIALS_FILE).read_text().splitlines()]
    stopped_at = max(row["end"] for row in rows)
    ahead = {**rows[-1], "request_id": running, "start": stopped_at, "end": stopped_at + 60.0}
    with (tmp_path / TRIALS_FILE).open("a") as handle:
        handle.write(json.dumps(ahead) + "\n")
    run_search(settings, spec(), SimulatedRunner(cliff_function(12), 1), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / TRIALS_FILE).read_text().splitlines()]
    (again,) = [row for row in rows if row["request_id"] == running]
    assert again["start"] == pytest.approx(stopped_at)


class ReadySevenSecondsAgo:
    """A runner whose clock started 7 s before the search (its slots claimed, its ops built),
    as the local and Ray runners' do; its trials are a simulator's."""

    takes_real_time = True
    slot_limit = None
    slot_kind = "GPU"

    def __init__(self) -> None:
        self.inner = SimulatedRunner(cliff_function(12), 1)
        self.started_at = time.monotonic() - 7.0

    def now(self) -> float:
        return time.monotonic() - self.started_at

    def __getattr__(self, name: str) -> Any:  # start, wait, running_count, stop_all, ...
        return getattr(self.inner, name)


def test_the_progress_lines_count_time_as_the_rows_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The display's clock started with the search, the rows' with the runner: its lines read
    2 s behind the rows on a Ray search."""
    settings = search_settings("binary", max_trials=4, max_concurrent_trials=1)
    run_search(settings, spec(), ReadySevenSecondsAgo(), tmp_path, max_events=1)  # type: ignore[arg-type]
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "trial 1 " in line]
    assert line.endswith(", 00:07"), line
