"""DeepSpeed's JIT ops: which ones trials need, built-op detection, stale build locks."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from dsat.runners.local.deepspeed_ops import (
    build_ops,
    clear_stale_locks,
    deepspeed_sources,
    is_built,
    lock_holders,
    ops_for_trials,
)


def test_trials_need_the_cpu_comm_op_and_the_optimizers_fused_op() -> None:
    adam = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert ops_for_trials({}, on_gpu=False) == ["ShareMemCommBuilder"]
    assert ops_for_trials(adam, on_gpu=True) == ["FusedAdamBuilder"]
    torch_adam = {"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}
    assert ops_for_trials(torch_adam, on_gpu=True) == []
    offload = {**adam, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert ops_for_trials(offload, on_gpu=True) == ["CPUAdamBuilder"]
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
