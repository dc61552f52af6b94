"""What the user keeps is safe: a results directory that cannot be written is one line before the
first trial, and a disk that fills during the search is a clean stop that keeps every trial
recorded and resumes once space is freed."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dsat.cli import main
from dsat.results import writable
from dsat.results.resume import resume_command
from dsat.results.writable import write_failure
from tests.conftest import write_experiment

SIMULATED = Path(__file__).resolve().parents[2] / "examples" / "simulated"
GPT2 = "dsat.runners.simulated.performance_models:gpt2_large_16xv100"
MAX_TRIALS = 12
RECORDED_BEFORE_THE_DISK_FILLS = 4


def simulated_search(results: Path, *flags: str) -> list[str]:
    return [
        "asha",
        str(SIMULATED / "gpt2_large.yaml"),
        str(SIMULATED),
        "--runner",
        "simulated",
        "--simulator",
        GPT2,
        "--max-trials",
        str(MAX_TRIALS),
        "--results-dir",
        str(results),
        *flags,
    ]


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "resume with" not in out  # nothing about trials was said before it
    line = err.splitlines()[0]
    assert line.startswith("dsat: error: ")
    for needle in needles:
        assert needle in line, line
    return line


def rows(results: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (results / "trials.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- before the first trial


def writes_anyway(locked: Path) -> bool:
    """Whether this process writes into a folder whose mode forbids it (root does)."""
    try:
        (locked / "probe").write_text("")
    except PermissionError:
        return False
    (locked / "probe").unlink()
    return True


def test_an_unwritable_results_dir_is_one_line_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if writes_anyway(locked):
            pytest.skip(
                "running as root (with CAP_DAC_OVERRIDE): chmod does not stop it from writing; "
                "the parent-is-a-file test covers the same path"
            )
        one_line_error(
            capsys,
            simulated_search(locked / "results"),
            "--results-dir",
            "Permission denied",
            "choose a writable directory with --results-dir",
        )
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize(
    ("under_the_file", "says"),
    [
        ("results", "{}: cannot write the results there"),
        # It said "cannot write the results there (File exists)".
        ("", "{} is a file, not a directory"),
    ],
)
def test_a_results_dir_under_or_at_a_file_is_one_line_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], under_the_file: str, says: str
) -> None:
    (tmp_path / "a-file").write_text("not a directory\n")
    results = tmp_path / "a-file" / under_the_file  # "": the file itself
    one_line_error(
        capsys,
        simulated_search(results),
        says.format(f"--results-dir {results}"),
        "choose a writable directory with --results-dir",
    )
    assert (tmp_path / "a-file").read_text() == "not a directory\n"


def test_too_little_free_space_is_one_line_naming_the_floor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The local runner: the floor counts the model dir it copies per trial (10 MiB of data, and
    # an earlier search's results, which no trial copies).
    experiment = write_experiment(tmp_path / "model")
    with (experiment.parent / "data.bin").open("wb") as data:
        data.truncate(10 * 2**20)
    (experiment.parent / "dsat-results" / "old").mkdir(parents=True)
    with (experiment.parent / "dsat-results" / "old" / "big.bin").open("wb") as old:
        old.truncate(2**30)
    full = SimpleNamespace(total=2**40, used=2**40 - 2**20, free=2**20)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: full)
    monkeypatch.chdir(tmp_path)
    one_line_error(
        capsys,
        ["asha", str(experiment), str(experiment.parent), "--runner", "local"],
        "dsat-results/tiny-",  # the default results directory
        "only 1 MiB free there",
        f"at least {writable.RESULTS_FLOOR_BYTES // 2**20 + 2 * 10} MiB",
        "free some space there or choose another directory with --results-dir",
    )
    assert not (tmp_path / "dsat-results").exists()  # the check leaves no trace


@pytest.mark.parametrize(
    ("number", "remedy"), [(errno.EMFILE, "ulimit -n"), (errno.EFBIG, "ulimit -f")]
)
def test_a_process_limit_met_before_the_search_names_the_limit(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    number: int,
    remedy: str,
) -> None:
    """Another directory does not lift ``ulimit -n``: "choose a writable directory" was no fix."""

    def limited(directory: Path) -> int:
        raise OSError(number, os.strerror(number))

    monkeypatch.setattr(writable, "_probe", limited)
    results = tmp_path / "results"
    line = one_line_error(
        capsys,
        simulated_search(results),
        f"--results-dir {results}: cannot write the results there ({os.strerror(number)})",
        remedy,
        "then run the same command again",
    )
    assert "writable" not in line


# ---------------------------------------------------------------- a disk that fills mid-search


def test_a_disk_that_fills_mid_search_stops_cleanly_keeps_every_trial_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    results = tmp_path / "results"
    trials_file = results / "trials.jsonl"
    real_fsync = os.fsync
    kept: list[str] = []

    def fsync(fd: int) -> None:
        """The disk is full once trials.jsonl holds enough rows: every write fails from then on."""
        recorded = trials_file.read_text() if trials_file.is_file() else ""
        if recorded.count("\n") >= RECORDED_BEFORE_THE_DISK_FILLS:
            kept[:] = kept or [recorded]
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    code = main(simulated_search(results))
    err = capsys.readouterr().err
    monkeypatch.undo()  # space is freed
    assert code == 1, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    line = err.strip()
    assert line.startswith("dsat: stopped: cannot write ")
    assert str(results) in line and "(No space left on device)" in line
    assert f"the {RECORDED_BEFORE_THE_DISK_FILLS} trial(s) recorded before are kept" in line
    assert line.endswith(
        f"free some space there, then resume with: {resume_command('asha', results)}"
    )
    # trials.jsonl lost nothing: every row recorded before the fault, whole, and no temp file.
    assert kept and trials_file.read_text() == kept[0]
    before = rows(results)
    assert len(before) == RECORDED_BEFORE_THE_DISK_FILLS
    assert not [p.name for p in results.iterdir() if p.name.endswith(".tmp")]

    assert main(["asha", "--resume", str(results)]) == 0, capsys.readouterr().err
    after = rows(results)
    # Each trial once (the one whose state the full disk kept from being saved ran again and
    # took its own row's place); the search ran to its end.
    assert len({row["request_id"] for row in after}) == len(after)
    assert [row["request_id"] for row in after[: len(before)]] == [r["request_id"] for r in before]
    assert after[: len(before) - 1] == before[:-1]
    assert len([row for row in after if row["kind"] != "confirm"]) == MAX_TRIALS
    assert (results / "summary.txt").is_file()


# ---------------------------------------------------------------- what counts as the results' disk


def test_a_failed_copy_of_the_model_dir_into_the_results_is_a_write_failure(tmp_path: Path) -> None:
    results = tmp_path / "results"
    copy_error = shutil.Error(
        [
            (
                str(tmp_path / "model" / "train.py"),
                str(results / "trials" / "001-ab" / "train.py"),
                f"[Errno 28] No space left on device: '{results}/trials/001-ab/train.py'",
            )
        ]
    )
    failure = write_failure(copy_error, results)
    assert failure is not None and failure.space
    assert failure.reason == "No space left on device"
    assert failure.path == results / "trials" / "001-ab" / "train.py"
    elsewhere = FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "x"))
    assert write_failure(elsewhere, results) is None  # not the results: keeps its traceback
    unnamed = OSError(errno.EROFS, "Read-only file system")
    assert write_failure(unnamed, results) == writable.WriteFailure(
        results, "Read-only file system", errno.EROFS
    )


@pytest.mark.parametrize(
    ("number", "reason", "remedy"),
    [
        (errno.ENOSPC, "No space left on device", "free some space there"),
        (errno.EROFS, "Read-only file system", "make it writable"),
        (errno.EFBIG, "File too large", "ulimit -f"),
        (errno.EMFILE, "Too many open files", "ulimit -n"),
    ],
)
def test_a_write_failure_names_the_fix_for_its_cause(
    tmp_path: Path, number: int, reason: str, remedy: str
) -> None:
    """A process limit (the file size, the open files) is not fixed by making a file writable."""
    results = tmp_path / "results"
    err = OSError(number, reason, str(results / "trials.jsonl"))
    failure = write_failure(err, results)
    assert failure is not None and remedy in failure.remedy()
    # Not named in the results, a process limit still stops the search in one line.
    failure = write_failure(OSError(number, reason), results)
    assert failure is not None and failure.path == results and remedy in failure.remedy()
