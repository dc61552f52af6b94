"""The reaper stops the groups still listed when dsat's pipe closes, whatever they ignore."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

from dsat.runners.local.group_reaper import alive
from dsat.runners.local.trial_processes import REAPER

IGNORES_SIGTERM = 'trap "" TERM; sleep 60 & wait'


def members(group: int) -> list[int]:
    """The live processes of ``group`` (a killed child is a zombie until init reaps it, and a
    zombie still takes a signal)."""
    found = []
    for process in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(process.pid) == group and process.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
    return found


def group() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["bash", "-c", IGNORES_SIGTERM], start_new_session=True)


def test_the_groups_still_listed_are_stopped_when_the_pipe_closes() -> None:
    listed, forgotten = group(), group()
    reaper = subprocess.Popen([sys.executable, str(REAPER)], stdin=subprocess.PIPE)
    assert reaper.stdin is not None
    try:
        reaper.stdin.write(f"+{listed.pid}\n+{forgotten.pid}\n-{forgotten.pid}\n".encode())
        reaper.stdin.close()  # as dsat's death closes it
        assert reaper.wait(timeout=30) == 0
        assert listed.wait(timeout=5) < 0
        deadline = time.monotonic() + 5
        while members(listed.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert members(listed.pid) == []  # its sleep child too
        assert forgotten.poll() is None and alive(forgotten.pid)
    finally:
        for process in (listed, forgotten):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_a_group_already_gone_costs_no_wait() -> None:
    gone = subprocess.Popen(["true"], start_new_session=True)
    gone.wait()
    reaper = subprocess.Popen([sys.executable, str(REAPER)], stdin=subprocess.PIPE)
    assert reaper.stdin is not None
    began = time.monotonic()
    reaper.stdin.write(f"+{gone.pid}\nnot a line of dsat's\n".encode())
    reaper.stdin.close()
    assert reaper.wait(timeout=30) == 0
    assert time.monotonic() - began < 4  # no grace period spent on it
