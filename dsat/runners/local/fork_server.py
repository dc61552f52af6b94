"""A warm worker: imports a trial script's modules once, then forks a child for each trial.

Start-up is most of what a short trial costs (on the CPU example, 5.5 s of a 5.6 s trial:
importing torch and DeepSpeed, the modules DeepSpeed imports lazily in ``initialize``, and the
interpreter's teardown). The local runner starts one of these per slot; each trial is still a
process of its own (a fork of this one, in a process group of its own, with the trial's
environment, working directory and log), so nothing a trial does reaches the next one. Only
imports are shared: the worker imports what the script imports at its top, and after every
trial what that trial imported from outside its own directory.

It stays fork-safe or goes away: a fork must not copy a started CUDA context or a running thread,
so when an import leaves either behind, the worker says it is cold and exits, and the runner
starts later trials fresh. Threads a library stops for a fork and starts again when the child
needs them (OpenBLAS's, which numpy starts on import when more than one thread is allowed, as on
any GPU machine or a CPU with cores to spare) are no reason to go cold.

With ``--host`` (dsat's ``--trial-host``) the worker forks nothing: it is the slot's trial host,
and runs each trial in itself (``trial_host``), so a fork's safety does not matter and the CUDA
context and process group its first trial makes serve the next. A trial that leaves the process
unfit for the next (``process_reset``'s leak check) ends the worker after its outcome; the runner
starts another for the next trial.

Protocol, one JSON object per line (never pickle): requests on stdin
``{"argv": [...], "cwd": ..., "env": {...}, "log": ...}``; on the original stdout the events
``{"event": "started", "pid": N, "host": bool}``, ``{"event": "exited", "pid": N, "returncode":
N}``, ``{"event": "cold", "reason": ...}`` and, from a host about to leave, ``{"event":
"leaving", "reason": ...}``. Anything a module prints goes to stderr, which the runner keeps as
the worker's log.

    python -m dsat.runners.local.fork_server [--host] DSAT_PID MODEL_DIR [INCLUDE...] -- python3 SCRIPT [ARGS...]
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import gc
import importlib
import importlib.machinery
import json
import os
import random
import runpy
import selectors
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from dsat.runners.local.process_reset import native_thread_ids
from dsat.runners.local.trial_guard import PR_SET_PDEATHSIG, Stop, die_with

USAGE = "[--host] DSAT_PID MODEL_DIR [INCLUDE...] -- python3 SCRIPT|-m MODULE [ARGS...]"
POLL_SECONDS = 0.05
LOST_EXIT = 1  # a trial whose worker died before it could start


def script_imports(source: str) -> list[str]:
    """The absolute module names a script imports anywhere, in order of appearance."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return list(dict.fromkeys(names))


# What a file that Python imports as a module ends with (importlib.machinery's suffixes).
MODULE_SUFFIXES = tuple(importlib.machinery.all_suffixes())


def local_names(model_dir: Path, includes: Sequence[Path]) -> set[str]:
    """The top-level module names a trial's directory provides: the model dir's modules and
    folders, and each include (copied beside them). Each trial imports those from its own copy;
    the worker never does, or it would hand trials a namesake from site-packages. Only what
    Python can import counts: the ``deepspeed.yaml`` beside every script is no module named
    ``deepspeed``."""
    entries = [*model_dir.iterdir(), *includes] if model_dir.is_dir() else list(includes)
    return {
        entry.name if entry.is_dir() else entry.name.split(".")[0]
        for entry in entries
        if entry.is_dir() or entry.name.endswith(MODULE_SUFFIXES)
    }


def is_local(name: str, local: set[str]) -> bool:
    return name.partition(".")[0] in local


def import_quietly(names: Iterable[str]) -> list[str]:
    """Import what can be imported; a module that fails here fails again, visibly, in the trial.
    Returns the imports after which this process had more threads, so that a worker that goes
    cold can say which to blame (one whose threads stop for a fork may be among them)."""
    started: list[str] = []
    for name in names:
        if name in sys.modules:
            continue
        before = thread_count()
        try:
            importlib.import_module(name)
        except Stop:  # dsat is stopping this worker
            raise
        except (Exception, SystemExit):  # the trial reports its own import errors
            pass
        if thread_count() > before:
            started.append(name)
    return started


def thread_count() -> int:
    """Threads of this process, native ones included where the system shows them."""
    return len(native_thread_ids()) or threading.active_count()


def thread_names() -> list[str]:
    """The names of this process's threads other than the main one: Python's own where it
    started them, else the system's (a native thread's ``comm``), as ``ps -L`` shows them."""
    python = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    names = []
    for tid in sorted(native_thread_ids() or python):
        if tid == os.getpid():
            continue
        name = python.get(tid)
        if name is None:
            with contextlib.suppress(OSError):
                name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        names.append(name or str(tid))
    return names


def cuda_driver_loaded() -> bool:
    """Whether the CUDA driver library is mapped into this process: an import that asks whether
    CUDA works (Triton, DeepSpeed's accelerator check) loads and initialises it, which
    ``torch.cuda.is_initialized()`` does not see, and a forked child cannot use it."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return "libcuda.so" in maps


def threads_left_by_a_fork() -> int:
    """This process's threads once a fork has run its handlers: a library that stops its threads
    for a fork (``pthread_atfork``) and starts them again when next needed leaves none behind."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return thread_count()


def unsafe_to_fork(blamed: Sequence[str] = ()) -> str | None:
    """Why forking now could hand a trial a broken process, or None; ``blamed``: the imports
    after which threads appeared, named in the reason."""
    by = f" ({', '.join(blamed[:3])})" if blamed else ""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
        return f"an import{by} started CUDA, which a forked process cannot use"
    if thread_count() > 1 and threads_left_by_a_fork() > 1:
        names = ", ".join(thread_names()) or "native"
        driver = "; the CUDA driver is loaded" if cuda_driver_loaded() else ""
        return f"an import{by} started threads ({names}{driver}), which a fork would not copy"
    return None


def learned_modules(path: Path, local: set[str]) -> list[str]:
    """What a finished trial imported that this worker has not, leaving out the user's modules."""
    try:
        names = json.loads(path.read_text())
        path.unlink()
    except (OSError, ValueError):
        return []
    if not isinstance(names, list):
        return []
    return [
        n for n in names if isinstance(n, str) and n not in sys.modules and not is_local(n, local)
    ]


def imported_from_elsewhere(directory: str) -> list[str]:
    """The modules of this process that were not loaded from ``directory`` (the trial's own)."""
    inside = os.path.join(os.path.abspath(directory), "")
    return [
        name
        for name, module in list(sys.modules.items())
        if not str(getattr(module, "__file__", None) or "").startswith(inside)
    ]


def exit_code(err: SystemExit) -> int:
    """The status a Python process exits with for ``sys.exit(err.code)``."""
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code
    print(err.code, file=sys.stderr)
    return 1


def run_entry(command: list[str]) -> int:
    """``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` in this process, as the interpreter
    would run it; returns the exit status."""
    try:
        if command[1] == "-m":
            sys.argv = [command[2], *command[3:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(command[2], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(command[1])
            sys.argv = [script, *command[2:]]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as err:
        return exit_code(err)
    except KeyboardInterrupt:  # the interpreter ends itself with SIGINT (a fresh trial's -2)
        traceback.print_exc()
        return -signal.SIGINT
    except BaseException:  # as the interpreter does: print it, exit 1
        traceback.print_exc()
        return 1
    return 0


def become_trial(request: dict[str, Any], channels: list[int], worker: int) -> None:
    """In the forked child: take on the trial's group, signals, directory, environment and log;
    die with the worker (which dies with dsat)."""
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != worker:  # the worker died before the line above
        os._exit(LOST_EXIT)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in channels:
        with contextlib.suppress(OSError):
            os.close(fd)
    take_on_trial(request)


def take_on_trial(request: dict[str, Any]) -> None:
    """This process takes on the trial's log (stdin empty), directory, environment and threads,
    and its random generators are seeded afresh, as in a new interpreter."""
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    set_trial_threads()
    from dsat.training.trial_config import lengthen_offcluster_operations

    lengthen_offcluster_operations()  # this trial's op.length, whenever its script asks
    seed_afresh()


def seed_afresh() -> None:
    """Seed Python's, NumPy's and torch's global generators from the OS, as a new interpreter
    does: a forked trial would otherwise draw what its worker and every other fork draw, and a
    host's trial what the host's baseline put back, the same numbers in every trial. (A fresh
    process's CUDA generators start at a fixed seed; ``process_reset`` puts them back to it.)"""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None)
    if generator is not None:
        generator.seed()


def set_trial_threads() -> None:
    """The trial's own thread count for torch's CPU work: its ``OMP_NUM_THREADS`` (a CPU slot's
    share of the cores), else every core this process may use, as a fresh process would start.
    The worker itself runs with one, so that no OpenMP pool exists when it forks (libgomp has no
    fork handler: a child forked after a parallel op in the parent hangs at its next one)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return  # a trial that imports torch itself reads OMP_NUM_THREADS then
    wanted = os.environ.get("OMP_NUM_THREADS", "")
    threads = int(wanted) if wanted.isdigit() and int(wanted) > 0 else len(os.sched_getaffinity(0))
    with contextlib.suppress(Exception):
        torch.set_num_threads(threads)


def trial_child(
    request: dict[str, Any], channels: list[int], worker: int, modules_path: Path
) -> None:
    """Run one trial and exit without the interpreter's teardown (a second of a short trial)."""
    code = 127
    try:
        become_trial(request, channels, worker)
        code = run_entry(list(request["argv"]))
        atexit._run_exitfuncs()
        with contextlib.suppress(OSError):
            modules_path.write_text(json.dumps(imported_from_elsewhere(request["cwd"])))
    except BaseException:  # the trial's log says what went wrong
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


class ForkServer:
    def __init__(
        self, command: list[str], model_dir: Path, includes: Sequence[Path], out_fd: int
    ) -> None:
        self.command = command
        self.model_dir = model_dir
        self.local = local_names(model_dir, includes)
        self.out_fd = out_fd
        self.children: set[int] = set()
        self.modules_dir = Path(tempfile.mkdtemp(prefix="dsat-warm-"))

    def send(self, event: dict[str, Any]) -> None:
        os.write(self.out_fd, (json.dumps(event) + "\n").encode())

    def warm_up(self, names: Iterable[str]) -> bool:
        """Import ``names``; False (and a cold event) when forking is no longer safe."""
        blamed = import_quietly(names)
        reason = unsafe_to_fork(blamed)
        if reason is not None:
            self.send({"event": "cold", "reason": reason})
            return False
        return True

    def first_imports(self) -> list[str]:
        if self.command[1] == "-m":
            return [] if is_local(self.command[2], self.local) else [self.command[2]]
        try:
            source = (self.model_dir / self.command[1]).read_text()
            names = script_imports(source)
        except (OSError, SyntaxError, ValueError):
            return []
        return [n for n in names if not is_local(n, self.local)]

    def fork_trial(self, request: dict[str, Any], channels: list[int]) -> None:
        worker = os.getpid()
        # What the worker imported stays out of the trial's garbage collections, whose marks
        # would otherwise copy every page the worker shares with it.
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            trial_child(request, channels, worker, self.modules_dir / f"{os.getpid()}.json")
        self.children.add(pid)
        self.send({"event": "started", "pid": pid})

    def report_exit(self, pid: int, status: int) -> bool:
        """Tell dsat that trial ``pid`` ended; False if ``pid`` was not one of its trials."""
        if pid not in self.children:
            return False
        self.children.discard(pid)
        returncode = os.waitstatus_to_exitcode(status)
        self.send({"event": "exited", "pid": pid, "returncode": returncode})
        return True

    def reap(self) -> bool:
        """Report finished trials and learn their imports; False once forking is unsafe."""
        while self.children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if not self.report_exit(pid, status):
                continue
            learned = learned_modules(self.modules_dir / f"{pid}.json", self.local)
            if learned and not self.warm_up(learned):
                return False
        return True

    def serve(self) -> None:
        if not self.warm_up(self.first_imports()):
            return
        selector = selectors.DefaultSelector()
        selector.register(0, selectors.EVENT_READ)
        buffer = b""
        while True:
            if selector.select(POLL_SECONDS):
                chunk = os.read(0, 65536)
                if not chunk:
                    return  # dsat closed the channel: stop
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    self.fork_trial(json.loads(line), [self.out_fd, selector.fileno()])
            if not self.reap():
                self.wait_for_children()
                return

    def serve_in_itself(self) -> None:
        """The trial host: run each requested trial in this process, until dsat closes the
        channel or a trial leaves the process unfit for the next."""
        from dsat.runners.local.trial_host import TrialHost  # imports this module

        shutil.rmtree(self.modules_dir, ignore_errors=True)  # nothing is forked to learn from
        # Stopping a trial stops its process, as a trial's own: the next gets a new host.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        import_quietly(self.first_imports())
        host = TrialHost()
        for line in sys.stdin.buffer:
            request = json.loads(line)
            self.send({"event": "started", "pid": os.getpid(), "host": True})
            returncode, leaks = host.run(request)
            if leaks:  # said first, so that no trial is sent to a host on its way out
                self.send({"event": "leaving", "reason": "; ".join(leaks)})
            self.send({"event": "exited", "pid": os.getpid(), "returncode": returncode})
            if leaks:
                print(f"dsat: this trial host leaves: {'; '.join(leaks)}", flush=True)
                return

    def wait_for_children(self) -> None:
        """A cold worker still reports the trials it started before it leaves."""
        while self.children:
            self.report_exit(*os.waitpid(-1, 0))

    def stop_children(self) -> None:
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _stop(signum: int, frame: object) -> None:
    """Stop serving, once: dsat closes the worker's stdin and then sends SIGTERM, and a second
    Stop would cut short the cleanup the first began (a traceback in the worker's log)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Stop


def main(argv: list[str]) -> None:
    hosting = len(argv) > 1 and argv[1] == "--host"
    if hosting:
        argv = [argv[0], *argv[2:]]
    if "--" not in argv[3:] or len(argv) - argv.index("--") < 3:
        sys.exit(f"usage: python -m dsat.runners.local.fork_server {USAGE}")
    split = argv.index("--")
    out_fd = os.dup(1)
    os.dup2(2, 1)  # what imports print must not mix with the events
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path.cwd().resolve()]
    includes = [Path(p) for p in argv[3:split]]
    # One OpenMP thread for the worker's own imports (read as libgomp loads); each trial sets
    # its own count (set_trial_threads), from the environment its request carries.
    os.environ["OMP_NUM_THREADS"] = "1"
    server = ForkServer(argv[split + 1 :], Path(argv[2]), includes, out_fd)
    try:
        try:
            signal.signal(signal.SIGTERM, _stop)
            die_with(int(argv[1]))
            if hosting:
                server.serve_in_itself()
            else:
                server.serve()
        finally:  # serving is over, however it ended: a SIGTERM now changes nothing
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except (Stop, KeyboardInterrupt, BrokenPipeError):
        server.stop_children()
    shutil.rmtree(server.modules_dir, ignore_errors=True)
    # Without the interpreter's teardown of everything imported (a second or more).
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
