"""Trials forked from warm workers (``fork_server``), as the local runner sees them.

One worker per slot, started at the slot's first trial with the slot's environment (accelerator,
devices, threads), so a forked trial sees what a fresh one would have seen at import. A trial
from a worker looks like any trial process: a pid that leads its own process group, a return
code (a signal's negative, as from ``subprocess``), output in its log. When a worker cannot serve
(its entrypoint is not ``python SCRIPT`` or ``python -m MODULE``, it went cold, or it died), the
runner starts that trial fresh; a worker that went cold is not started again for the slot (but a
trial host is, once the crash that ended one is shown to be its trial's, ``trust_again``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from dsat.runners.local.entrypoint import PYTHON_NAMES
from dsat.runners.local.trial_processes import group_reaper
from dsat.trial_failure import OUTSIDE_SIGNALS

logger = logging.getLogger(__name__)

# How long a worker may take to import the entrypoint's modules before its first trial starts.
READY_TIMEOUT_S = 600.0
WORKER_LOG = "warm-worker-{slot}.log"
LOST_RETURNCODE = 1
HOST_EXIT_WAIT_S = 5.0  # for a host that ended mid-trial to be reaped, its exit code read
# How long a closed worker's reader may take to read what the worker wrote before it exited.
READER_JOIN_S = 5.0
# Trial hosts in a row that a slot's trials left unfit after one trial each, before they fork.
HOSTS_LEFT_TO_FORK = 3


def warm_command(command: Sequence[str]) -> bool:
    """Whether a one-process trial command can run in a warm worker: ``python SCRIPT [ARGS]`` or
    ``python -m MODULE [ARGS]``, with no interpreter options that would change how it runs."""
    if len(command) < 2 or command[0] not in PYTHON_NAMES:
        return False
    if command[1] == "-m":
        return len(command) >= 3
    return not command[1].startswith("-") and command[1].endswith(".py")


class WarmProcess:
    """A trial forked by a worker: enough of ``subprocess.Popen`` for the runner to poll it,
    wait for it and stop its process group."""

    def __init__(
        self, pid: int, log_path: Path, hosted: bool = False, earlier_trials: int = 0
    ) -> None:
        self.pid = pid
        self.log_path = log_path
        self.hosted = hosted  # run in its worker, the slot's trial host, not forked
        self.earlier_trials = earlier_trials  # how many its worker started before it
        self.returncode: int | None = None
        self.stopped_by_dsat = False  # its timeout, or dsat stopping: not the trial's own end
        self._done = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"trial process {self.pid}", timeout or 0.0)
        assert self.returncode is not None  # set before _done
        return self.returncode

    def exited(self, returncode: int) -> None:
        self.returncode = returncode
        self._done.set()


class WarmWorker:
    """One slot's worker process and the thread that reads its events."""

    def __init__(
        self,
        command: Sequence[str],
        model_dir: Path,
        env: dict[str, str],
        log_path: Path,
        includes: Sequence[Path] = (),
        host: bool = False,
    ) -> None:
        """``host``: the worker runs its trials in itself, one after another (``trial_host``)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("ab")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dsat.runners.local.fork_server",
                *(["--host"] if host else []),
                str(os.getpid()),
                str(model_dir),
                *map(str, includes),
                "--",
                *command,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            cwd=log_path.parent,
            start_new_session=True,
        )
        # A host runs trials in itself, and a trial may ignore the SIGTERM its death signal is.
        group_reaper.watch(self.process.pid)
        self.cold_reason: str | None = None
        self.lost_a_trial = False  # it exited while a trial of it ran (not its first, for a host)
        self.leaving: str | None = None  # why a trial host serves no more trials (a leak)
        self.trials_started = 0
        self._replies: queue.Queue[WarmProcess | str] = queue.Queue()
        self._pending: dict[int, WarmProcess] = {}
        self._log_paths: queue.Queue[Path] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.cold_reason is None and self.leaving is None and self.process.poll() is None

    def _read(self) -> None:
        assert self.process.stdout is not None  # stdout=PIPE
        with self.process.stdout:  # closed here, by its only reader (left open: a ResourceWarning)
            self._read_events(self.process.stdout)
        self._lost()

    def _read_events(self, stdout: IO[bytes]) -> None:
        for line in stdout:
            try:
                event: dict[str, Any] = json.loads(line)
            except ValueError:
                continue
            kind = event.get("event")
            if kind == "started":
                trial = WarmProcess(
                    int(event["pid"]),
                    self._log_paths.get(),
                    bool(event.get("host")),
                    self.trials_started,
                )
                self.trials_started += 1
                self._pending[trial.pid] = trial
                self._replies.put(trial)
            elif kind == "exited":
                finished = self._pending.pop(int(event["pid"]), None)
                if finished is not None:
                    finished.exited(int(event["returncode"]))
            elif kind == "leaving":
                self.leaving = str(event.get("reason"))
            elif kind == "cold":
                self.cold_reason = str(event.get("reason"))
                self._replies.put(self.cold_reason)

    def _lost(self) -> None:
        """The worker is gone: its trials (killed with it) end as errors that say why."""
        self.cold_reason = self.cold_reason or "the warm worker exited"
        # A host's first trial ran as in a fresh process: its end there says nothing of hosting.
        self.lost_a_trial = bool(self._pending) and not all(
            t.hosted and t.earlier_trials == 0 for t in self._pending.values()
        )
        code: int | None = None
        if any(t.hosted for t in self._pending.values()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.process.wait(timeout=HOST_EXIT_WAIT_S)
        for trial in list(self._pending.values()):
            if trial.hosted and code is not None:
                # The host ran the trial in itself: its end (a segfault, an abort, a kill, the
                # script's own os._exit(0)) is the trial's, judged as a fresh process's exit
                # would be, not as a lost worker.
                what = (
                    "stopped the trial, and the trial host it ran in"
                    if trial.stopped_by_dsat
                    else f"the trial host it ran in was stopped by {signal.Signals(-code).name}"
                    # another process's, or the script's own
                    if -code in OUTSIDE_SIGNALS or -code == signal.SIGKILL
                    else "the trial ended the process it ran in"
                )
                note = f"\ndsat: {what} (exit code {code})\n"
                with contextlib.suppress(OSError), trial.log_path.open("ab") as log:
                    log.write(note.encode())
                assert code is not None
                trial.exited(code)
                continue
            with contextlib.suppress(OSError), trial.log_path.open("ab") as log:
                log.write(b"\ndsat: the warm worker that ran this trial exited; trial stopped\n")
            trial.exited(LOST_RETURNCODE)
        self._pending.clear()
        self._replies.put(self.cold_reason)
        if self.process.poll() is not None:
            group_reaper.forget(self.process.pid)

    def run(
        self, command: Sequence[str], cwd: Path, env: dict[str, str], log_path: Path
    ) -> WarmProcess | None:
        """Fork a trial; None when this worker cannot (the caller starts it fresh)."""
        if not self.alive:
            return None
        request = {"argv": list(command), "cwd": str(cwd), "env": env, "log": str(log_path)}
        self._log_paths.put(log_path)
        try:
            assert self.process.stdin is not None  # stdin=PIPE
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            reply = self._replies.get(timeout=READY_TIMEOUT_S)
        except (OSError, queue.Empty):
            self.close()
            return None
        return reply if isinstance(reply, WarmProcess) else None

    def close(self) -> None:
        """Stop the worker; trials it forked are stopped by the runner (or die with it)."""
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            self.process.terminate()
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        group_reaper.forget(self.process.pid)
        # The reader ends the trials the worker still had running (their exit news died with
        # it); once close returns, none of them polls as running.
        self._reader.join(timeout=READER_JOIN_S)
        self._log.close()
        # Kept where it says something (why the worker went cold); an empty one is noise.
        with contextlib.suppress(OSError):
            if self.log_path.stat().st_size == 0:
                self.log_path.unlink()


class WarmWorkers:
    """The workers of a machine's slots, each started at its slot's first trial."""

    def __init__(
        self,
        command: Sequence[str],
        model_dir: Path,
        includes: Sequence[Path],
        logs_dir: Path,
        host: bool = False,
    ) -> None:
        """``host``: each worker is its slot's trial host (``trial_host``)."""
        self.host = host
        self.command = list(command)
        self.model_dir = model_dir
        self.includes = list(includes)
        self.logs_dir = logs_dir
        self.workers: dict[str, WarmWorker] = {}
        self.cold: dict[str, str] = {}
        # Per slot, how many hosts in a row a trial left unfit after their first trial; and the
        # slots whose trials fork from a worker instead, once that is ``HOSTS_LEFT_TO_FORK``.
        self.hosts_left: dict[str, int] = {}
        self.forking: set[str] = set()

    def run(
        self,
        slot: str,
        worker_env: dict[str, str],
        cwd: Path,
        env: dict[str, str],
        log_path: Path,
    ) -> WarmProcess | None:
        """The trial on ``slot`` forked from its worker, or None: start it fresh."""
        if slot in self.cold or self._retire(slot):
            return None
        worker = self.workers.get(slot)
        if worker is None:
            worker = WarmWorker(
                self.command,
                self.model_dir,
                worker_env,
                self.logs_dir / WORKER_LOG.format(slot=slot),
                self.includes,
                self._hosts(slot),
            )
            self.workers[slot] = worker
        trial = worker.run(self.command, cwd, env, log_path)
        if trial is None and worker.cold_reason is not None:
            self._go_cold(slot, worker.cold_reason, worker.log_path)
        return trial

    def hosting(self, slot: str) -> bool:
        """Whether ``slot``'s next trial runs in a trial host rather than a fork."""
        self._retire(slot)
        return self._hosts(slot)

    def _hosts(self, slot: str) -> bool:
        """Whether ``slot``'s workers are trial hosts (not once its trials fork instead)."""
        return self.host and slot not in self.forking

    def _retire(self, slot: str) -> bool:
        """Stop ``slot``'s worker if it serves no more trials; True when the slot's trials start
        fresh from now on (``stop``)."""
        worker = self.workers.get(slot)
        if worker is None or worker.alive:
            return False
        self._count_hosts_left(slot, worker)
        return self.stop(slot)  # a crash, or a trial stopped in it

    def _count_hosts_left(self, slot: str, worker: WarmWorker) -> None:
        """Count a host the script left unfit after its first trial; at ``HOSTS_LEFT_TO_FORK``
        in a row, the slot's trials fork from a warm worker instead. A new host per trial costs
        a new process, its imports and its CUDA context each time, more than a fork of a worker
        that imported once; what the script leaves (a thread, an engine) dies with the fork."""
        if worker.leaving is None or worker.trials_started != 1:
            self.hosts_left.pop(slot, None)
            return
        self.hosts_left[slot] = left = self.hosts_left.get(slot, 0) + 1
        if left >= HOSTS_LEFT_TO_FORK and slot not in self.forking:
            self.forking.add(slot)
            logger.info(
                "slot %s: each of the last %d trials left its trial host unfit for the next "
                "(%s; see %s), so its trials fork from a warm worker from now on",
                slot,
                left,
                worker.leaving,
                worker.log_path,
            )

    def stop(self, slot: str, cold: bool = True, log_path: Path | None = None) -> bool:
        """Stop ``slot``'s worker now, if it has one; the slot's next trial starts another, or
        none when this host ended during a trial (as ``run`` would have found it): True then.
        Not ``cold`` where the host's end was the machine's (a kill from outside), which says
        nothing of what hosting leaves; ``log_path``: where its end is told (the trial's log)."""
        worker = self.workers.pop(slot, None)
        if worker is None:
            return False
        worker.close()
        if self.host and worker.lost_a_trial and cold:
            reason = "its trial host ended during a trial"
            self._go_cold(slot, reason, log_path or worker.log_path)
            return True
        return False

    def lost_a_trial(self, slot: str) -> bool:
        """Whether ``slot``'s worker ended during a trial (one that counts: ``WarmWorker``)."""
        worker = self.workers.get(slot)
        return worker is not None and worker.lost_a_trial

    def trust_again(self, slot: str, reason: str) -> None:
        """``slot``'s trials start in a trial host again, after its host's end was explained."""
        if self.cold.pop(slot, None) is not None:
            logger.info("slot %s: trials run in a trial host again (%s)", slot, reason)

    def _go_cold(self, slot: str, reason: str, log_path: Path) -> None:
        self.cold[slot] = reason
        logger.info(
            "slot %s: trials start in fresh processes from now on (%s; see %s)",
            slot,
            reason,
            log_path,
        )

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers.clear()
