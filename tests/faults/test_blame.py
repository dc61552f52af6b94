"""Faults injected into real searches (real DeepSpeed on the CPU): each is blamed on what caused
it, says so on the terminal in one line with its log, and trials.jsonl loses nothing.

The machine's faults (a taken port, a trial or its parent killed from outside, a rank of a
two-process trial killed) are run again; the script's (an import that fails) end the search
with the script's own reason, and never advise changing the DeepSpeed config.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dsat.results.cost import search_cost
from dsat.runners.local.entrypoint import LAUNCHER_LOGS
from dsat.trial_failure import MACHINE_ATTEMPTS
from tests.dsat_process import dsat, trials
from tests.runners.local.test_end_to_end import binary_search, model_dir

pytestmark = pytest.mark.slow


def retried_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if "the machine failed it" in line]


def test_faults_of_the_machine_are_run_again_and_said(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    # Forked trials: a trial host's trials have no worker of their own to lose
    # (tests/runners/local/test_trial_host.py kills a host mid-trial).
    run, results = binary_search(
        tmp_path,
        2,
        "--no-trial-host",
        DSAT_TEST_FAULTS="profile:port,profile:kill_parent,search:kill_self",
        DSAT_TEST_FAULT_MARKS=str(marks),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = retried_lines(run.stdout)
    assert len(lines) == 3, run.stdout
    port, parent, killed = lines
    # Each run is numbered as its log is: logs/001-* for the profile's first.
    assert port.startswith("dsat: trial 1 model profile: the machine failed it, not its config")
    assert "EADDRINUSE" in port and f"(attempt 2 of {MACHINE_ATTEMPTS})" in port
    # The warm worker the trial was forked from was killed: its trial dies with it.
    assert "the warm worker this trial was forked from died" in parent
    assert f"(attempt 3 of {MACHINE_ATTEMPTS})" in parent
    assert (
        killed.startswith("dsat: trial 4 z1_") and "killed by SIGKILL from outside dsat" in killed
    )
    for line in lines:  # each names its own attempt's log, which holds the fault
        log = Path(re.search(r"\(log: (\S+)\)", line).group(1))  # type: ignore[union-attr]
        assert log.is_file() and log.parent == results / "logs"
    assert "EADDRINUSE" in Path(re.search(r"\(log: (\S+)\)", port).group(1)).read_text()  # type: ignore[union-attr]
    rows = trials(results)
    assert [(row["status"], row["cause"]) for row in rows] == [("completed", None)] * 2
    assert len(list((results / "logs").glob("0*.log"))) == 5  # 3 profile runs, 2 search runs
    # The rows keep the runs the machine failed (they said only "completed"), and the cost
    # counts their slots' time.
    profile_failed, search_failed = (row.get("machine_failed", []) for row in rows)
    assert ["EADDRINUSE" in run["error"] for run in profile_failed] == [True, False]
    assert "killed by SIGKILL from outside dsat" in search_failed[0]["error"]
    for run in [*profile_failed, *search_failed]:
        assert Path(run["log"]).is_file() and run["start"] <= run["end"]
    assert profile_failed[-1]["end"] <= rows[0]["start"]
    held = sum(r["end"] - r["start"] for r in [*rows, *profile_failed, *search_failed])
    assert search_cost(rows).trial_seconds == pytest.approx(held)


def test_a_rank_killed_mid_trial_is_run_again(tmp_path: Path) -> None:
    # The one two-process search of the suite: torchrun, Determined's launcher stripped.
    marks = tmp_path / "marks"
    marks.mkdir()
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    run, results = binary_search(
        tmp_path,
        2,
        zero_stage=2,
        range_factor=0.001,
        config={
            "resources": {"slots_per_trial": 2},
            "entrypoint": "python3 -m determined.launch.torch_distributed python3 "
            "behaviour_train.py",
        },
        DSAT_TEST_FAULTS="search:kill_rank1",
        DSAT_TEST_FAULT_MARKS=str(marks),
        TMPDIR=str(temporary),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (line,) = retried_lines(run.stdout)
    assert line.startswith("dsat: trial 2 z2_") and "killed by SIGKILL from outside dsat" in line
    rows = trials(results)
    assert [row["status"] for row in rows] == ["completed", "completed"]
    assert rows[1]["overwrites"]["train_batch_size"] == 2 * rows[1]["mbs"]  # two ranks
    logs = sorted((results / "logs").glob("0*.log"))
    assert len(logs) == 3 and "Signal 9 (SIGKILL)" in logs[1].read_text()
    assert "torch.distributed.run" in logs[2].read_text()
    assert "--nproc_per_node 2" in logs[2].read_text()
    # torchrun's folders: a torchelastic_* in the temporary directory for every trial, never
    # removed; now in the trial's own directory, and gone where they hold no file.
    assert not list(temporary.glob("torchelastic_*"))
    assert not list((results / "trials").glob(f"*/{LAUNCHER_LOGS}"))


def test_a_script_that_cannot_import_ends_the_search_with_its_own_reason(tmp_path: Path) -> None:
    path, directory = model_dir(tmp_path)
    script = directory / "behaviour_train.py"
    script.write_text("import transformerz  # a typo\n" + script.read_text())
    run = dsat("binary", str(path), str(directory), "--results-dir", str(tmp_path / "results"))
    assert run.returncode == 1
    output = run.stdout + run.stderr
    reason = "ModuleNotFoundError: No module named 'transformerz'"
    assert "dsat: search failed: the model-profile trial failed: " in run.stderr
    assert reason in run.stderr and "logs/001-" in run.stderr
    assert "fix the DeepSpeed config" not in output and "fix the config" not in output
    assert output.count(reason) == 2  # the trial's line, then the search's end: not three times
    assert "Traceback" not in run.stderr
    (row,) = trials(tmp_path / "results")
    assert row["status"] == "error" and row["cause"] == "script"
