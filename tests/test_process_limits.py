"""The memory a process may use where a container or the shell limits it below the RAM, and what
dsat says when such a limit is in the way: real processes under a real ``ulimit -v``."""

from __future__ import annotations

import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil

from dsat.process_limits import cgroup_memory_limit
from dsat.search_launch import address_space_note
from tests.conftest import write_experiment
from tests.dsat_process import env

GIB = 2**30


def limited_to(size: int) -> Callable[[], None]:
    """A ``preexec_fn`` that gives the child process an address-space limit, as `ulimit -v`."""

    def limit() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (size, hard))

    return limit


def test_a_cgroup_limit_is_read_from_v2_or_v1_and_none_means_none(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("max\n")
    assert cgroup_memory_limit((v2, v1)) is None
    v2.write_text("17179869184\n")
    assert cgroup_memory_limit((v2, v1)) == 16 * GIB
    v1.write_text("8589934592\n")
    assert cgroup_memory_limit((tmp_path / "absent", v1)) == 8 * GIB
    assert cgroup_memory_limit((tmp_path / "absent",)) is None


def test_the_cpu_device_memory_is_the_address_space_limit_where_it_is_below_the_ram() -> None:
    """On the CPU the memory model plans with this figure; it was the whole RAM under any
    limit, so a trial past the limit read as a model too large for memory it could never have."""
    limit = 3 * GIB
    assert limit < psutil.virtual_memory().total
    code = "from dsat.process_limits import cpu_memory_bytes; print(cpu_memory_bytes())"
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env(),
        preexec_fn=limited_to(limit),
        check=True,
    )
    assert int(run.stdout) == limit


def test_a_shell_limit_too_low_for_deepspeed_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    config = write_experiment(tmp_path / "model")
    run = subprocess.run(
        [sys.executable, "-m", "dsat", "guided", str(config), str(tmp_path / "model")],
        capture_output=True,
        text=True,
        env=env(),
        cwd=tmp_path,
        preexec_fn=limited_to(300 * 2**20),  # dsat starts; torch's libraries do not map
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsat: error: cannot import DeepSpeed here (")
    assert "ulimit -a" in lines[0]
    assert not (tmp_path / "dsat-results").exists()  # nothing started


def test_the_address_space_limit_is_said_before_any_trial() -> None:
    assert address_space_note(None) == []
    (note,) = address_space_note(6 * GIB)
    assert note.startswith("dsat: note: this shell limits a process's address space to 6 GiB")
    assert "ulimit -v unlimited" in note
