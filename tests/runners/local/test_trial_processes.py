"""Trial processes die with dsat, and a resumed search stops what a killed dsat left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from dsat.constants import ENV_RESULTS_DIR
from dsat.runners.local.trial_processes import guarded, leftover_trials, stop_leftover_trials

# Stands in for dsat: starts one guarded trial (which starts a worker of its own, as torchrun
# does) in a new process group, prints the trial's pid, then waits to be killed.
FAKE_DSAT = """
import subprocess, sys, time
from dsat.runners.local.trial_processes import guarded
worker = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
trial = subprocess.Popen(guarded([sys.executable, "-c", worker]), start_new_session=True)
print(trial.pid, flush=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie); one that exits while it is being looked
    at is gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if running(p)]
        time.sleep(0.1)
    return alive


def test_sigkill_of_dsat_takes_its_trials_down(tmp_path: Path) -> None:
    dsat = subprocess.Popen(
        [sys.executable, "-c", FAKE_DSAT],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    assert dsat.stdout is not None
    guard = psutil.Process(int(dsat.stdout.readline()))
    deadline = time.monotonic() + 30
    while len(guard.children(recursive=True)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    group = [guard.pid, *(p.pid for p in guard.children(recursive=True))]
    assert len(group) == 3  # the guard, the trial's launcher and its worker
    dsat.kill()
    dsat.wait()
    assert wait_gone(group, 15) == []


def test_the_guard_exits_as_its_command_did() -> None:
    assert subprocess.run(guarded([sys.executable, "-c", "raise SystemExit(3)"])).returncode == 3
    killed = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    assert subprocess.run(guarded(killed)).returncode == -signal.SIGKILL
    assert subprocess.run(guarded(["/nonexistent/command"])).returncode == 127


def test_a_resumed_search_stops_the_trials_an_earlier_run_left(tmp_path: Path) -> None:
    results = tmp_path / "results"
    leftover = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={**os.environ, ENV_RESULTS_DIR: str(results)},
        start_new_session=True,
    )
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={**os.environ, ENV_RESULTS_DIR: str(tmp_path / "another-search")},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while not leftover_trials(results) and time.monotonic() < deadline:
            time.sleep(0.05)  # the environment is readable once the interpreter started
        assert [p.pid for p in leftover_trials(results)] == [leftover.pid]
        assert stop_leftover_trials(results) == 1
        assert wait_gone([leftover.pid], 10) == []
        assert other.poll() is None  # another search's trial is left alone
    finally:
        for process in (leftover, other):
            process.kill()
            process.wait()
