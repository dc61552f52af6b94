"""DeepSpeed's JIT ops: which ones trials need, built-op detection, stale build locks."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dsat.runners.local import deepspeed_ops
from dsat.runners.local.deepspeed_ops import (
    build_ops,
    clear_stale_locks,
    deepspeed_sources,
    is_built,
    lock_holders,
    ops_for_trials,
)
from tests.conftest import REPO_ROOT


def test_trials_need_the_cpu_comm_op_and_the_optimizers_fused_op() -> None:
    adam = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert ops_for_trials({}, on_gpu=False) == ["ShareMemCommBuilder"]
    assert ops_for_trials(adam, on_gpu=True) == ["FusedAdamBuilder"]
    torch_adam = {"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}
    assert ops_for_trials(torch_adam, on_gpu=True) == []
    offload = {**adam, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert ops_for_trials(offload, on_gpu=True) == ["CPUAdamBuilder"]
    # --offload: the search's offload trials load CPU Adam beside the others' fused Adam.
    assert ops_for_trials(adam, on_gpu=True, offload=True) == ["FusedAdamBuilder", "CPUAdamBuilder"]
    assert ops_for_trials(offload, on_gpu=True, offload=True) == ["CPUAdamBuilder"]
    assert ops_for_trials(torch_adam, on_gpu=True, offload=True) == []
    assert ops_for_trials({"optimizer": {"type": "SGD"}}, on_gpu=True) == []


def holding(lock: Path) -> subprocess.Popen[bytes]:
    """A process that keeps ``lock`` open, as torch's build does while it compiles."""
    process = subprocess.Popen(
        [sys.executable, "-c", f"f = open({str(lock)!r}); print(1, flush=True); input()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stdout.readline().strip() == b"1"
    return process


def test_only_locks_no_living_process_holds_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    held = tmp_path / "fused_adam" / "lock"
    for lock in (stale, held):
        lock.parent.mkdir(parents=True)
        lock.touch()
    builder = holding(held)
    try:
        holders = lock_holders(held)
        assert holders is not None and builder.pid in holders  # read from Linux's /proc
        assert lock_holders(stale) == []
        removed = clear_stale_locks({"TORCH_EXTENSIONS_DIR": str(tmp_path)})
        assert removed == [stale] and not stale.exists() and held.exists()
    finally:
        builder.kill()
        builder.wait()
    deadline = time.monotonic() + 5
    while lock_holders(held) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert clear_stale_locks({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) == [held]


def test_a_built_op_is_not_built_again(tmp_path: Path) -> None:
    library = tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    assert not is_built("ShareMemCommBuilder", tmp_path)
    library.parent.mkdir()
    library.touch()
    ninja = library.parent / "build.ninja"
    ninja.write_text("build shm.o: compile /another/venv/deepspeed/ops/csrc/cpu/comm/shm.cpp\n")
    assert not is_built("ShareMemCommBuilder", tmp_path)  # another environment's build
    ninja.write_text(f"build shm.o: compile {deepspeed_sources()}/cpu/comm/shm.cpp\n")
    assert is_built("ShareMemCommBuilder", tmp_path)
    assert not is_built("SomeOtherBuilder", tmp_path)
    log = tmp_path / "logs" / "ops.log"
    assert build_ops(["ShareMemCommBuilder"], {"TORCH_EXTENSIONS_DIR": str(tmp_path)}, log)
    assert not log.exists()  # no build process was started


# Another search building under dsat's claim: it holds the claim, writes a built op into the
# extensions root ``argv[1]`` after ``argv[2]`` seconds, and ends.
BUILDING = """
import sys, time
from pathlib import Path
from dsat.runners.local.deepspeed_ops import BUILD_CLAIM, deepspeed_sources
from dsat.runners.local.machine_claims import try_claim
root = Path(sys.argv[1])
claim = try_claim(root / BUILD_CLAIM, {"pid": 4242, "log": str(root / "ops.log")})
print("building", flush=True)
time.sleep(float(sys.argv[2]))
op = root / "deepspeed_shm_comm"
op.mkdir(exist_ok=True)
(op / "build.ninja").write_text(f"build shm.o: compile {deepspeed_sources()}/cpu/comm/shm.cpp")
(op / "deepspeed_shm_comm.so").touch()
"""


def building(root: Path, seconds: float) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-c", BUILDING, str(root), str(seconds)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert process.stdout is not None and process.stdout.readline().strip() == b"building"
    return process


def test_while_another_search_builds_no_lock_is_removed(tmp_path: Path) -> None:
    # The lock no process holds yet may be the one its build is about to replace or take.
    unheld = tmp_path / "py311_cpu" / "fused_adam" / "lock"
    unheld.parent.mkdir(parents=True)
    unheld.touch()
    other = building(tmp_path, 60)
    try:
        assert clear_stale_locks({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) == []
        assert unheld.exists()
    finally:
        other.kill()
        other.wait()
    assert clear_stale_locks({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) == [unheld]


def test_a_lock_replaced_while_it_is_looked_at_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stale lock is removed by someone else and a new build creates its own in its place
    # while this process reads /proc: that one is a live build's and stays.
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    looked_at = lock_holders

    def replaced_meanwhile(path: Path) -> list[int] | None:
        holders = looked_at(path)
        path.unlink()
        path.touch()
        return holders

    monkeypatch.setattr(deepspeed_ops, "lock_holders", replaced_meanwhile)
    assert clear_stale_locks({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) == []
    assert lock.exists()


def test_a_build_under_way_elsewhere_is_waited_for_and_not_repeated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = building(tmp_path, 0.5)
    log = tmp_path / "logs" / "ops.log"
    with caplog.at_level(logging.INFO, logger="dsat"):
        assert build_ops(["ShareMemCommBuilder"], {"TORCH_EXTENSIONS_DIR": str(tmp_path)}, log)
    other.wait()
    assert caplog.messages == [
        f"waiting for the DeepSpeed op build under way in pid 4242 (log: {tmp_path / 'ops.log'})"
    ]
    assert not log.exists()  # the other search built it: no build process was started


def test_a_silent_build_shows_a_clock_and_is_stopped_past_its_time_limit(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A build compiles for minutes without a line: dsat says how long it has taken, and stops
    one past BUILD_TIMEOUT_S even though it never prints (the limit was checked per line)."""
    monkeypatch.setattr(deepspeed_ops, "BUILD_CLOCK_S", 0.2)
    monkeypatch.setattr(deepspeed_ops, "BUILD_TIMEOUT_S", 0.7)
    silent = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    done = threading.Event()
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger=deepspeed_ops.logger.name):
        deepspeed_ops._build_clock(silent, ["CPUAdamBuilder"], started, done)
    assert silent.wait(timeout=10) != 0  # killed
    assert time.monotonic() - started < 5
    clock = [r.getMessage() for r in caplog.records if "so far" in r.getMessage()]
    assert clock and clock[0] == "building DeepSpeed's CPUAdamBuilder op: 0:00 so far"


STARTS_A_COMPILER = """
import subprocess, sys, time
child = subprocess.Popen(["sleep", "60"])
print(f"child {child.pid}", flush=True)
time.sleep(60)
"""


def test_a_stopped_build_takes_what_it_started_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's ninja and the compilers it starts outlived a build process killed alone, still
    compiling into the directory whose lock the next search removed as stale."""
    monkeypatch.setattr(deepspeed_ops, "BUILD_SCRIPT", STARTS_A_COMPILER)
    monkeypatch.setattr(deepspeed_ops, "BUILD_CLOCK_S", 0.2)
    monkeypatch.setattr(deepspeed_ops, "BUILD_TIMEOUT_S", 1.0)
    log = tmp_path / "ops.log"
    started = time.monotonic()
    assert not deepspeed_ops._build({"CPUAdamBuilder": False}, {}, log, ())
    assert time.monotonic() - started < 10  # not held until the compiler, holding its output, ends
    child = int(log.read_text().split()[1])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _running(child):
        time.sleep(0.1)
    assert not _running(child)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; its parent (init, here) reaps it
