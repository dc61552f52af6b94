"""What the search writes as it goes, kept whole when it is stopped."""

from __future__ import annotations

import os
import signal
import time

import pytest

from dsat.search_run import stops_held


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_between_a_trials_row_and_its_state_waits_for_both(sig: signal.Signals) -> None:
    """A Ctrl-C after the row, before the state, left the trial "running" on disk: the resume
    ran it again and lost its first measurement."""

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
