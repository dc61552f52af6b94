"""Connecting to a Ray cluster: what dsat says while it waits."""

from __future__ import annotations

import time

import pytest

from dsat.runners.ray.setup import slow_connect_note


def test_a_connect_that_takes_long_says_what_is_likely_wrong(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with slow_connect_note("head:8265", after=0.1):
        time.sleep(0.5)  # ray.init retrying against a port that is not Ray's GCS
    out = capsys.readouterr().out
    assert "still connecting to the Ray cluster at head:8265 after 0 s" in out
    assert "port 6379 by default" in out and "Ctrl-C stops" in out


def test_a_quick_connect_or_a_local_instance_says_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with slow_connect_note("head:6379", after=0.3):
        pass
    with slow_connect_note(None, after=0.0):  # a Ray instance started here: nothing to check
        time.sleep(0.3)
    time.sleep(0.4)
    assert capsys.readouterr().out == ""
