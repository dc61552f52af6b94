"""The local runner: each trial a process group on this machine, in a copy of the model dir.

A trial gets its own working directory (MODEL_DIR and the `--include`s copied; the user's files are
never touched), its hyperparameters in a JSON file that `dsat.get_hparams()` reads, disjoint slots
(GPUs through CUDA_VISIBLE_DEVICES, or CPU slots with DS_ACCELERATOR=cpu), and a log file in the
results directory. What it leaves behind decides its outcome (``trial_outcome``).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from dsat.atomic_file import write_json_atomic
from dsat.constants import (
    ENV_HPARAMS_FILE,
    ENV_RESULTS_DIR,
    ENV_TRIAL_LENGTH,
    HPARAMS_FILE,
    LINGERED_KEY,
    METRICS_FILE,
    MODEL_INFO_FILE,
    RESULTS_ROOT,
    STATE_FILE,
    TRIAL_OUTCOME_FILE,
)
from dsat.paths import shown
from dsat.results.directory import FULL_RUN_DIR, TRIALS_FILE, full_run_log, trials_numbered
from dsat.runners.local.deepspeed_ops import clear_stale_locks
from dsat.runners.local.entrypoint import (
    rendezvous_environment,
    trial_command,
    trial_environment,
)
from dsat.runners.local.full_run import run_to_the_end
from dsat.runners.local.log_cap import cap_log
from dsat.runners.local.slots import SlotPool
from dsat.runners.local.trial_copy import (
    LARGE_FILE_BYTES,
    drop_empty_launcher_logs,
    drop_unchanged_copies,
)
from dsat.runners.local.trial_outcome import (
    LINGER_S,
    ResultWatch,
    TrialEnd,
    classify,
    oom_kill_count,
    oom_killed_since,
    reported,
    stopped_note,
)
from dsat.runners.local.trial_processes import (
    TrialProcess,
    guarded,
    kill_process_group,
    stop_strays,
    strays_note,
)
from dsat.runners.local.trial_timeout import TrialTimeout
from dsat.runners.local.warm_trials import WarmProcess, WarmWorkers, warm_command
from dsat.runners.trial_runner import StoppedRun
from dsat.trial import TrialOutcome, TrialStatus
from dsat.trial_failure import FailureCause

POLL_SECONDS = 0.1
# After the command on a trial log's first line when the trial was forked from a warm worker.
WARM_TRIAL_MARK = "# forked from a warm worker"
HOST_TRIAL_MARK = "# run in the slot's trial host (--trial-host)"
# DeepSpeed's result files and dsat's outcome file, left in MODEL_DIR by a run by hand, would
# read as the result of every trial made from its copy.
COPY_IGNORE = shutil.ignore_patterns(
    ".git",
    "__pycache__",
    "*.pyc",
    ".venv",
    RESULTS_ROOT,
    MODEL_INFO_FILE,
    METRICS_FILE,
    TRIAL_OUTCOME_FILE,
)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports free on ``host`` right now, all different (every socket stays open until all are
    bound)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class RunningTrial:
    request_id: str
    process: TrialProcess
    directory: Path
    log_path: Path
    log: IO[bytes]
    slots: list[str]
    start: float
    oom_kills_at_start: int | None
    hparams: dict[str, Any]
    length: int
    # When it runs again in a fresh process (after a failure in a trial host): when that run
    # started (its timeout counts from there), where its part of the log begins, and the slots
    # whose host ended during the first run.
    rerun_start: float | None = None
    rerun_log_start: int = 0
    host_lost_on: list[str] = field(default_factory=list)
    result_watch: ResultWatch = field(default_factory=ResultWatch)
    shared: bool = False  # another trial ran beside it at some time (trial_outcome.classify)

    @property
    def run_start(self) -> float:
        """When its current run started: the fresh run's, where it runs again."""
        return self.start if self.rerun_start is None else self.rerun_start


def copy_ignore(results_dir: Path) -> Callable[[str, list[str]], set[str]]:
    """What a trial's copy leaves out: caches, environments, and dsat's results, this search's
    and earlier ones' (which may lie inside MODEL_DIR, as with `--results-dir out` or the
    default from `.`): each search copied every earlier one into each of its trials. And a link
    to a folder the copy is already in (``loop -> .``, ``up -> ..``, two folders linking each
    other): followed, as links to folders are, it copied the tree into itself until its paths
    grew too long, a copy as many times the size as it went deep."""

    def ignore(directory: str, names: list[str]) -> set[str]:
        ignored = set(COPY_IGNORE(directory, names))
        ignored.update(n for n in names if only_results(Path(directory, n), results_dir))
        ignored.update(n for n in names if links_to_a_folder_above(Path(directory), n))
        return ignored

    return ignore


def links_to_a_folder_above(directory: Path, name: str) -> bool:
    """Whether ``directory/name`` links to ``directory`` or a folder above it, as ``directory``
    was reached (through the links it was reached by)."""
    path = directory / name
    if not path.is_symlink():
        return False
    target = os.path.realpath(path)
    return any(os.path.realpath(p) == target for p in (directory, *directory.parents))


def only_results(path: Path, results_dir: Path) -> bool:
    """Whether ``path`` is search results, or a folder above this search's that holds nothing
    else (``--results-dir runs/a`` left an empty ``runs/`` in every trial's copy)."""
    if path == results_dir or holds_search_results(path):
        return True
    if not results_dir.is_relative_to(path) or not path.is_dir():
        return False
    return all(only_results(child, results_dir) for child in path.iterdir())


def holds_search_results(path: Path) -> bool:
    """Whether ``path`` is a dsat search's results directory (its state or its trials' rows)."""
    return (path / STATE_FILE).is_file() or (path / TRIALS_FILE).is_file()


def prepare_trial_directory(
    directory: Path,
    model_dir: Path,
    includes: tuple[Path, ...],
    hparams: dict[str, Any],
    results_dir: Path,
) -> None:
    """A fresh copy of the model dir and the includes, with the hyperparameters beside them."""
    if directory.exists():  # a resumed search re-runs an interrupted trial from scratch
        shutil.rmtree(directory)
    ignore = copy_ignore(results_dir)
    shutil.copytree(model_dir, directory, ignore=ignore)
    for include in includes:
        target = directory / include.name
        if include.is_dir():
            shutil.copytree(include, target, ignore=ignore, dirs_exist_ok=True)
        else:
            shutil.copy2(include, target)
    writable_by_owner(directory)
    write_json_atomic(directory / HPARAMS_FILE, hparams)


def writable_by_owner(directory: Path) -> None:
    """The copy's folders and files made writable by their owner: a read-only model dir (a
    shared checkout, a mounted dataset's code) copied with its modes stopped every search at its
    first trial ("cannot write trials/001-.../dsat_hparams.json"), and a results directory left
    so could not be removed."""
    for folder, _, names in os.walk(directory):
        for path in (folder, *(os.path.join(folder, name) for name in names)):
            if os.path.islink(path):
                continue
            mode = os.stat(path).st_mode
            if not mode & stat.S_IWUSR:
                os.chmod(path, stat.S_IMODE(mode) | stat.S_IWUSR)


def cores_each(processes: int) -> int:
    """This machine's cores shared out among ``processes`` (at least one each): a CPU slot's
    threads, or a full run's processes', which run alone."""
    return max(1, (os.cpu_count() or 1) // max(processes, 1))


class LocalRunner:
    """Trials as process groups on this machine's slots (see the module's docstring)."""

    takes_real_time = True

    def __init__(
        self,
        entrypoint: list[str],
        model_dir: Path,
        includes: tuple[Path, ...],
        results_dir: Path,
        pool: SlotPool,
        slots_per_trial: int,
        timeout: TrialTimeout,
        environ: dict[str, str] | None = None,
        warm: bool = True,
        trial_host: bool = False,
    ) -> None:
        """``warm``: fork one-process trials from a warm worker per slot (``warm_trials``) when
        the entrypoint allows it; otherwise every trial starts a fresh interpreter.
        ``trial_host``: run them one after another in a host per slot instead (``trial_host``)."""
        self.entrypoint = entrypoint
        self.model_dir = model_dir
        self.includes = includes
        self.results_dir = results_dir
        self.pool = pool
        self.slots_per_trial = slots_per_trial
        self.timeout = timeout
        self.linger_s = LINGER_S
        self.environ = trial_environment(os.environ if environ is None else environ)
        self.cpu_threads = cores_each(pool.size)
        self.running: dict[str, RunningTrial] = {}
        self.starting: StoppedRun | None = None  # the trial ``start`` is starting
        self.started_at = time.monotonic()
        self._count = trials_numbered(results_dir)
        single = trial_command(entrypoint, 1, 0)  # one process: no port in the command
        self.warm_workers = (
            WarmWorkers(single, model_dir, includes, results_dir / "logs", trial_host)
            if warm and slots_per_trial == 1 and warm_command(single)
            else None
        )

    def now(self) -> float:
        return time.monotonic() - self.started_at

    @property
    def slot_limit(self) -> int:
        return self.pool.size + sum(len(trial.slots) for trial in self.running.values())

    @property
    def slot_kind(self) -> str:
        return "GPU" if self.pool.on_gpu else "CPU"

    def running_count(self) -> int:
        return len(self.running)

    def _prepare_directory(self, request_id: str, hparams: dict[str, Any]) -> Path:
        self._count += 1
        directory = self.results_dir / "trials" / f"{self._count:03d}-{request_id[:8]}"
        prepare_trial_directory(directory, self.model_dir, self.includes, hparams, self.results_dir)
        return directory

    def environment(
        self,
        directory: Path,
        slots: list[str],
        ports: list[int],
        length: int | None = None,
        alone: bool = False,
    ) -> dict[str, str]:
        """The trial's environment: where its hyperparameters are, its slots, its rank, and the
        length of its searcher operation (which off-cluster Determined would make 1).

        ``ports``: three free ports, torch.distributed's first, then Determined's two.
        ``alone``: nothing runs beside it (the full run): on the CPU its processes share every
        core, not a slot's share (with --max-slots 2 the full run trained on one of two)."""
        env = self.slot_environment(slots)
        if alone and not self.pool.on_gpu:
            env["OMP_NUM_THREADS"] = str(cores_each(self.slots_per_trial))
        env[ENV_HPARAMS_FILE] = str(directory / HPARAMS_FILE)
        if length is not None:
            env[ENV_TRIAL_LENGTH] = str(length)
        env.update(rendezvous_environment(self.slots_per_trial, 1, ports))
        return env

    def slot_environment(self, slots: list[str]) -> dict[str, str]:
        """What every trial on ``slots`` sees, whichever trial it is: the devices or threads, and
        the results directory (by which a resumed search finds processes left running)."""
        env = dict(self.environ)
        env[ENV_RESULTS_DIR] = str(self.results_dir)
        if self.pool.on_gpu:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(slots)
        else:
            env["DS_ACCELERATOR"] = "cpu"
            env["OMP_NUM_THREADS"] = str(self.cpu_threads)
        return env

    def op_build_environment(self) -> dict[str, str]:
        """The environment in which DeepSpeed's ops are built for these trials."""
        env = dict(self.environ)
        if not self.pool.on_gpu:
            env["DS_ACCELERATOR"] = "cpu"
        return env

    def spawn(
        self,
        directory: Path,
        slots: list[str],
        stdout: IO[bytes] | int,
        log: IO[bytes],
        length: int | None = None,
        alone: bool = False,
    ) -> tuple[subprocess.Popen[bytes], list[str]]:
        """The entrypoint in ``directory`` on ``slots``, in a process group of its own that dies
        with dsat (``trial_guard``); returns the process and the command, which goes first into
        ``log``."""
        ports = free_ports(3)
        command = trial_command(self.entrypoint, self.slots_per_trial, ports[0])
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            guarded(command),
            cwd=directory,
            env=self.environment(directory, slots, ports, length, alone),
            stdout=stdout,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return process, command

    def start(
        self, request_id: str, hparams: dict[str, Any], ds_config: dict[str, Any], length: int
    ) -> None:
        directory = self._prepare_directory(request_id, hparams)
        slots = self.pool.take(self.slots_per_trial)
        log_path = self.results_dir / "logs" / f"{directory.name}.log"
        # Until it runs, a stop counts it from here (a warm worker may take a while to take it).
        self.starting = StoppedRun(request_id, self.now(), self.now(), str(log_path))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = log_path.open("wb")
        # A build lock left by a killed trial would make this one wait on it until its timeout.
        clear_stale_locks(self.environ)
        process = self._fork_warm(directory, slots, log, log_path, length)
        if process is None:
            process, _ = self.spawn(directory, slots, log, log, length)
        for other in self.running.values():
            other.shared = True
        self.running[request_id] = RunningTrial(
            request_id,
            process,
            directory,
            log_path,
            log,
            slots,
            self.now(),
            oom_kill_count(),
            hparams,
            length,
            result_watch=ResultWatch(self.linger_s),
            shared=bool(self.running),
        )
        self.starting = None

    def _fork_warm(
        self, directory: Path, slots: list[str], log: IO[bytes], log_path: Path, length: int
    ) -> TrialProcess | None:
        """The trial forked from its slot's warm worker (or run in it, the slot's trial host),
        or None if it must start fresh."""
        if self.warm_workers is None:
            return None
        mark = HOST_TRIAL_MARK if self.warm_workers.hosting(slots[0]) else WARM_TRIAL_MARK
        log.write(f"$ {' '.join(self.warm_workers.command)}  {mark}\n".encode())
        log.flush()
        worker_env = self.slot_environment(slots)
        if self.pool.on_gpu:  # torch.cuda.is_available() without starting CUDA before a fork
            worker_env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        env = self.environment(directory, slots, free_ports(3), length)
        process = self.warm_workers.run(slots[0], worker_env, directory, env, log_path)
        if process is None:
            log.seek(0)
            log.truncate()
        return process

    def _confirm_in_fresh_process(
        self, trial: RunningTrial, end: TrialEnd, code: int | None
    ) -> bool:
        """Run a trial that ran out of memory or failed in a trial host after other trials again
        in a fresh process, whose outcome stands: what the host's earlier trials left (on the
        device, or a sticky CUDA error) must not be blamed on a configuration. False when the
        outcome is the trial's own: it completed or timed out, ran fresh or forked, was its
        host's first, or exited cleanly without a result (the script's doing, whatever ran it).
        A host a trial failed in is stopped either way: it may be broken."""
        if (
            end.status not in (TrialStatus.OOM, TrialStatus.ERROR)
            or code == 0
            or not getattr(trial.process, "hosted", False)
        ):
            return False
        again = getattr(trial.process, "earlier_trials", 0) > 0
        if self.warm_workers is not None:
            # One that ended during the trial is gone; on a GPU, before a fresh run, its CUDA
            # context and process group hold device memory the fresh process would lack, which
            # could make its OOM the host's. The slot's next trial starts a new host (none,
            # where one ended during a trial after others).
            # A host killed from outside (the machine's) says nothing of what hosting leaves:
            # its slot goes on hosting.
            stop = end.status is TrialStatus.ERROR or (again and self.pool.on_gpu)
            cold = end.cause is not FailureCause.MACHINE
            for slot in trial.slots:
                if (stop or self.warm_workers.lost_a_trial(slot)) and self.warm_workers.stop(
                    slot, cold, trial.log_path
                ):
                    trial.host_lost_on.append(slot)
        if not again or end.cause in (FailureCause.MACHINE, FailureCause.SCRIPT):
            # Killed from outside: the machine's, whatever ran before it in the host, as for
            # its host's first trial (said on screen, run again, counted among the attempts).
            # The script's: no configuration is blamed, and the next trial starts a new host.
            return False
        what = "out of memory" if end.status is TrialStatus.OOM else "failed"
        self._note(
            trial,
            f"dsat: {what} in the trial host; running it again in a fresh process "
            "before the configuration is blamed",
        )
        trial.log.flush()
        trial.rerun_log_start = trial.log.tell()  # the fresh run is judged by its own output
        # A build lock the host held when it ended would make the fresh run wait on it.
        clear_stale_locks(self.environ)
        prepare_trial_directory(
            trial.directory, self.model_dir, self.includes, trial.hparams, self.results_dir
        )
        trial.process, _ = self.spawn(
            trial.directory, trial.slots, trial.log, trial.log, trial.length
        )
        trial.rerun_start = self.now()
        trial.result_watch = ResultWatch(self.linger_s)
        trial.oom_kills_at_start = oom_kill_count()
        return True

    def _trust_hosts_again(self, trial: RunningTrial) -> None:
        """The trial failed in a fresh process too (out of memory, or otherwise): its host's end
        was the configuration's doing, not something hosting left, so the slots' later trials
        run in hosts again."""
        assert self.warm_workers is not None  # only hosted trials lose a host
        for slot in trial.host_lost_on:
            self.warm_workers.trust_again(
                slot, "the trial its last host ended in failed in a fresh process too"
            )

    def _classified(self, trial: RunningTrial, timed_out: bool) -> TrialEnd:
        """What the finished trial's exit, outcome file and log say about it."""
        return classify(
            trial.directory,
            trial.log_path,
            trial.process.returncode,
            timed_out,
            self.timeout.seconds,
            oom_killed_since(trial.oom_kills_at_start),
            trial.rerun_log_start,
            on_gpu=self.pool.on_gpu,
            shared=trial.shared,
        )

    def wait(self) -> TrialOutcome:
        while True:
            for trial in list(self.running.values()):
                code = trial.process.poll()
                lingered = None if code is not None else self._lingered(trial)
                timed_out = code is None and (
                    lingered is not None or self.now() - trial.run_start > self.timeout.seconds
                )
                if code is None and not timed_out:
                    continue
                if timed_out:
                    self._kill(trial)
                self._note(
                    trial, stopped_note(trial.directory, timed_out, self.timeout.seconds, lingered)
                )
                end = self._classified(trial, timed_out)
                if lingered is not None and end.status is TrialStatus.COMPLETED:
                    end = end._replace(metrics={**end.metrics, LINGERED_KEY: round(lingered)})
                if self._confirm_in_fresh_process(trial, end, code):
                    continue
                if (
                    trial.rerun_start is not None
                    and trial.host_lost_on
                    and end.status in (TrialStatus.ERROR, TrialStatus.OOM)
                ):
                    self._trust_hosts_again(trial)
                return self._finish(trial, end)
            time.sleep(POLL_SECONDS)

    def _lingered(self, trial: RunningTrial) -> float | None:
        """Seconds since the trial wrote its result, where it has run on past ``linger_s``. A
        trial host says itself what a trial left running once the trial returns, but one whose
        main thread blocks (an upload that hangs) never returns: the host is stopped then."""
        return trial.result_watch.lingered(self.now(), lambda: reported(trial.directory))

    def _finish(self, trial: RunningTrial, classified: TrialEnd) -> TrialOutcome:
        del self.running[trial.request_id]
        self._note(
            trial, strays_note(stop_strays([trial.directory / HPARAMS_FILE], {trial.process.pid}))
        )
        drop_empty_launcher_logs(trial.directory)
        freed = drop_unchanged_copies(trial.directory, self.model_dir, self.includes)
        if freed:
            self._note(
                trial,
                f"dsat: removed from this trial's copy the files of {LARGE_FILE_BYTES // 2**20} "
                f"MiB or more it left unchanged ({freed / 2**20:.0f} MiB; the originals are "
                "where they were)",
            )
        trial.log.close()
        cap_log(trial.log_path)
        self.pool.give_back(trial.slots)
        status, metrics, error, cause = classified
        end = self.now()
        if status is TrialStatus.COMPLETED:  # the first to complete is the model-profile trial
            # Until its result was written: a minute it lingered after made every later trial's
            # timeout ten minutes longer.
            reported = trial.result_watch.reported_at
            self.timeout.profile_finished(min(end, reported or end) - trial.run_start)
        return TrialOutcome(
            trial.request_id, status, metrics, error, trial.start, end, cause, str(trial.log_path)
        )

    @staticmethod
    def _note(trial: RunningTrial, line: str | None) -> None:
        """Add dsat's own line to the trial's log, after whatever a trial host wrote to it."""
        if line is not None:
            trial.log.seek(0, os.SEEK_END)
            trial.log.write(f"\n{line}\n".encode())

    def _kill(self, trial: RunningTrial) -> None:
        if isinstance(trial.process, WarmProcess):
            trial.process.stopped_by_dsat = True
        kill_process_group(trial.process)

    def stop_all(self) -> list[StoppedRun]:
        stopped = [trial.directory / HPARAMS_FILE for trial in self.running.values()]
        runs = []
        if self.starting is not None:  # the stop landed while it started
            runs.append(replace(self.starting, end=self.now()))
            self.starting = None
        for trial in list(self.running.values()):
            self._kill(trial)
            runs.append(StoppedRun(trial.request_id, trial.start, self.now(), str(trial.log_path)))
            trial.log.close()
            self.pool.give_back(trial.slots)
            # A stopped trial runs again under a new number: its copy stays, its data need not.
            drop_unchanged_copies(trial.directory, self.model_dir, self.includes)
            drop_empty_launcher_logs(trial.directory)
        self.running.clear()
        # What they started in sessions of their own outlived their groups (a Ctrl-C left a
        # trial's `sleep 1000` running under init, with the search's results dir in its env).
        stop_strays(stopped)
        self.close()
        return runs

    def close(self) -> None:
        """Stop the warm workers (a later trial starts them again)."""
        if self.warm_workers is not None:
            self.warm_workers.close()

    def run_full_experiment(self, hparams: dict[str, Any], length: int | None = None) -> None:
        directory = self.results_dir / FULL_RUN_DIR
        prepare_trial_directory(directory, self.model_dir, self.includes, hparams, self.results_dir)
        print(
            f"dsat: full experiment in {shown(directory)} ({HPARAMS_FILE} holds the best overrides)"
        )
        slots = self.pool.take(self.slots_per_trial)

        def stop_left_running() -> None:
            note = strays_note(stop_strays([directory / HPARAMS_FILE]), "the full experiment")
            if note:
                print(note, flush=True)

        try:
            run_to_the_end(
                full_run_log(self.results_dir),
                lambda log: self.spawn(directory, slots, subprocess.PIPE, log, length, alone=True),
                stop_left_running,
            )
        finally:
            drop_empty_launcher_logs(directory)
            self.pool.give_back(slots)
