"""Atomic writes: the old file survives a failed write, and no temp files are left."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dsat.atomic_file import write_json_atomic, write_text_atomic


def test_writes_json_and_creates_parents(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "best.json"
    write_json_atomic(target, {"x": 1})
    assert json.loads(target.read_text()) == {"x": 1}
    assert [p.name for p in target.parent.iterdir()] == ["best.json"]


def test_failed_replace_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "best.json"
    write_text_atomic(target, "old")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk gone"):
        write_text_atomic(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["best.json"]


def test_a_new_file_gets_the_umask_s_mode_and_a_rewrite_keeps_the_users(tmp_path: Path) -> None:
    """mkstemp's 0600 left best_ds_config.json unreadable to other users and containers."""
    import os
    import stat

    previous = os.umask(0o022)
    try:
        path = tmp_path / "best_ds_config.json"
        write_json_atomic(path, {"a": 1})
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        path.chmod(0o640)  # the user's choice
        write_json_atomic(path, {"a": 2})
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
    finally:
        os.umask(previous)
