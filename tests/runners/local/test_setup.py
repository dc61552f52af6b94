"""What the local runner is opened with when the user does not say."""

from __future__ import annotations

from dsat.runners.local.setup import hosts_trials


def test_trials_run_in_a_trial_host_unless_the_user_turns_it_off() -> None:
    assert hosts_trials(None) is True  # on the CPU and on a GPU alike (benchmarks/README.md)
    assert hosts_trials(True) is True
    assert hosts_trials(False) is False
