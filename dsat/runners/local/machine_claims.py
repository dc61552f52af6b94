"""Claims on what the searches on one machine share: its slots, and DeepSpeed's op build.

Two searches on one machine would otherwise split its GPUs or cores without knowing it, each
measuring the other's load. A claim is an ``flock`` on a file: the kernel drops it when the
process that took it ends, however it ends, so a claim left by a dead search is free whatever its
file still says; and unlike a process in /proc it is seen by every process that shares the file,
in another container too. The file records who holds it (pid, results dir) so that a search
waiting for it can say for whom.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import re
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsat.paths import absolute, shown

LOCK_DIR_ENV = "DSAT_LOCK_DIR"
POLL_S = 1.0
RECORD_READS = 5


def lock_dir(environ: Mapping[str, str]) -> Path:
    """The machine-wide directory of slot claims: DSAT_LOCK_DIR, else ``<tmp>/dsat-locks``."""
    return Path(environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "dsat-locks")


@dataclass(frozen=True)
class Holder:
    """Who holds a claim, as its file says (nothing where it says nothing readable)."""

    pid: int | None = None
    results_dir: str | None = None
    log: str | None = None

    def describe(self) -> str:
        pid = f" (pid {self.pid})" if self.pid is not None else ""
        if self.results_dir is not None:
            return f"the search in {shown(self.results_dir)}{pid}"
        return f"another search{pid}"


class Claim:
    """An flock held until ``release()``, until this object is dropped, or until the process
    ends (a search in this process is not the last user of its claims: tests run several)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd  # a child given it (pass_fds) holds the claim as long as it lives
        self._close = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        self._close()  # closing the file drops the flock; a second call does nothing


def try_claim(path: Path, record: Mapping[str, Any]) -> Claim | None:
    """The claim on ``path`` with ``record`` written into it, or None while a live process holds
    it."""
    fd = _open_shared(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    claim = Claim(path, fd)
    with contextlib.suppress(OSError):  # opened read-only: the claim holds, unnamed
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(dict(record)).encode(), 0)
    return claim


def _open_shared(path: Path) -> int:
    """``path`` opened (created where missing) so that other users can claim it too."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except PermissionError:  # another user's file: flock needs no write access
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    with contextlib.suppress(OSError):  # the umask narrowed it; only the owner may widen it
        os.fchmod(fd, 0o666)
    return fd


def holder(path: Path) -> Holder:
    """What ``path`` says of its holder; meaningful while the claim is held (a holder that has
    just taken it writes its record a moment later)."""
    for _ in range(RECORD_READS):
        try:
            record = json.loads(path.read_text())
            break
        except (OSError, ValueError):
            time.sleep(0.01)
    else:
        return Holder()
    if not isinstance(record, dict):
        return Holder()
    pid = record.get("pid")
    return Holder(
        pid if isinstance(pid, int) else None,
        _text(record.get("results_dir")),
        _text(record.get("log")),
    )


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def wait_for_claim(
    path: Path,
    record: Mapping[str, Any],
    on_wait: Callable[[Holder], None],
    poll_s: float = POLL_S,
) -> Claim:
    """The claim on ``path``, waiting while another process holds it; ``on_wait`` hears once
    whom it waits for."""
    told = False
    while (claim := try_claim(path, record)) is None:
        if not told:
            on_wait(holder(path))
            told = True
        time.sleep(poll_s)
    return claim


@dataclass
class ClaimedSlots:
    """Slots this search holds; other searches on the machine wait for them."""

    slots: list[str]
    claims: list[Claim]

    def release(self) -> None:
        for claim in self.claims:
            claim.release()


def claim_slots(
    slots: Sequence[str],
    needed: int,
    directory: Path,
    results_dir: Path,
    on_gpu: bool,
    say: Callable[[str], None] | None = None,
    poll_s: float = POLL_S,
) -> ClaimedSlots:
    """``needed`` of ``slots`` (the first free ones) claimed for the search in ``results_dir``;
    while fewer are free, it waits, and says once for which slots and whom (again if that
    changes; on stdout at once, piped too, where ``say`` is not given). Nothing is held while
    waiting, so two searches cannot each hold what the other waits for."""
    if needed > len(slots):
        raise ValueError(f"{needed} slots needed of {len(slots)}")
    _make_shared_dir(directory)
    record = {"pid": os.getpid(), "results_dir": absolute(results_dir), "since": time.time()}
    said = ""
    while True:
        claimed, held = _try_slots(slots, needed, directory, record, on_gpu)
        if claimed is not None:
            return claimed
        line = waiting_line(held, on_gpu)
        if line != said:
            (say or _print_now)(line)
            said = line
        time.sleep(poll_s * random.uniform(0.5, 1.5))  # two waiters fall out of step


def _try_slots(
    slots: Sequence[str],
    needed: int,
    directory: Path,
    record: Mapping[str, Any],
    on_gpu: bool,
) -> tuple[ClaimedSlots | None, list[tuple[str, Holder]]]:
    """All ``needed`` slots claimed, or none and the held ones with their holders. Once this
    round cannot succeed, what it took is let go at once and the rest is only looked at, so
    that another search taking them meanwhile does not find them held by one that waits."""
    taken = ClaimedSlots([], [])
    held: list[tuple[str, Holder]] = []
    for slot in slots:
        path = directory / slot_file(slot, on_gpu)
        claim = try_claim(path, record)
        if claim is None:
            held.append((slot, holder(path)))
            if len(held) > len(slots) - needed:
                taken.release()
        elif len(held) > len(slots) - needed:
            claim.release()
        else:
            taken.slots.append(slot)
            taken.claims.append(claim)
            if len(taken.slots) == needed:
                return taken, []
    return None, held


def _print_now(line: str) -> None:
    print(line, flush=True)


def slot_file(slot: str, on_gpu: bool) -> str:
    """The claim file of a CPU slot (``cpu0``) or a GPU id (an index or a UUID), safe as a name."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", slot)
    return f"gpu-{safe}.lock" if on_gpu else f"{safe}.lock"


def waiting_line(held: Sequence[tuple[str, Holder]], on_gpu: bool) -> str:
    """``dsat: waiting for cpu0, cpu1: held by the search in DIR (pid N)``, one group per
    holder."""
    groups: dict[str, list[str]] = {}
    for slot, who in held:
        groups.setdefault(who.describe(), []).append(f"GPU {slot}" if on_gpu else slot)
    parts = [f"{', '.join(names)}: held by {who}" for who, names in groups.items()]
    return f"dsat: waiting for {'; '.join(parts)}"


def _make_shared_dir(directory: Path) -> None:
    """The lock directory, writable by every user (sticky, as /tmp) when dsat creates it."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        directory.mkdir()
    except FileExistsError:
        return
    with contextlib.suppress(OSError):
        directory.chmod(0o1777)
