"""A search owns its devices: two searches started together on one machine take it in turn, the
second saying whom it waits for; another search's op build keeps its locks; a slot claim left by
a dead process is free; Ctrl-C while waiting is an ordinary Ctrl-C.

The searches are real dsat processes with the local runner; their trials are a stub that reports
what a trained model would (a real trial takes about 50 s on a loaded 2-core box), so each search
takes seconds. Each test checks the outcome, the terminal, and trials.jsonl."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from dsat.runners.local.deepspeed_ops import BUILD_CLAIM, OP_LIBRARIES, deepspeed_sources
from dsat.runners.local.machine_claims import LOCK_DIR_ENV, holder, slot_file
from tests.conftest import REPO_ROOT, write_experiment
from tests.dsat_process import env, trials

# A trial as dsat sees one: the model profile's figures, or a measurement, after a second's work;
# its wall-clock span is kept beside it to tell whether two searches' trials overlapped.
STUB_TRAIN = """
import json, os, time
started = time.time()
overrides = json.load(open(os.environ["DSAT_HPARAMS_FILE"]))["overwrite_deepspeed_args"]
if overrides.get("autotuning", {}).get("model_info", {}).get("profile"):
    values = {"num_params": 2145, "trainable_num_params": 2145, "rank": 0,
              "activation_mem_per_gpu": 2850816, "gpu_mem": 25276063744}
else:
    mbs = overrides["train_micro_batch_size_per_gpu"]
    values = {"FLOPS_per_gpu": 1e7 * mbs, "throughput": 100.0 * mbs, "latency": 10.0 / mbs,
              "memory_peak_bytes": 3e8, "memory_total_bytes": 25276063744, "measured_steps": 10}
time.sleep(1)
json.dump({"status": "completed", "values": values}, open("dsat_trial_outcome.json", "w"))
json.dump([started, time.time()], open("span.json", "w"))
"""
TRIALS = 2  # the model profile and one search trial
CPU_SLOTS = [f"cpu{i}" for i in range(os.cpu_count() or 1)]


def stub_model(tmp_path: Path) -> Path:
    path = write_experiment(tmp_path / "model")
    (path.parent / "train.py").write_text(STUB_TRAIN)
    return path


def command(model: Path, results: Path) -> list[str]:
    """A small binary search of the stub model."""
    args = ["binary", str(model), str(model.parent), "-z", "1", "--max-trials", str(TRIALS)]
    args += ["--search-range-factor", "0.005", "--results-dir", str(results), "--no-baseline"]
    return [sys.executable, "-m", "dsat", *args]


def start(model: Path, results: Path, out: IO[str], **extra: str) -> subprocess.Popen[str]:
    """The search, its output in ``out``."""
    return subprocess.Popen(
        command(model, results),
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(**extra),
    )


def search(tmp_path: Path, **extra: str) -> tuple[int, str, Path]:
    """A search run to its end: its exit status, its output and its results dir."""
    results = tmp_path / "results"
    with (tmp_path / "out.txt").open("w") as out:
        code = start(stub_model(tmp_path), results, out, **extra).wait(timeout=180)
    return code, (tmp_path / "out.txt").read_text(), results


def completed(results: Path) -> bool:
    """trials.jsonl holds every trial, each completed."""
    return [row["status"] for row in trials(results)] == ["completed"] * TRIALS


def spans(results: Path) -> list[tuple[float, float]]:
    return sorted(tuple(json.loads(p.read_text())) for p in results.glob("trials/*/span.json"))


def test_two_searches_started_together_take_the_machine_in_turn(tmp_path: Path) -> None:
    model = stub_model(tmp_path)
    runs: dict[str, tuple[subprocess.Popen[str], Path]] = {}
    for name in ("a", "b"):
        with (tmp_path / f"{name}.txt").open("w") as out:
            runs[name] = start(model, tmp_path / name, out), tmp_path / name
    codes = {name: process.wait(timeout=180) for name, (process, _) in runs.items()}
    outs = {name: (tmp_path / f"{name}.txt").read_text() for name in runs}
    assert codes == {"a": 0, "b": 0}, outs
    waited = [name for name in runs if "dsat: waiting for" in outs[name]]
    assert len(waited) == 1, outs  # one took the machine, the other waited for it
    second = waited[0]
    first = "b" if second == "a" else "a"
    process, results = runs[first]
    line = f"dsat: waiting for {', '.join(CPU_SLOTS)}: held by the search in {results} "
    line += f"(pid {process.pid})"
    lines = outs[second].splitlines()
    assert lines.count(line) == 1, outs[second]
    assert lines.index(line) < next(i for i, text in enumerate(lines) if "CPU slot(s)" in text)
    for name, (_, results) in runs.items():
        assert completed(results), outs[name]
        assert len(spans(results)) == TRIALS
    assert spans(runs[first][1])[-1][1] <= spans(runs[second][1])[0][0]  # never side by side


def test_another_searchs_op_build_keeps_its_locks(tmp_path: Path) -> None:
    # The other search builds: it holds dsat's build claim, and its build process holds torch's
    # lock open (FileBaton); the lock of the op it builds next is not held by anyone yet.
    extensions = tmp_path / "torch_extensions"
    library = OP_LIBRARIES["ShareMemCommBuilder"]
    op = extensions / library
    op.mkdir(parents=True)
    (op / "build.ninja").write_text(f"build shm.o: compile {deepspeed_sources()}/cpu/comm/shm.cpp")
    (op / f"{library}.so").touch()  # built: the stub trials never load it
    held, unheld = op / "lock", extensions / "py311_cpu" / "fused_adam" / "lock"
    unheld.parent.mkdir(parents=True)
    unheld.touch()
    other = subprocess.Popen(
        [sys.executable, "-c", BUILDING, str(extensions / BUILD_CLAIM), str(held)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "building"
        code, out, results = search(tmp_path, TORCH_EXTENSIONS_DIR=str(extensions))
    finally:
        other.kill()
        other.wait()
    assert code == 0, out
    assert held.exists() and unheld.exists()
    assert "lock" not in out and "removed" not in out, out
    assert completed(results), out


BUILDING = """
import os, sys
from pathlib import Path
from dsat.runners.local.machine_claims import try_claim
claim = try_claim(Path(sys.argv[1]), {"pid": os.getpid(), "log": "ops.log"})
baton = os.open(sys.argv[2], os.O_CREAT | os.O_EXCL)
print("building", flush=True)
sys.stdin.read()
"""


def test_a_slot_claim_left_by_a_dead_process_is_taken_at_once(tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    locks.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    record: dict[str, Any] = {"pid": gone.pid, "results_dir": str(tmp_path / "gone")}
    for slot in CPU_SLOTS:
        (locks / slot_file(slot, on_gpu=False)).write_text(json.dumps(record))
    code, out, results = search(tmp_path, **{LOCK_DIR_ENV: str(locks)})
    assert code == 0, out
    assert "waiting" not in out, out
    assert completed(results), out
    assert holder(locks / slot_file("cpu0", on_gpu=False)).results_dir == str(results)


HOLDING = """
import sys
from pathlib import Path
from dsat.runners.local.machine_claims import claim_slots
held = claim_slots(sys.argv[3:], len(sys.argv) - 3, Path(sys.argv[1]), Path(sys.argv[2]), False)
print("held", flush=True)
sys.stdin.read()
"""


def test_ctrl_c_while_waiting_for_slots_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    locks, elsewhere = tmp_path / "locks", tmp_path / "elsewhere"
    other = subprocess.Popen(
        [sys.executable, "-c", HOLDING, str(locks), str(elsewhere), *CPU_SLOTS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "held"
        results, model = tmp_path / "results", stub_model(tmp_path)
        process = subprocess.Popen(
            command(model, results),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(**{LOCK_DIR_ENV: str(locks)}),
        )
        assert process.stdout is not None
        lines = []
        for text in process.stdout:
            lines.append(text)
            if text.startswith("dsat: waiting for"):
                break
        assert f"held by the search in {elsewhere} (pid {other.pid})" in lines[-1], lines
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        other.kill()
        other.wait()
    assert process.returncode == 130
    # It said only "interrupted": nothing to resume, and now that nothing was kept.
    assert err == (
        "dsat: interrupted before the first trial (while the runner got ready); nothing was kept: "
        "run the same command again\n"
    ), err
    assert "slot(s) on this machine" not in out
    assert not results.exists()  # no trial ran: the same command starts afresh
