"""What a trial changes in the process it runs in, put back once it ends (issue 33, item 2).

A trial host runs one trial after another in one process, so that the CUDA context and the
process group are made once. Each trial must still start as the script run anew. DeepSpeed 0.19.8
does not make that easy: a ZeRO-3 engine replaces ``torch.nn.functional.linear`` for good,
``zero.Init`` leaves ``nn.Module.__init_subclass__`` and ``_old_init`` attributes behind, and a
ZeRO-3 engine stays alive after ``engine.destroy()`` (held by ``FWD_MODULE_STACK`` and a class
level ``lru_cache``), with its device memory. So the host takes a ``ProcessBaseline`` once, after
its imports, runs every trial inside ``one_trial``, and afterwards asks ``leaks`` whether the
process is still as it was (a host that is not is replaced). The interpreter's own settings
(logging, warning filters, signal handlers, the standard streams) are put back by
``interpreter_settings``.

DeepSpeed, torch, numpy and accelerate are only touched when they are already imported.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import dataclasses
import gc
import logging
import math
import os
import random
import select
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dsat.runners.local.interpreter_settings import InterpreterSettings

logger = logging.getLogger(__name__)

# Class attributes that cannot be set again, or need not be.
_FIXED_ATTRIBUTES = frozenset({"__dict__", "__weakref__", "__doc__"})
_MISSING = object()
# Device memory a trial may leave allocated in a host (the allocator's bookkeeping, a library's
# small workspace): more is a leak.
DEVICE_MEMORY_TOLERANCE = 64 * 2**20
# A host whose small CPU operations run this much slower than a fresh process's is replaced: a
# thread a trial leaves alive that ran torch's OpenMP work (gloo's worker threads do, in ZeRO-3's
# collectives on the CPU) makes OpenMP count more threads than cores, and it then wakes its
# threads for every parallel operation (4.5x slower small matrix products on the CPU, and every
# later trial of the host 40% slower, benchmarks/README.md).
PACE_SLOWDOWN = 1.5


class TrialExit(SystemExit):
    """The bare ``exit()`` of a trial (DeepSpeed's autotuning ends a trial with it). The builtin
    would close ``sys.stdin`` on its way out, for every later trial of the process."""


@dataclasses.dataclass
class TrialTraces:
    """What a trial registered that the process would otherwise keep: atexit callbacks."""

    exit_callbacks: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = (
        dataclasses.field(default_factory=list)
    )

    def run_exit_callbacks(self) -> None:
        """Run them, last first, as the interpreter does when a script ends; each only once."""
        while self.exit_callbacks:
            callback, args, kwargs = self.exit_callbacks.pop()
            atexit.unregister(callback)
            try:
                callback(*args, **kwargs)
            except Exception:  # as atexit does: say so and go on
                traceback.print_exc()


@dataclasses.dataclass
class ProcessBaseline:
    """The process as a trial must find it, taken once before the first trial."""

    cwd: str
    environ: dict[str, str]
    argv: list[str]
    path: list[str]
    modules: frozenset[str]
    threads: frozenset[int]
    python_random: Any
    # The cyclic collector: a trial may turn it off or retune it (DeepSpeed's disable_python_gc
    # turns it off while an engine lives), which would change every later trial's step times.
    collector: tuple[bool, tuple[int, ...]]
    torch_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    deepspeed_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Seconds of torch's small CPU operations when the baseline was taken (None: no torch).
    pace: float | None = None
    # The native threads (Linux task ids) the process had at the last look: only a trial that
    # started one can have left OpenMP work in one (a pool of threads OpenMP then counts).
    native_threads: frozenset[int] = frozenset()
    # Logging, warning filters, signal handlers, the standard streams.
    interpreter: InterpreterSettings | None = None
    # multiprocessing's helper processes already running (their pids): a trial's are stopped.
    helpers: frozenset[int] = frozenset()

    @classmethod
    def capture(cls) -> ProcessBaseline:
        return cls(
            cwd=os.getcwd(),
            environ=dict(os.environ),
            argv=list(sys.argv),
            path=list(sys.path),
            modules=frozenset(sys.modules),
            threads=frozenset(t.ident for t in threading.enumerate() if t.ident is not None),
            python_random=random.getstate(),
            collector=(gc.isenabled(), gc.get_threshold()),
            torch_state=_capture_torch(),
            deepspeed_state=_capture_deepspeed(),
            pace=small_operations_pace(),
            native_threads=native_thread_ids(),
            interpreter=InterpreterSettings.capture(),
            helpers=frozenset(_helper_pids()),
        )

    def restore(self, traces: TrialTraces, trial_dir: Path | None = None) -> None:
        """Put the process back as it was: every engine destroyed, DeepSpeed's and the trial's
        process-wide changes undone, and the modules the trial imported from ``trial_dir``
        forgotten, so that the next trial imports them anew."""
        gc.collect()  # what the trial dropped is not an engine to destroy
        destroy_engines()
        for callback, _, _ in traces.exit_callbacks:
            atexit.unregister(callback)
        traces.exit_callbacks.clear()
        _reset_accelerate()
        stop_helpers(self.helpers)
        step_clock = sys.modules.get("dsat.training.step_clock")
        if step_clock is not None:  # dsat's own trial side: the next trial times its own steps
            step_clock.stop_clock()
        if self.deepspeed_state:
            _restore_deepspeed(self.deepspeed_state)
        if self.torch_state:
            _restore_torch(self.torch_state)
        random.setstate(self.python_random)
        enabled, threshold = self.collector
        gc.set_threshold(*threshold)
        if enabled:
            gc.enable()
        else:
            gc.disable()
        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.environ)
        sys.argv[:] = self.argv
        sys.path[:] = self.path
        forgotten: set[str] = set()
        if trial_dir is not None:
            forgotten = forget_modules(set(sys.modules) - self.modules, trial_dir)
        if self.interpreter is not None:
            self.interpreter.restore(forgotten)
        gc.collect()

    def leaks(self) -> list[str]:
        """What the last trial left that restoring could not take back: threads it started,
        engines still alive, device memory still allocated, torch or DeepSpeed state the
        baseline never saw. Empty for a process as good as new."""
        gc.collect()  # once, for the engines and the device memory below
        found = [
            f"thread {t.name!r} still running"
            for t in threading.enumerate()
            if t.ident not in self.threads and t.is_alive()
        ]
        for name, known in (("torch", self.torch_state), ("deepspeed", self.deepspeed_state)):
            if name in sys.modules and not known:  # restore() cannot put back what it never saw
                found.append(f"{name} was first imported by a trial, after the baseline")
        alive = len(live_engines())
        if alive:
            found.append(f"{alive} DeepSpeed engine(s) still alive")
        held = device_memory_held()
        if held > DEVICE_MEMORY_TOLERANCE:
            found.append(f"{held / 2**20:.0f} MiB of device memory still allocated")
        slower = self.slowdown()
        if slower is not None:
            found.append(
                f"torch's small CPU operations run {slower:.1f}x slower here than in a fresh process "
                "(a thread the trial left, most often, that ran OpenMP work)"
            )
        return found

    def slowdown(self) -> float | None:
        """How many times slower torch's small CPU operations run here than in a fresh process
        on this machine now, where that is ``PACE_SLOWDOWN`` or more; None otherwise, and None
        at once where no native thread started since the last look (most trials). Another
        process's busy OpenMP threads slow them as much (on 2 cores, 200 times: another slot's
        trial), so the fresh process, started only once this host measures slower than at its
        start, measures in turn with it, round by round, and the fastest round of each counts."""
        threads = native_thread_ids()
        started, self.native_threads = threads - self.native_threads, threads
        if self.pace is None or (threads and not started):
            return None
        now = small_operations_pace()
        if now is None or now < PACE_SLOWDOWN * self.pace:
            return None
        # Measured twice, each time beside its own fresh process, and slower both times: on
        # cores another program keeps busy, one comparison in five read a clean process 43x
        # slower (whether OpenMP's second thread got a core decides a round), and a healthy
        # host was replaced.
        slowdowns = []
        for _ in range(2):
            paces = _paces_beside_a_fresh_process()
            if paces is None:
                return None
            here, fresh = paces
            if here < PACE_SLOWDOWN * fresh:
                return None
            slowdowns.append(here / fresh)
        return min(slowdowns)


@contextlib.contextmanager
def one_trial(baseline: ProcessBaseline, trial_dir: Path | None = None) -> Iterator[TrialTraces]:
    """Run one trial in this process: its ``exit()`` raises ``TrialExit``, its atexit callbacks
    are noted, and its ``destroy_process_group`` does nothing (the host's process group serves
    the next trial); whatever happens, the process is put back afterwards."""
    traces = TrialTraces()
    register = atexit.register

    def noted(callback: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        traces.exit_callbacks.append((callback, args, kwargs))
        return register(callback, *args, **kwargs)

    def trial_exit(code: object = None) -> None:
        raise TrialExit(code)

    patches: list[tuple[Any, str, Any]] = [
        (atexit, "register", noted),
        (builtins, "exit", trial_exit),
    ]
    patches.extend((module, "destroy_process_group", _keep_group) for module in _group_owners())
    saved = [(owner, name, getattr(owner, name, _MISSING)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    reset_peak_memory()
    try:
        yield traces
    finally:
        for owner, name, value in saved:
            if value is _MISSING:  # no builtin exit() under python -S
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        baseline.restore(traces, trial_dir)


@dataclasses.dataclass(frozen=True)
class _Helper:
    """One of multiprocessing's helper processes, as its module keeps it: the instance, and the
    attributes with its pid and the descriptor whose closing tells it to end."""

    module: str
    instance: str
    pid: str
    alive_fd: str


# The resource tracker, which the spawn and forkserver start methods start (a DataLoader's
# spawned workers, a spawn Pool), and the fork server.
_HELPERS = (
    _Helper("multiprocessing.resource_tracker", "_resource_tracker", "_pid", "_fd"),
    _Helper("multiprocessing.forkserver", "_forkserver", "_forkserver_pid", "_forkserver_alive_fd"),
)
# How long a helper may take to end once told to; one that a live process of the trial keeps
# (a spawned child holds the tracker's pipe too) is left to the runner's stop of what the trial
# left running, which ends the child and so the helper.
HELPER_EXIT_S = 1.0
# Helpers told to end and not yet reaped (this process is their parent).
_unreaped: set[int] = set()


def _helper_pids() -> dict[int, tuple[_Helper, Any]]:
    """multiprocessing's helpers this process runs, by pid."""
    running = {}
    for kind in _HELPERS:
        helper = getattr(sys.modules.get(kind.module), kind.instance, None)
        pid = getattr(helper, kind.pid, None)
        if isinstance(pid, int):
            running[pid] = (kind, helper)
    return running


def stop_helpers(keep: frozenset[int]) -> None:
    """End the helpers a trial started, as its process's end would have: their pipe closes, and
    multiprocessing forgets them, so the next trial starts its own. They carry the trial's
    environment, so dsat would stop them as processes the trial left running, but they ignore
    SIGTERM: each cost 5 s of waiting for SIGKILL, and the next trial's first spawn warned
    "resource_tracker: process died unexpectedly". First the trial's daemonic children end, as
    at a process's exit (each holds the tracker's pipe). Waits at most ``HELPER_EXIT_S`` a step."""
    _end_daemonic_children()
    for pid, (kind, helper) in _helper_pids().items():
        if pid in keep:
            continue
        try:
            with helper._lock:
                fd = getattr(helper, kind.alive_fd)
                setattr(helper, kind.alive_fd, None)
                setattr(helper, kind.pid, None)
                if isinstance(fd, int):
                    os.close(fd)
                _forget_address(helper)
        except Exception as err:  # left to the runner's stop of what the trial left
            logger.debug("ending multiprocessing's helper %d failed: %s", pid, err)
        _unreaped.add(pid)
    reap_helpers(HELPER_EXIT_S)


def _end_daemonic_children() -> None:
    """Terminate the daemonic processes the trial started with multiprocessing (a DataLoader's
    workers, a Pool's), as multiprocessing does when a process exits; others are left to the
    runner's stop of what the trial left running (a process's exit would wait for them)."""
    multiprocessing = sys.modules.get("multiprocessing")
    if multiprocessing is None:
        return
    daemonic = [child for child in multiprocessing.active_children() if child.daemon]
    for child in daemonic:
        with contextlib.suppress(Exception):
            child.terminate()
    for child in daemonic:
        with contextlib.suppress(Exception):
            child.join(HELPER_EXIT_S)


def _forget_address(helper: Any) -> None:
    """A fork server's socket, removed where it is a file (as its own stop does)."""
    address = getattr(helper, "_forkserver_address", None)
    if address is None:
        return
    helper._forkserver_address = None
    util = sys.modules.get("multiprocessing.util")
    abstract = getattr(util, "is_abstract_socket_namespace", lambda a: True)(address)
    if not abstract:
        with contextlib.suppress(OSError):
            os.unlink(address)


def reap_helpers(timeout: float) -> None:
    """Reap the helpers told to end that have, waiting at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while _unreaped:
        for pid in list(_unreaped):
            try:
                done = os.waitpid(pid, os.WNOHANG)[0] != 0
            except ChildProcessError:  # reaped already, or not ours
                done = True
            if done:
                _unreaped.discard(pid)
        if not _unreaped or time.monotonic() >= deadline:
            return
        time.sleep(0.01)


def _keep_group(*args: Any, **kwargs: Any) -> None:
    """A trial's ``destroy_process_group``: the group outlives the trial."""


def _group_owners() -> list[Any]:
    names = ("torch.distributed", "deepspeed.comm", "deepspeed.comm.comm")
    return [sys.modules[n] for n in names if n in sys.modules]


def forget_modules(names: set[str], trial_dir: Path) -> set[str]:
    """Drop the modules among ``names`` that were loaded from ``trial_dir`` (the trial's own);
    returns their names."""
    root = trial_dir.resolve()
    forgotten: set[str] = set()
    for name in names:
        module = sys.modules.get(name)
        origin = getattr(module, "__file__", None)
        if origin is not None and Path(origin).resolve().is_relative_to(root):
            del sys.modules[name]
            forgotten.add(name)
    return forgotten


def _cuda_in_use() -> Any | None:
    """``torch.cuda`` where this process has started CUDA; None where it has not (or has no
    torch): nothing is on a device then, and nothing here may start CUDA."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    return cuda if cuda is not None and cuda.is_initialized() else None


def reset_peak_memory() -> None:
    """Start the peaks a trial reports (``memory_peak_bytes``) from what the process holds now,
    as a fresh process's start from nothing: torch's device peaks, and the kernel's peak resident
    set (``ru_maxrss``, the CPU's figure), which an earlier, larger trial of the host would
    otherwise have set for every later one."""
    cuda = _cuda_in_use()
    if cuda is not None:
        for device in range(cuda.device_count()):
            cuda.reset_peak_memory_stats(device)
    # What the C allocator kept of an earlier trial's freed memory counts in the resident set: a
    # host that had run micro-batch 14336 reported 7.7e8 bytes for 8192, a fresh process 5.5e8.
    with contextlib.suppress(OSError, AttributeError):  # glibc's; not every libc has it
        ctypes.CDLL(None).malloc_trim(0)
    with contextlib.suppress(OSError):  # Linux: 5 resets the peak resident set to the current
        Path("/proc/self/clear_refs").write_text("5")


def native_thread_ids() -> frozenset[int]:
    """The process's threads, native ones included (empty where /proc cannot say)."""
    try:
        return frozenset(int(task) for task in os.listdir("/proc/self/task"))
    except (OSError, ValueError):
        return frozenset()


def small_operations_pace(repeats: int = 7, operations: int = 100) -> float | None:
    """Seconds per small matrix product on the CPU (the fastest of ``repeats`` rounds) with as
    many torch threads as the process may use cores, as a trial runs with: what OpenMP's
    per-operation overhead shows in (a host itself keeps fewer threads between trials). None
    before torch is imported, or with one core (no OpenMP team to wake)."""
    torch = sys.modules.get("torch")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if torch is None or not cores or cores < 2:
        return None
    left, right = torch.ones(32, 256), torch.ones(256, 256)
    fastest = math.inf
    threads = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        with torch.no_grad():
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(operations):
                    torch.mm(left, right)
                fastest = min(fastest, (time.perf_counter() - start) / operations)
    finally:
        torch.set_num_threads(threads)
    return fastest


# A fresh interpreter that measures one round of small operations for every line it reads.
_FRESH_PACE = """
import sys, torch
from dsat.runners.local.process_reset import small_operations_pace
print("ready", flush=True)
for _ in sys.stdin:
    print(small_operations_pace(repeats=1), flush=True)
"""


def _paces_beside_a_fresh_process(
    rounds: int = 9, timeout: float = 120.0
) -> tuple[float, float] | None:
    """The fastest round of small operations here and in a fresh interpreter, measured in
    turn (None if the fresh one could not say in ``timeout`` seconds)."""
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", _FRESH_PACE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        return None
    assert child.stdin is not None and child.stdout is not None
    lines = LinesWithin(child.stdout.fileno())
    here = there = math.inf
    try:
        line: str | None = ""
        while line not in ("ready", None):  # past what its imports print
            line = lines.next(timeout)
        if line is None:
            return None
        for _ in range(rounds):
            mine = small_operations_pace(repeats=1)
            child.stdin.write(b"\n")
            child.stdin.flush()
            theirs = lines.next(timeout)
            if mine is None or theirs is None or theirs == "None":
                return None
            here, there = min(here, mine), min(there, float(theirs))
        return here, there
    except (OSError, ValueError):
        return None
    finally:
        child.kill()
        child.wait()


class LinesWithin:
    """Lines read from a pipe's descriptor, each waited for at most a timeout. Read from the
    descriptor itself: a file object's buffer can hold a second line that ``select`` cannot see
    (an import printing two lines in one write), and the wait for it would run its whole
    timeout."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""

    def next(self, timeout: float) -> str | None:
        """The next line, stripped; None when none comes in ``timeout`` seconds, or the pipe
        ends first."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode(errors="replace").strip()


def device_memory_held() -> int:
    """Bytes torch still has allocated on this process's GPU, once its cache is emptied and
    after a collection (0 before CUDA started): a trial host holds no tensors of its own between
    trials, so what is left is a trial's, and would turn into false out-of-memory failures of the
    next. cuBLAS's workspaces are not counted: torch keeps one per handle and stream for the
    process's life (on an H100 65 MiB stayed after every trial, just over the tolerance, and each
    replaced its host); cleared first, as torch's own leak check does, they are made again by the
    next trial's first matrix product."""
    cuda = _cuda_in_use()
    if cuda is None:
        return 0
    clear_workspaces = getattr(sys.modules["torch"]._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    cuda.empty_cache()
    return int(cuda.memory_allocated())


# ------------------------------------------------------------------ engines


def live_engines() -> list[Any]:
    """Every DeepSpeed engine this process still holds (or held, until the next collection)."""
    engine_module = sys.modules.get("deepspeed.runtime.engine")
    if engine_module is None:
        return []
    engine_class = engine_module.DeepSpeedEngine
    # By type, not isinstance: that also asks objects for __class__, which some answer with a
    # deprecation warning (torch.distributed.reduce_op).
    return [o for o in gc.get_objects() if issubclass(type(o), engine_class)]


def destroy_engines() -> None:
    """``destroy()`` every engine still alive: only that removes ZeRO-3's autograd hooks, which
    gc cannot see and which keep the engine (and its device memory) alive."""
    for engine in live_engines():
        try:
            engine.destroy()
        except Exception as err:  # a half-built engine; what cannot be undone shows in leaks()
            logger.debug("destroying a trial's engine failed: %s", err)


# ------------------------------------------------------------------ torch


def _subclasses(cls: type) -> set[type]:
    found: set[type] = set()
    todo: list[type] = [cls]
    while todo:
        sub: type
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


# c10's default_rng_seed_val: the seed every CUDA generator is made with.
CUDA_DEFAULT_SEED = 67280421310721


# torch.backends.cuda's scaled-dot-product attention kernels: getter, and its setter's name.
_ATTENTION = {
    "flash_sdp_enabled": "enable_flash_sdp",
    "mem_efficient_sdp_enabled": "enable_mem_efficient_sdp",
    "math_sdp_enabled": "enable_math_sdp",
    "cudnn_sdp_enabled": "enable_cudnn_sdp",
}


def _capture_torch() -> dict[str, Any]:
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    functional = torch.nn.functional
    state: dict[str, Any] = {
        "functional": dict(vars(functional)),
        "callables": {
            k: v for k, v in vars(torch).items() if callable(v) and not isinstance(v, type)
        },
        "module_dict": dict(vars(torch.nn.Module)),
        "tensor_dict": dict(vars(torch.Tensor)),
        "inits": {c: c.__dict__.get("__init__") for c in _subclasses(torch.nn.Module)},
        "default_dtype": torch.get_default_dtype(),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "grad": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn": (
            torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.allow_tf32,
        ),
        # What HF's --tf32 and mixed-precision users flip beside the matmul precision.
        "reductions": (
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        ),
        "rng": torch.get_rng_state(),
        # A debugging script's set_detect_anomaly(True) (several times slower backward passes),
        # set_printoptions, set_default_device, and the attention kernels it turned off.
        "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "print_options": dict(vars(torch._tensor_str.PRINT_OPTS)),
        "device_context": getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None),
        "attention": {  # cuDNN's came with torch 2.3 (dsat takes 2.1)
            name: getattr(torch.backends.cuda, name)()
            for name in _ATTENTION
            if hasattr(torch.backends.cuda, name)
        },
    }
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy_rng"] = numpy.random.get_state()
    return state


def _restore_class_dict(cls: type, saved: dict[str, Any]) -> None:
    current = dict(vars(cls))
    for name in current:
        if name not in saved and name not in _FIXED_ATTRIBUTES:
            delattr(cls, name)
    for name, value in saved.items():
        if name not in _FIXED_ATTRIBUTES and current.get(name, _MISSING) is not value:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(cls, name, value)


def _restore_torch(state: dict[str, Any]) -> None:
    import torch

    functional = torch.nn.functional
    for name, value in state["functional"].items():  # ZeRO-3's linear, the flops profiler's
        if getattr(functional, name, _MISSING) is not value:
            setattr(functional, name, value)
    for name, value in state["callables"].items():
        if getattr(torch, name, _MISSING) is not value:
            setattr(torch, name, value)
    _restore_class_dict(torch.nn.Module, state["module_dict"])
    _restore_class_dict(torch.Tensor, state["tensor_dict"])
    inits = state["inits"]
    for cls in _subclasses(torch.nn.Module):
        saved = inits.get(cls, _MISSING)
        if (
            saved is not _MISSING
            and saved is not None
            and cls.__dict__.get("__init__") is not saved
        ):
            setattr(cls, "__init__", saved)  # noqa: B010 (mypy: no __init__ on an instance)
        if "_old_init" in cls.__dict__:  # zero.Init's wrapper of a class made after the capture
            if saved is _MISSING and "__init__" in cls.__dict__:
                setattr(cls, "__init__", cls.__dict__["_old_init"])  # noqa: B010
            delattr(cls, "_old_init")
    torch.set_default_dtype(state["default_dtype"])
    enabled, warn_only = state["deterministic"]
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.set_grad_enabled(state["grad"])
    torch.set_num_threads(state["threads"])
    torch.set_float32_matmul_precision(state["matmul_precision"])
    cudnn = torch.backends.cudnn
    cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = state["cudnn"]
    matmul = torch.backends.cuda.matmul
    (
        matmul.allow_fp16_reduced_precision_reduction,
        matmul.allow_bf16_reduced_precision_reduction,
    ) = state["reductions"]
    torch.set_rng_state(state["rng"])
    torch.set_anomaly_enabled(*state["anomaly"])
    vars(torch._tensor_str.PRINT_OPTS).update(state["print_options"])
    context = state["device_context"]
    if getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None) is not context:
        torch.set_default_device(None if context is None else context.device)
    for getter, enabled in state["attention"].items():
        getattr(torch.backends.cuda, _ATTENTION[getter])(enabled)
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:  # what the trial compiled, kept alive by its code objects
        dynamo.reset()
    cuda = _cuda_in_use()
    if cuda is not None:
        # A fresh process's CUDA generators start at c10's fixed default seed, offset 0 (unlike
        # the CPU's, which is drawn at random): seeding them with it again is that state.
        cuda.manual_seed_all(CUDA_DEFAULT_SEED)
    if "numpy_rng" in state:
        import numpy

        numpy.random.set_state(state["numpy_rng"])


# ------------------------------------------------------------------ DeepSpeed


def _capture_deepspeed() -> dict[str, Any]:
    if "deepspeed" not in sys.modules:
        return {}
    import deepspeed.runtime.zero.partition_parameters as params

    inserter = params.InsertPostInitMethodToModuleSubClasses
    return {
        "contexts": (params.zero_init_context, params.top_level_context),
        "param_id": params.Init.param_id,
        "counts": (inserter.num_module_parameters, inserter.num_module_elements),
    }


def _restore_deepspeed(state: dict[str, Any]) -> None:
    import deepspeed.runtime.zero.parameter_offload as offload
    import deepspeed.runtime.zero.partition_parameters as params
    from deepspeed.runtime.zero.partitioned_param_coordinator import (
        PartitionedParameterCoordinator,
    )

    inserter = params.InsertPostInitMethodToModuleSubClasses
    params.zero_init_context, params.top_level_context = state["contexts"]
    params.Init.param_id = state["param_id"]
    inserter.num_module_parameters, inserter.num_module_elements = state["counts"]
    if "linear_bk" in vars(inserter):  # else the next zero.Init backs up ZeRO-3's wrapper
        del inserter.linear_bk
    params.empty_buffers.clear()
    params.temp_contiguous_tensor = None
    # What keeps a destroyed ZeRO-3 engine alive: the module stack, a per-class lru_cache keyed
    # by the coordinator, and the module counter's mutable default.
    offload.FWD_MODULE_STACK.clear()
    counter = offload.DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__
    if counter and isinstance(counter[0], list) and counter[0]:
        counter[0][0] = 0
    release = vars(PartitionedParameterCoordinator).get(
        "_PartitionedParameterCoordinator__params_to_release"
    )
    for cell in getattr(release, "__closure__", None) or ():
        cache_clear = getattr(cell.cell_contents, "cache_clear", None)
        if cache_clear is not None:
            cache_clear()
    profiler = sys.modules.get("deepspeed.profiling.flops_profiler.profiler")
    if profiler is not None:
        profiler.old_functions.clear()


def _reset_accelerate() -> None:
    """HF accelerate's process-wide state (the Trainer sets it up once per process), as HF's own
    hyperparameter sweeps reset it."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    for name in ("AcceleratorState", "PartialState", "GradientState"):
        reset = getattr(getattr(state, name, None), "_reset_state", None)
        if reset is not None:
            with contextlib.suppress(Exception):
                reset()
