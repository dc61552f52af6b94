"""Paths: absolute inside dsat, short on the terminal."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsat.paths import absolute, logs_where_they_are, shown


def test_paths_are_made_absolute_against_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert absolute("a/../b") == str(tmp_path / "b")
    assert absolute(tmp_path / "c") == str(tmp_path / "c")


def test_paths_are_shown_relative_only_below_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert shown(tmp_path / "here" / "results" / "x") == os.path.join("results", "x")
    assert shown(tmp_path / "elsewhere") == str(tmp_path / "elsewhere")
    assert shown(tmp_path / "here") == "."


def test_logs_are_named_where_the_moved_directory_holds_them(tmp_path: Path) -> None:
    """Only a log that is gone from where it was and is in the directory's logs/ now changes:
    one still there, one elsewhere (a trial's own file), one lost, and what is not a log stay."""
    here = tmp_path / "now"
    (here / "logs").mkdir(parents=True)
    (here / "logs" / "001-a.log").write_text("")
    (here / "logs" / "003-c.log").write_text("")
    (tmp_path / "kept.log").write_text("")
    was = tmp_path / "then" / "logs"
    saved = {
        "records": [
            {"log": str(was / "001-a.log"), "name": "z1_mb8"},
            {"log": str(was / "002-lost.log")},
            {"log": str(tmp_path / "elsewhere" / "003-c.log")},  # not a results dir's logs/
            {"log": str(tmp_path / "kept.log")},
            {"log": None, "runs": [{"log": str(was / "003-c.log")}]},
        ],
        "log": 3,
    }
    moved = logs_where_they_are(saved, here)
    assert [r["log"] for r in moved["records"]] == [
        str(here / "logs" / "001-a.log"),
        str(was / "002-lost.log"),
        str(tmp_path / "elsewhere" / "003-c.log"),
        str(tmp_path / "kept.log"),
        None,
    ]
    assert moved["records"][4]["runs"][0]["log"] == str(here / "logs" / "003-c.log")
    assert moved["log"] == 3 and moved["records"][0]["name"] == "z1_mb8"
    assert saved["records"][0]["log"] == str(was / "001-a.log")  # the saved value left as it was
