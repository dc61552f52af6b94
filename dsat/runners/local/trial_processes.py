"""Trial processes on this machine: started so they die with dsat, stopped as a whole group, and
found again when a resumed search must make sure none of its earlier trials still runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, Protocol

import psutil

from dsat.constants import ENV_HPARAMS_FILE, ENV_RESULTS_DIR

GUARD = Path(__file__).with_name("trial_guard.py")
REAPER = Path(__file__).with_name("group_reaper.py")
KILL_GRACE_SECONDS = 5.0


class GroupReaper:
    """dsat's side of ``group_reaper``: the groups it must stop if dsat dies. Started at the
    first group; its pipe's only writer is this process, so dsat's end, however it comes,
    closes it."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def watch(self, group: int) -> None:
        self._send(f"+{group}")

    def forget(self, group: int) -> None:
        self._send(f"-{group}")

    def _send(self, line: str) -> None:
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._process = subprocess.Popen(
                    [sys.executable, str(REAPER)],
                    stdin=subprocess.PIPE,
                    # Not dsat's own: a caller reading dsat's output to its end would wait
                    # for the reaper's too.
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,  # out of the terminal's Ctrl-C, as trials are
                )
            assert self._process.stdin is not None  # stdin=PIPE
            with contextlib.suppress(OSError):  # gone: the next line starts another
                self._process.stdin.write(f"{line}\n".encode())
                self._process.stdin.flush()


# One per dsat process: whatever starts a group that could outlive dsat hands it over.
group_reaper = GroupReaper()


class TrialProcess(Protocol):
    """A trial's process as the local runner handles it: a ``subprocess.Popen``, or a process
    forked by a warm worker; either leads its own process group."""

    pid: int
    returncode: int | Any

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def guarded(command: list[str]) -> list[str]:
    """``command`` under the trial guard, which stops the trial's process group if dsat dies."""
    return [sys.executable, str(GUARD), str(os.getpid()), "--", *command]


def kill_process_group(process: TrialProcess) -> None:
    """Stop a trial's whole process group: SIGTERM, then SIGKILL after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break  # nothing left in the group
        try:
            process.wait(timeout=KILL_GRACE_SECONDS)
            if sig == signal.SIGKILL:
                return
        except subprocess.TimeoutExpired:
            continue
    # The group is gone (SIGKILL cannot be refused), but its leader's exit may not be known yet:
    # a warm trial's is reported by its worker, which on a loaded machine, or while it imports,
    # can lag the process itself. Waiting for that news without end would keep a stopping dsat
    # alive.
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=KILL_GRACE_SECONDS)


def leftover_trials(results_dir: Path) -> list[psutil.Process]:
    """Live processes of trials started for ``results_dir`` (they carry it in their environment),
    this process excepted."""
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.environ().get(ENV_RESULTS_DIR) == str(results_dir):
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def stop_leftover_trials(results_dir: Path) -> int:
    """Stop what an earlier, killed dsat left running for ``results_dir``; returns how many
    processes there were."""
    processes = leftover_trials(results_dir)
    groups = set()
    for process in processes:
        try:
            groups.add(os.getpgid(process.pid))
        except ProcessLookupError:
            continue
    groups.discard(os.getpgrp())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                continue
        _, alive = psutil.wait_procs(processes, timeout=KILL_GRACE_SECONDS)
        if not alive:
            break
        time.sleep(0.1)
    return len(processes)


def stop_strays(hparams_files: Collection[Path], spare: Collection[int] = ()) -> list[str]:
    """Stop the processes trials left running (finished, or stopped by dsat), and name them
    ("sleep (pid 12)"): a child one started and did not wait for, a daemon it spawned in a
    session of its own. They carry their trial's hyperparameters file in their environment.
    Left alone, one holds its GPU (a DataLoader worker, a profiler), and later trials run short
    of memory and are blamed for it. ``spare``: processes that may carry it and must live on
    (the trial host it ran in)."""
    wanted = {str(path) for path in hparams_files}
    strays = []
    for process in psutil.process_iter():
        if process.pid == os.getpid() or process.pid in spare:
            continue
        try:
            if process.environ().get(ENV_HPARAMS_FILE) in wanted:
                strays.append((process, f"{process.name()} (pid {process.pid})"))
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    for process, _ in strays:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs([process for process, _ in strays], timeout=KILL_GRACE_SECONDS)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    return [name for _, name in strays]


def strays_note(strays: list[str], what: str = "the trial") -> str | None:
    """The line that names what ``stop_strays`` stopped, for the trial's log; None if nothing."""
    return f"dsat: stopped what {what} left running: {', '.join(strays)}" if strays else None
