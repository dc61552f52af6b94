"""What the search writes as it goes, kept whole when it is stopped."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from dsat.constants import STATE_FILE
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.search_run import resumes_without_trials, run_search, stops_held
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
