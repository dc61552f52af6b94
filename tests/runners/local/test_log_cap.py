"""A finished trial's log is cut to its first and last part where it wrote too much."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from dsat.runners.local import log_cap
from dsat.runners.local.log_cap import cap_log


@pytest.fixture
def small_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(log_cap, "LOG_CAP_BYTES", 64 * 1024)
    monkeypatch.setattr(log_cap, "KEEP_HEAD_BYTES", 8 * 1024)
    monkeypatch.setattr(log_cap, "KEEP_TAIL_BYTES", 16 * 1024)


def numbered_lines(count: int) -> str:
    return "".join(f"line {n:06d} {'x' * 50}\n" for n in range(count))


def test_a_log_within_the_cap_is_left_whole(tmp_path: Path, small_caps: None) -> None:
    log = tmp_path / "trial.log"
    log.write_text(numbered_lines(1000))  # 62 KiB
    assert cap_log(log) == 0
    assert log.read_text() == numbered_lines(1000)


def test_a_log_over_the_cap_keeps_its_whole_first_and_last_lines(
    tmp_path: Path, small_caps: None
) -> None:
    log = tmp_path / "trial.log"
    text = numbered_lines(10_000) + "ValueError: the end\n"
    log.write_text(text)
    cut = cap_log(log)
    kept = log.read_text()
    assert cut > 0 and len(kept) < 8 * 1024 + 16 * 1024 + 200
    head, note, tail = kept.partition("dsat: ")
    assert text.startswith(head.rstrip("\n") + "\n") and text.endswith(tail.split("\n\n", 1)[1])
    assert "MiB of this trial's output cut here" in note + tail
    assert kept.endswith("ValueError: the end\n") and len(text) - len(kept) < cut + 300
    for line in kept.splitlines():  # no line cut in two
        assert not line.startswith("line ") or len(line) == len("line 000000 ") + 50


def test_a_log_that_cannot_be_written_again_stays_as_it_is(
    tmp_path: Path, small_caps: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(log_cap, "write_bytes_atomic", disk_full)
    log = tmp_path / "trial.log"
    log.write_text(numbered_lines(10_000))
    assert cap_log(log) == 0 and log.read_text() == numbered_lines(10_000)
