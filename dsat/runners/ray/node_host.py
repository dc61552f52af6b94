"""One node's part of one trial on a Ray cluster: a Ray actor placed in the trial's placement group.

On its node it does what the local runner does on this machine: unpacks the model dir, writes the
hyperparameters beside it, starts the trial's command as a process group that dies with the actor
(``trial_guard``), stops that group when asked (SIGTERM, then SIGKILL), and reads what the process
left behind as its outcome (``trial_outcome.classify``), so an outcome means the same on every
runner. Every call returns at once: the runner polls, and the actor stays free to be stopped.

Ray is imported only inside the actor's methods that need it: this module loads without it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from dsat.constants import HPARAMS_FILE
from dsat.results.directory import FULL_RUN_DIR
from dsat.runners.local.deepspeed_ops import clear_stale_locks
from dsat.runners.local.entrypoint import NODE_PYTHON, trial_environment
from dsat.runners.local.runner import free_ports
from dsat.runners.local.trial_outcome import (
    classify,
    oom_kill_count,
    oom_killed_since,
    reported,
    stopped_note,
)
from dsat.runners.local.trial_processes import (
    guarded,
    kill_process_group,
    stop_strays,
    strays_note,
)
from dsat.runners.ray.model_archive import unpack

LOG_NAME = "trial.log"


# Where trials' copies go on every node, under the node's own temporary directory.
NODE_ROOT = "dsat-ray"


@functools.cache
def protocol() -> str:
    """Which dsat this is: its package's source hashed, every module by its path. A node with
    another dsat (an older one, installed once) fails the runner's calls with a TypeError in the
    middle of a trial, which read as a fault of the machine, three times a trial; or its trials
    measure and report as another version does."""
    package = Path(__file__).resolve().parents[2]  # dsat/
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


class TrialNodeHost:
    def __init__(self, name: str) -> None:
        """``name``: the trial's directory under this node's NODE_ROOT."""
        self.directory = Path(tempfile.gettempdir()) / NODE_ROOT / name
        self.log_path = self.directory.parent / f"{self.directory.name}.{LOG_NAME}"
        self.process: subprocess.Popen[bytes] | None = None
        self.log: IO[bytes] | None = None

    def node(self) -> tuple[str, str, str]:
        """This node's Ray id, the address the trial's other nodes reach it at, and the
        ``protocol`` its dsat speaks."""
        import ray

        context = ray.get_runtime_context()
        return context.get_node_id(), ray.util.get_node_ip_address(), protocol()

    def free_ports(self, count: int) -> list[int]:
        """Ports free on every interface of this node (the trial's other nodes connect to them)."""
        return free_ports(count, host="")

    def prepare(self, archive: bytes, files: dict[str, str]) -> str:
        """A fresh copy of the model dir (``archive``, a zip) with ``files`` written beside it."""
        if self.directory.exists():  # a trial run again after an interruption
            shutil.rmtree(self.directory)
        for attempt in range(3):
            try:
                self.directory.mkdir(parents=True)
                break
            except FileNotFoundError:  # the search's directory, removed as its last trial ended
                if attempt == 2:
                    raise
        unpack(archive, self.directory)
        for name, text in files.items():
            (self.directory / name).write_text(text)
        return str(self.directory)

    def start(self, command: list[str], env: dict[str, str]) -> list[str]:
        """Start the trial's command in its own process group, after removing the DeepSpeed
        op-build locks no living process holds (as the local runner does before each trial: a
        trial killed mid-build leaves one, and every later trial on the node waits on it until
        its timeout); returns the locks removed. ``NODE_PYTHON`` in ``command`` is this node's
        interpreter (dsat's on this node, where dsat[ray] is installed)."""
        command = [sys.executable if token == NODE_PYTHON else token for token in command]
        environ = trial_environment({**os.environ, **env})
        removed = [str(lock) for lock in clear_stale_locks(environ)]
        self.oom_kills_at_start = oom_kill_count()
        self.log = self.log_path.open("wb")
        self.log.write(f"$ {' '.join(command)}\n".encode())
        self.log.flush()
        self.process = subprocess.Popen(
            guarded(command),
            cwd=self.directory,
            env=environ,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return removed

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self) -> int | None:
        """Stop the trial's process group, if it runs; returns its exit code."""
        if self.process is not None and self.process.poll() is None:
            kill_process_group(self.process)
        return self.poll()

    def stop_left_running(self) -> list[str]:
        """Stop what the run left running on this node (``stop_strays``), and name it."""
        return stop_strays([self.directory / HPARAMS_FILE])

    def reported(self) -> bool:
        """Whether the trial has written its result (``trial_outcome.ResultWatch``)."""
        return reported(self.directory)

    def outcome(
        self,
        timed_out: bool,
        timeout: float,
        lingered: float | None = None,
        every_rank_here: bool = True,
        on_gpu: bool = False,
        shared: bool = False,
    ) -> dict[str, Any]:
        """What the process left behind, classified as the local runner classifies it, once
        what it left running on this node is stopped. ``lingered``: dsat stopped it that long
        after it wrote its result. ``every_rank_here``: the trial ran on this node alone, so its
        launcher's summary names every rank that failed. ``on_gpu``: it ran on this node's GPUs
        (an OOM of the node's own memory is then not the GPUs'). ``shared``: other trials ran
        on this node beside it (an OOM of the node's memory is then the machine's)."""
        notes = [
            stopped_note(self.directory, timed_out, timeout, lingered),
            strays_note(stop_strays([self.directory / HPARAMS_FILE])),
        ]
        if self.log is not None:
            self.log.write("".join(f"\n{line}\n" for line in notes if line).encode())
            self.log.close()
        end = classify(
            self.directory,
            self.log_path,
            self.poll(),
            timed_out,
            timeout,
            oom_killed_since(self.oom_kills_at_start),
            every_rank_here=every_rank_here,
            on_gpu=on_gpu,
            shared=shared,
        )
        cause = None if end.cause is None else end.cause.value
        return {
            "status": end.status.value,
            "metrics": end.metrics,
            "error": end.error,
            "cause": cause,
        }

    def read_log(self, offset: int, limit: int) -> bytes:
        """The log from ``offset``, at most ``limit`` bytes."""
        try:
            with self.log_path.open("rb") as handle:
                handle.seek(offset)
                return handle.read(limit)
        except OSError:
            return b""

    def read_files(self, names: list[str]) -> dict[str, tuple[str, float]]:
        """Of the files ``names`` in the trial's directory, those present: text and mtime."""
        found = {}
        for name in names:
            path = self.directory / name
            if path.is_file():
                found[name] = (path.read_text(errors="replace"), path.stat().st_mtime)
        return found

    def files(self) -> list[tuple[str, int, int]]:
        """Every regular file in the trial's copy: its path relative to the copy, its size and
        its permission bits. After a full run, these are the model dir with what the run wrote
        beside it (its checkpoints, its outputs)."""
        found = []
        for directory, _, names in os.walk(self.directory):
            for name in sorted(names):
                path = Path(directory) / name
                if path.is_file() and not path.is_symlink():
                    status = path.stat()
                    relative = str(path.relative_to(self.directory))
                    found.append((relative, status.st_size, status.st_mode & 0o777))
        return found

    def read_file(self, relative: str, offset: int, limit: int) -> bytes:
        """At most ``limit`` bytes of the copy's file ``relative``, from ``offset``."""
        with (self.directory / relative).open("rb") as handle:
            handle.seek(offset)
            return handle.read(limit)

    def clean(self) -> None:
        """Remove the trial's copy and log from the node (the runner has fetched what it keeps);
        what cannot be removed (a file where the search's directory should be) stays."""
        shutil.rmtree(self.directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.log_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the search's directory, once no trial is left in it
            self.directory.parent.rmdir()


def left_behind_log(name: str, offset: int, clean: bool = True) -> bytes:
    """Trial ``name``'s log on this node from ``offset``, and (``clean``) its copy and log
    removed: run on the node after the trial's actor died there (Ray's memory monitor, a worker
    crash), when nothing else reads or cleans them. A Ray task pinned to the node runs it. The
    full run's copy stays: what it wrote is the user's."""
    host = TrialNodeHost(name)
    try:
        with host.log_path.open("rb") as handle:
            handle.seek(offset)
            found = handle.read()
    except OSError:
        found = b""
    if clean:
        host.clean()
    return found


def clear_earlier_copies(search_name: str) -> None:
    """Remove what an earlier run of this search left on this node: a dsat killed with SIGKILL
    (or a lost driver) removes no trial's copy, and a resume runs those trials again under new
    names, so each such copy, a whole model dir, stayed for good. The full run's copies stay: what
    it wrote is the user's until the next full run replaces it. Run by a Ray task pinned to the
    node as the search opens; the directory lock keeps a second dsat off this search."""
    root = Path(tempfile.gettempdir()) / NODE_ROOT / search_name
    try:
        entries = list(root.iterdir())
    except OSError:  # none left, or nothing this process may read
        return
    for entry in entries:
        if entry.name.startswith(FULL_RUN_DIR):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
    with contextlib.suppress(OSError):
        root.rmdir()
