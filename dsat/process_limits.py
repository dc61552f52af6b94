"""The memory a process on this machine may really use, where that is less than its RAM.

On the CPU (``DS_ACCELERATOR=cpu``) the machine's RAM is the trial's device memory. A container's
memory limit (cgroup) or the shell's address-space limit (``ulimit -v``, as some clusters' job
schedulers set it) lets a process use less: a trial past it fails to allocate at any
configuration, and the memory model must not plan for memory the process cannot have.
"""

from __future__ import annotations

import contextlib
import resource
from pathlib import Path

# cgroup v2's limit, then v1's; "max" (v2) or a huge number (v1) means none.
CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def address_space_limit() -> int | None:
    """This process's address-space limit in bytes (``ulimit -v``), or None when it has none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def cgroup_memory_limit(files: tuple[Path, ...] = CGROUP_LIMITS) -> int | None:
    """The container's memory limit in bytes, or None when it has none or none is readable."""
    for path in files:
        with contextlib.suppress(OSError, ValueError):
            text = path.read_text().strip()
            return None if text == "max" else int(text)
    return None


def cpu_memory_bytes() -> int:
    """The machine's RAM, or the least of the limits on this process where one is lower."""
    import psutil

    limits = [int(psutil.virtual_memory().total), address_space_limit(), cgroup_memory_limit()]
    return min(limit for limit in limits if limit is not None and limit > 0)
