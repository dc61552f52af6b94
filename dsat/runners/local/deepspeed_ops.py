"""DeepSpeed's JIT-compiled ops: built once before the first trial, and never waited on forever.

DeepSpeed compiles some ops the first time a process needs them (on the CPU its shared-memory
communication op, on every accelerator its fused Adam unless ``torch_adam`` is set): minutes, with
nothing on screen, inside whichever trial comes first. dsat builds them in one process of its own
before trials start and says so. The build runs under torch's lock file in the extension's build
directory; a build that was interrupted (Ctrl-C, a killed trial) leaves that file behind, and
every later process that needs the op waits on it without a word. A lock that no living process
holds open is such a leftover, and dsat removes it.

Whether a process holds it open is read from /proc, which shows neither the processes of another
container sharing the build directory nor a lock created between the look and the removal. So
dsat builds under a claim of its own beside torch's builds (``dsat-op-build.lock``, an flock that
every process sharing the builds sees), removes nothing while another process holds that claim,
and removes a lock only if it is still the same file with no holder after the look.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsat.paths import shown
from dsat.runners.local.machine_claims import Holder, try_claim, wait_for_claim

logger = logging.getLogger(__name__)

LOCK_NAME = "lock"  # torch.utils.file_baton's file in each extension's build directory
BUILD_CLAIM = "dsat-op-build.lock"  # dsat's claim on building into the extensions root
BUILD_TIMEOUT_S = 1800.0
# How often a running build says how long it has taken (it prints nothing for minutes).
BUILD_CLOCK_S = 30.0
REPORT = "dsat-op:"  # the build process's lines for dsat, among the compiler's

# Run in the trials' environment: load each op named on the command line as BUILDER=BUILT
# (building it where torch's cache has no build of this environment's sources), saying so.
BUILD_SCRIPT = f"""
import sys, time
import deepspeed.ops
from deepspeed.accelerator import get_accelerator
for item in sys.argv[1:]:
    name, built = item.split("=")
    builder = get_accelerator().create_op_builder(name)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        continue
    print("{REPORT}", "start", builder.NAME, built, flush=True)
    started = time.time()
    builder.load()
    print("{REPORT}", "done", builder.NAME, round(time.time() - started), flush=True)
"""


# The library each builder makes (its NAME), to see without importing DeepSpeed that it is built.
OP_LIBRARIES = {
    "ShareMemCommBuilder": "deepspeed_shm_comm",
    "FusedAdamBuilder": "fused_adam",
    "CPUAdamBuilder": "cpu_adam",
}


def ops_for_trials(ds_config: Mapping[str, Any], on_gpu: bool, offload: bool = False) -> list[str]:
    """DeepSpeed op builders the trials of ``ds_config`` will load (class names); ``offload``:
    the search puts the optimizer on the CPU too (--offload), whose Adam is another op, else
    built inside the first such trial, on its clock."""
    names = [] if on_gpu else ["ShareMemCommBuilder"]
    optimizer = ds_config.get("optimizer")
    if isinstance(optimizer, Mapping):
        kind = str(optimizer.get("type", "")).lower()
        params = optimizer.get("params")
        torch_adam = isinstance(params, Mapping) and bool(params.get("torch_adam"))
        if kind in ("adam", "adamw") and not torch_adam:
            offloads = _offloads_optimizer(ds_config)
            names.append("CPUAdamBuilder" if offloads else "FusedAdamBuilder")
            if offload and not offloads:
                names.append("CPUAdamBuilder")
    return names


def _offloads_optimizer(ds_config: Mapping[str, Any]) -> bool:
    zero = ds_config.get("zero_optimization")
    offload = zero.get("offload_optimizer") if isinstance(zero, Mapping) else None
    return isinstance(offload, Mapping) and offload.get("device") in ("cpu", "nvme")


def extensions_root(environ: Mapping[str, str]) -> Path:
    """Where torch keeps JIT-built extensions for processes with ``environ``."""
    explicit = environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return Path(explicit)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def is_built(builder: str, root: Path) -> bool:
    """Whether torch's cache under ``root`` holds the library ``builder`` makes, built from this
    DeepSpeed installation's sources (another environment sharing the cache rebuilds it)."""
    library = OP_LIBRARIES.get(builder)
    sources = deepspeed_sources()
    if library is None or sources is None:
        return False
    for built in [*root.glob(f"{library}/{library}.so"), *root.glob(f"*/{library}/{library}.so")]:
        with contextlib.suppress(OSError):
            if sources in (built.parent / "build.ninja").read_text():
                return True
    return False


def deepspeed_sources() -> str | None:
    """Where this environment's DeepSpeed keeps its op sources, found without importing it."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        return None
    return str(Path(spec.origin).parent / "ops" / "csrc")


def build_locks(root: Path) -> list[Path]:
    """Lock files under ``root`` (``<root>/<op>/lock``, or ``<root>/<py>_<accel>/<op>/lock``)."""
    if not root.is_dir():
        return []
    return sorted({*root.glob(f"*/{LOCK_NAME}"), *root.glob(f"*/*/{LOCK_NAME}")})


def lock_holders(lock: Path) -> list[int] | None:
    """Processes that have ``lock`` open (its creator keeps it open until the build ends);
    None where this cannot be known (no /proc)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    target = os.path.realpath(lock)
    holders = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == target:
                        holders.append(int(entry.name))
                        break
    return holders


def clear_stale_locks(environ: Mapping[str, str]) -> list[Path]:
    """Remove build locks that no living process holds; returns them. While another process
    builds under dsat's claim nothing is removed, and a lock held by a live process never is."""
    root = extensions_root(environ)
    if not root.is_dir():
        return []
    try:
        claim = try_claim(root / BUILD_CLAIM, {"pid": os.getpid()})
    except OSError:  # builds dsat cannot write to: it could not remove their locks either
        return []
    if claim is None:
        return []
    try:
        return _remove_stale_locks(root)
    finally:
        claim.release()


def _remove_stale_locks(root: Path) -> list[Path]:
    """Under the build claim: the locks under ``root`` that no living process holds, removed."""
    removed = []
    for lock in build_locks(root):
        if _remove_if_unheld(lock):
            removed.append(lock)
            logger.info("removed %s, left behind by an interrupted DeepSpeed op build", shown(lock))
    return removed


def _remove_if_unheld(lock: Path) -> bool:
    """Remove ``lock`` if no process holds it open, and it is still the file that was looked
    at (a build that started meanwhile made a new one, and holds it)."""
    before = _identity(lock)
    if before is None or lock_holders(lock) != []:
        return False
    if _identity(lock) != before:
        return False
    try:
        lock.unlink()
    except FileNotFoundError:
        return False
    return True


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino, stat.st_ctime_ns


def build_ops(names: list[str], environ: Mapping[str, str], log_path: Path) -> bool:
    """Load (and build where needed) ``names`` in one process with the trials' environment,
    telling the user when a build starts; False when it failed (trials then try themselves).
    Another search's build into the same place is waited for, and may leave nothing to do."""
    root = extensions_root(environ)
    if all(is_built(name, root) for name in names):
        clear_stale_locks(environ)
        return True  # nothing to build: no need to spend seconds importing DeepSpeed
    try:
        root.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "log": str(log_path.resolve())}
        claim = wait_for_claim(root / BUILD_CLAIM, record, _say_waiting)
    except OSError:  # a place dsat cannot write to: the build says why, in its log
        return _build({name: is_built(name, root) for name in names}, environ, log_path, ())
    try:
        _remove_stale_locks(root)
        built = {name: is_built(name, root) for name in names}
        return all(built.values()) or _build(built, environ, log_path, (claim.fd,))
    finally:
        claim.release()


def _say_waiting(other: Holder) -> None:
    where = f" (log: {shown(other.log)})" if other.log else ""
    pid = f"pid {other.pid}" if other.pid is not None else "another process"
    logger.info("waiting for the DeepSpeed op build under way in %s%s", pid, where)


def _build(
    built: dict[str, bool], environ: Mapping[str, str], log_path: Path, claim: tuple[int, ...]
) -> bool:
    """Run the build process for ``built`` (op name: already built), saying what it does. It is
    handed the build claim's file (``claim``), so a build outliving a killed dsat still holds it."""
    names = list(built)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", BUILD_SCRIPT, *(f"{n}={int(b)}" for n, b in built.items())],
            env=dict(environ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            pass_fds=claim,
            # A group of its own, stopped whole: torch's ninja and the compilers it starts do
            # not hold the claim, and outlived a build process killed alone, still compiling
            # into the directory whose lock the next search then took for a stale one.
            start_new_session=True,
        )
        assert process.stdout is not None  # stdout=PIPE above
        done = threading.Event()
        clock = threading.Thread(
            target=_build_clock, args=(process, names, started, done), daemon=True
        )
        clock.start()
        try:
            for line in process.stdout:
                log.write(line)
                log.flush()
                _report(line.decode(errors="replace").split(), log_path)
            code = process.wait()
        except BaseException:  # Ctrl-C or SIGTERM: the build stops with dsat
            _stop_build(process)
            raise
        finally:
            done.set()
            clock.join()
    if code != 0:
        logger.info(
            "could not build DeepSpeed's ops %s (see %s); trials will try on their own",
            ", ".join(names),
            shown(log_path),
        )
    return code == 0


def _stop_build(process: subprocess.Popen[bytes]) -> None:
    """The build process and all it started (ninja, the compilers), at once."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # not a group's leader, or gone
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    process.wait()


def _build_clock(
    process: subprocess.Popen[bytes], names: list[str], started: float, done: threading.Event
) -> None:
    """Every BUILD_CLOCK_S, say how long the build has taken (it prints nothing while it
    compiles); past BUILD_TIMEOUT_S, stop it, whether or not it prints."""
    while not done.wait(BUILD_CLOCK_S):
        elapsed = time.monotonic() - started
        if elapsed > BUILD_TIMEOUT_S:
            _stop_build(process)
            return
        minutes, seconds = divmod(int(elapsed), 60)
        logger.info(
            "building DeepSpeed's %s op: %d:%02d so far", ", ".join(names), minutes, seconds
        )


def _report(words: list[str], log_path: Path) -> None:
    if len(words) != 4 or words[0] != REPORT:
        return
    _, event, name, value = words
    if event == "start" and value == "0":
        logger.info(
            "building DeepSpeed's %s op for this machine, once: a few minutes the first time, "
            "reused by later searches (log: %s)",
            name,
            shown(log_path),
        )
    elif event == "done" and int(value) >= 5:
        logger.info("built DeepSpeed's %s op in %s s", name, value)
