"""The trial timeout: explicit, or derived from the model-profile trial."""

from __future__ import annotations

import json
from pathlib import Path

from dsat.results.directory import TRIALS_FILE
from dsat.runners.local.trial_timeout import (
    FLOOR_S,
    PROFILE_MULTIPLE,
    PROFILE_TRIAL_LIMIT_S,
    TrialTimeout,
    profile_seconds,
)


def test_an_explicit_timeout_is_kept_whatever_the_profile_trial_took() -> None:
    timeout = TrialTimeout(42.0)
    timeout.profile_finished(1000.0)
    assert timeout.seconds == 42.0
    assert "42 s (--trial-timeout)" in timeout.describe()


def test_the_default_follows_the_profile_trial_with_a_floor() -> None:
    slow = TrialTimeout(None)
    assert slow.seconds == PROFILE_TRIAL_LIMIT_S
    slow.profile_finished(90.0)
    assert slow.seconds == PROFILE_MULTIPLE * 90.0
    assert f"{PROFILE_MULTIPLE * 90.0:.0f} s" in slow.describe()
    slow.profile_finished(1.0)  # only the first (the profile trial) counts
    assert slow.seconds == PROFILE_MULTIPLE * 90.0
    assert "the model-profile trial's 90 s" in slow.describe()
    quick = TrialTimeout(None)
    quick.profile_finished(2.0)
    assert quick.seconds == FLOOR_S
    instant = TrialTimeout(None)
    instant.profile_finished(0.42)  # it said "the model-profile trial's 0 s"
    assert "the model-profile trial's 0.42 s" in instant.describe()


def test_a_resumed_search_takes_the_profile_time_from_its_trials(tmp_path: Path) -> None:
    rows = [
        {"kind": "model_profile", "status": "completed", "start": 10.0, "end": 70.0},
        {"kind": "search", "status": "completed", "start": 70.0, "end": 500.0},
    ]
    (tmp_path / TRIALS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows) + "{broken\n")
    timeout = TrialTimeout(None)
    timeout.resume_from(tmp_path)
    assert timeout.profile_seconds == 60.0
    assert profile_seconds([{"kind": "model_profile", "status": "error"}]) is None
    fresh = TrialTimeout(None)
    fresh.resume_from(tmp_path / "missing")
    assert fresh.seconds == PROFILE_TRIAL_LIMIT_S
