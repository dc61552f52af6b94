"""Paths: absolute inside dsat, short on the terminal."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsat.paths import absolute, shown


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
