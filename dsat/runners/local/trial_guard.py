"""Runs one trial's command and takes the trial's whole process group down when dsat dies.

The local runner starts every trial (and the full run) as ``python trial_guard.py DSAT_PID --
COMMAND...``, in a process group of its own. The kernel signals this guard as soon as dsat ends,
whatever ended it, SIGKILL included (``PR_SET_PDEATHSIG``); the guard then stops the group, so no
trial outlives the search that started it and keeps holding a GPU. Otherwise it only waits, and
exits as its command did, so the runner reads the same exit status.

It is run as a file, not a module, and imports nothing from dsat: it starts in milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h
GRACE_SECONDS = 5.0


class Stop(Exception):
    """dsat is gone, or it is stopping this trial."""


def _stop(signum: int, frame: object) -> None:
    raise Stop


def sigterm_when_parent_dies() -> None:
    """Have the kernel send this process SIGTERM when its parent exits (where prctl is missing,
    a resumed search still stops leftovers)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def die_with(parent: int) -> None:
    """Stop when ``parent`` (dsat, or the Ray actor that started the trial) exits."""
    sigterm_when_parent_dies()
    if os.getppid() != parent:  # it died before the guard was armed
        raise Stop


def arm_command() -> None:
    """Run in the command's process before it starts: it gets SIGTERM if this guard dies without
    stopping it. Ray SIGKILLs the children of a worker it ends, this guard among them; the
    command, a grandchild, would live on. torchrun stops its workers on that SIGTERM."""
    guard = os.getppid()
    sigterm_when_parent_dies()
    if os.getppid() != guard:
        os.kill(os.getpid(), signal.SIGTERM)


def stop_group(child: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM to the group (torchrun stops its workers on it), SIGKILL after a grace period to
    whatever is left, this guard included."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    if child is not None:
        try:
            child.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
    os.killpg(0, signal.SIGKILL)


def exit_like(returncode: int) -> None:
    """Exit with the command's status; a command killed by a signal kills the guard with it."""
    if returncode < 0:
        if -returncode != signal.SIGKILL:  # SIGKILL's action cannot be set, and needs not be
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    sys.exit(returncode)


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: trial_guard.py DSAT_PID -- COMMAND...")
    signal.signal(signal.SIGTERM, _stop)
    child: subprocess.Popen[bytes] | None = None
    try:
        die_with(int(argv[1]))
        child = subprocess.Popen(argv[3:], preexec_fn=arm_command)
        returncode = child.wait()
    except OSError as err:  # the command itself cannot start: the trial's log says why
        print(f"cannot run {argv[3]}: {err}", file=sys.stderr)
        sys.exit(127)
    except Stop:
        stop_group(child)
        return
    exit_like(returncode)


if __name__ == "__main__":
    main(sys.argv)
