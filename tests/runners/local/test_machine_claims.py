"""Claims on the machine's slots: taken, waited for while another process holds them (and its
holder named), free once their holder is dead, released."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsat.runners.local.machine_claims import (
    Holder,
    claim_slots,
    holder,
    lock_dir,
    slot_file,
    try_claim,
    waiting_line,
)
from tests.conftest import REPO_ROOT

HOLD = """
import sys
from pathlib import Path
from dsat.runners.local.machine_claims import claim_slots
claimed = claim_slots(sys.argv[2:], len(sys.argv) - 2, Path(sys.argv[1]), Path("elsewhere"), False)
print("held", flush=True)
sys.stdin.read()
"""


def holding(directory: Path, *slots: str) -> subprocess.Popen[str]:
    """Another search's process, holding ``slots`` until its stdin is closed."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory), *slots],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=directory.parent,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_the_lock_dir_is_dsat_lock_dir_or_one_in_the_temp_dir(tmp_path: Path) -> None:
    assert lock_dir({"DSAT_LOCK_DIR": str(tmp_path)}) == tmp_path
    assert lock_dir({}).name == "dsat-locks"


def test_free_slots_are_claimed_and_say_who_holds_them(tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    claimed = claim_slots(["cpu0", "cpu1"], 2, locks, tmp_path / "results", False)
    assert claimed.slots == ["cpu0", "cpu1"]
    assert holder(locks / "cpu0.lock") == Holder(os.getpid(), str(tmp_path / "results"))
    assert locks.stat().st_mode & 0o1777 == 0o1777  # every user's searches share it
    assert (locks / "cpu1.lock").stat().st_mode & 0o666 == 0o666
    assert try_claim(locks / "cpu0.lock", {}) is None  # held, even against this process
    claimed.release()
    again = try_claim(locks / "cpu0.lock", {})
    assert again is not None
    again.release()


def test_a_claim_dropped_unreleased_is_free(tmp_path: Path) -> None:
    claimed = claim_slots(["cpu0"], 1, tmp_path, tmp_path, False)
    del claimed
    gc.collect()
    assert try_claim(tmp_path / "cpu0.lock", {}) is not None


def test_a_second_search_waits_names_the_holder_and_goes_on_once_it_ends(
    tmp_path: Path,
) -> None:
    locks = tmp_path / "locks"
    other = holding(locks, "cpu0", "cpu1")
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        assert other.stdin is not None
        other.stdin.close()  # the other search ends

    try:
        claimed = claim_slots(["cpu0", "cpu1"], 2, locks, tmp_path / "mine", False, say, 0.05)
    finally:
        other.kill()
        other.wait()
    assert said == [
        f"dsat: waiting for cpu0, cpu1: held by the search in {tmp_path / 'elsewhere'} "
        f"(pid {other.pid})"
    ]
    assert claimed.slots == ["cpu0", "cpu1"]
    assert holder(locks / "cpu1.lock").results_dir == str(tmp_path / "mine")


def test_a_claim_left_by_a_dead_process_is_taken_at_once(tmp_path: Path) -> None:
    record = {"pid": dead_pid(), "results_dir": str(tmp_path / "gone"), "since": 0.0}
    for slot in ("cpu0", "cpu1"):
        (tmp_path / slot_file(slot, False)).write_text(json.dumps(record))
    said: list[str] = []
    claimed = claim_slots(["cpu0", "cpu1"], 2, tmp_path, tmp_path / "mine", False, said.append)
    assert said == [] and claimed.slots == ["cpu0", "cpu1"]
    assert holder(tmp_path / "cpu0.lock").pid == os.getpid()


def test_on_a_gpu_the_free_ones_of_the_visible_gpus_are_taken(tmp_path: Path) -> None:
    first = claim_slots(["0", "1", "GPU-5f3a/1"], 1, tmp_path, tmp_path / "a", True)
    second = claim_slots(["0", "1", "GPU-5f3a/1"], 2, tmp_path, tmp_path / "b", True)
    assert (first.slots, second.slots) == (["0"], ["1", "GPU-5f3a/1"])
    assert (tmp_path / "gpu-GPU-5f3a_1.lock").is_file()


def test_nothing_is_held_while_waiting(tmp_path: Path) -> None:
    other = claim_slots(["cpu1"], 1, tmp_path, tmp_path / "other", False)

    def say(line: str) -> None:
        assert try_claim(tmp_path / "cpu0.lock", {}) is not None  # not kept while waiting
        other.release()

    claimed = claim_slots(["cpu0", "cpu1"], 2, tmp_path, tmp_path / "mine", False, say, 0.01)
    assert claimed.slots == ["cpu0", "cpu1"]


def test_the_waiting_line_groups_slots_by_holder() -> None:
    a, b = Holder(11, "/r/a"), Holder(12, "/r/b")
    line = waiting_line([("0", a), ("1", b), ("2", a)], on_gpu=True)
    assert line == (
        "dsat: waiting for GPU 0, GPU 2: held by the search in /r/a (pid 11); "
        "GPU 1: held by the search in /r/b (pid 12)"
    )
    assert (
        waiting_line([("cpu0", Holder())], False)
        == "dsat: waiting for cpu0: held by another search"
    )


def test_more_slots_than_there_are_is_a_programming_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        claim_slots(["cpu0"], 2, tmp_path, tmp_path, False)
