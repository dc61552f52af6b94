"""The local runner as users run it and break it: relative paths and the default results dir,
a `kill -9` of dsat, a build lock left by an interrupted op build, an unreachable master."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from dsat.constants import RESULTS_ROOT, SETTINGS_FILE
from dsat.experiment.settings import DEFAULT_END_PROFILE_STEP, DEFAULT_START_PROFILE_STEP
from dsat.results.directory import BEST_CONFIG_FILE
from dsat.runners.local.deepspeed_ops import OP_LIBRARIES, extensions_root
from dsat.training.step_clock import measured_window
from tests.conftest import EXAMPLE_DIR, copy_example, measured_a_window
from tests.dsat_process import env, trials
from tests.runners.local.test_end_to_end import model_dir, trial_processes

pytestmark = pytest.mark.slow


def test_the_examples_own_command_with_the_default_results_dir(tmp_path: Path) -> None:
    # `cd examples/core_api_mlp && python3 -m dsat asha deepspeed.yaml .`, shortened.
    example = tmp_path / "core_api_mlp"
    copy_example(example)
    run = subprocess.run(
        ["python3", "-m", "dsat", "asha", "deepspeed.yaml", ".", "--max-trials", "3"],
        cwd=example,
        env=env(),
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [results] = (example / RESULTS_ROOT).iterdir()
    # --max-trials 3 (the profile included), and the user's own config on top of it.
    rows = trials(results)
    assert [row["kind"] for row in rows] == ["model_profile", "baseline", "search", "search"]
    assert [row["status"] for row in rows] == ["completed"] * 4
    assert json.loads((results / BEST_CONFIG_FILE).read_text())["train_micro_batch_size_per_gpu"]
    shown = f"best DeepSpeed config: {RESULTS_ROOT}/{results.name}/{BEST_CONFIG_FILE}"
    assert shown in run.stdout  # relative to where the user is
    for trial in (results / "trials").iterdir():
        assert not (trial / RESULTS_ROOT).exists()  # a trial's copy leaves the results out


def kill_9_leaves_no_trial(
    process: subprocess.Popen[str] | subprocess.Popen[bytes], tmp_path: Path
) -> None:
    """SIGKILL to dsat: within 15 s no process of its trials is left."""
    process.send_signal(signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 15
    while trial_processes(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert trial_processes(tmp_path) == []


def test_after_kill_9_no_trial_is_left_and_the_printed_command_resumes(tmp_path: Path) -> None:
    model_dir(tmp_path)  # tmp_path/model, with search trials that hang until killed
    args = ["binary", "model/deepspeed.yaml", "model", "-z", "1", "--max-trials", "4"]
    args += ["--max-slots", "2", "--search-range-factor", "0.005", "--results-dir", "results"]
    args += ["--no-baseline"]  # the search trials hang; the count below is theirs
    process = subprocess.Popen(
        [sys.executable, "-m", "dsat", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(DSAT_TEST_BEHAVIOUR="hang"),
    )
    assert process.stdout is not None
    hint = ""
    for line in process.stdout:
        if "if stopped, resume with: " in line:
            hint = line.split("resume with: ", 1)[1].strip()
            break
    results = tmp_path / "results"
    deadline = time.monotonic() + 240
    running: list[psutil.Process] = []
    while time.monotonic() < deadline and len(running) < 2:
        if (results / "trials.jsonl").is_file():  # the profile trial is done: search trials run
            running = [
                p for p in trial_processes(tmp_path) if "behaviour_train" in " ".join(p.cmdline())
            ]
        time.sleep(0.5)
    assert len(running) >= 2, "the search trials did not start"
    saved = (results / SETTINGS_FILE).read_text()
    kill_9_leaves_no_trial(process, tmp_path)

    assert shlex.split(hint)[-2:] == ["--resume", "results"]
    resumed = subprocess.run(
        hint, shell=True, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=540
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    rows = trials(results)
    assert len(rows) == 4 and all(row["status"] == "completed" for row in rows)
    assert (results / SETTINGS_FILE).read_text() == saved


def test_after_kill_9_a_hosted_trial_that_ignores_sigterm_is_stopped_with_its_child(
    tmp_path: Path,
) -> None:
    """A trial host runs the trial in itself, and its death signal is SIGTERM: a trial that
    ignored it outlived dsat, holding its GPU, with what it started."""
    path, directory = model_dir(tmp_path)
    command = [sys.executable, "-m", "dsat", "binary", str(path), str(directory), "-z", "1"]
    command += ["--max-trials", "3", "--max-slots", "1", "--search-range-factor", "0.005"]
    command += ["--no-baseline", "--trial-host", "--results-dir", str(tmp_path / "results")]
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env(DSAT_TEST_BEHAVIOUR="hang_ignoring_sigterm"),
    )
    deadline = time.monotonic() + 240
    children: list[psutil.Process] = []
    while time.monotonic() < deadline and not children:
        children = [p for p in trial_processes(tmp_path) if p.cmdline()[:1] == ["sleep"]]
        time.sleep(0.5)
    assert children, "the search trial did not start its child"
    kill_9_leaves_no_trial(process, tmp_path)


def test_a_stale_build_lock_is_removed_and_the_search_completes(tmp_path: Path) -> None:
    # A Ctrl-C during DeepSpeed's first op build leaves torch's lock file; every process that
    # needs the op would wait on it. A private extensions dir holds a copy of the built op.
    library = OP_LIBRARIES["ShareMemCommBuilder"]
    private = tmp_path / "torch_extensions"
    built = [p.parent for p in extensions_root({}).glob(f"*/{library}/{library}.so")]
    if built:
        shutil.copytree(built[0], private / library)  # else the search builds it first
    lock = private / library / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()  # its creator is gone
    path, directory = model_dir(tmp_path)
    start = time.monotonic()
    command = [sys.executable, "-m", "dsat", "binary", str(path), str(directory), "-z", "1"]
    command += ["--max-trials", "3", "--search-range-factor", "0.005", "--no-baseline"]
    command += ["--results-dir", str(tmp_path / "results")]
    run = subprocess.run(
        command,
        env=env(TORCH_EXTENSIONS_DIR=str(private)),
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "left behind by an interrupted DeepSpeed op build" in run.stdout
    assert not lock.exists()
    assert [row["status"] for row in trials(tmp_path / "results")] == ["completed"] * 3
    assert time.monotonic() - start < 120 or not built


def test_an_unreachable_master_is_a_short_error_without_deepspeeds_chatter(
    tmp_path: Path,
) -> None:
    environ = env(DET_MASTER="http://127.0.0.1:9")
    del environ["DS_ACCELERATOR"]  # DeepSpeed then announces the accelerator it picks
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsat",
            "asha",
            str(EXAMPLE_DIR / "deepspeed.yaml"),
            str(EXAMPLE_DIR),
        ],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert run.returncode == 2, lines
    assert 1 <= len(lines) <= 3, lines
    assert not any("[WARNING]" in line or "accelerator" in line for line in lines), lines
    assert "127.0.0.1:9" in lines[-1]


def example_without_steps(tmp_path: Path, steps: int | None) -> Path:
    """The Core API example training ``steps`` batches per operation, or ``op.length`` (the
    Determined idiom) when ``steps`` is None."""
    example = copy_example(tmp_path / "core_api_mlp")
    experiment = yaml.safe_load((example / "deepspeed.yaml").read_text())
    experiment["hyperparameters"].pop("steps")
    if steps is not None:
        experiment["hyperparameters"]["steps"] = steps
    (example / "deepspeed.yaml").write_text(yaml.safe_dump(experiment))
    return example


def small_search(example: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "dsat", "binary", "deepspeed.yaml", ".", "-z", "1"]
    command += ["--max-trials", "2", "--search-range-factor", "0.005", "--no-baseline"]
    command += ["--results-dir", str(tmp_path / "results")]
    return subprocess.run(
        command, cwd=example, env=env(), capture_output=True, text=True, timeout=540
    )


def test_the_core_api_idiom_of_op_length_batches_completes_off_cluster(tmp_path: Path) -> None:
    # Off-cluster det.core.init() would hand out one operation of length 1; under dsat's local
    # runner it has the length a cluster would give, so DeepSpeed reaches its measured window.
    run = small_search(example_without_steps(tmp_path, None), tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = trials(tmp_path / "results")
    assert [row["status"] for row in rows] == ["completed", "completed"]
    assert measured_a_window(rows[1]["metrics"])


def test_a_loop_too_short_to_measure_says_why_in_one_line(tmp_path: Path) -> None:
    run = small_search(example_without_steps(tmp_path, 8), tmp_path)
    assert run.returncode == 1
    rows = trials(tmp_path / "results")
    assert rows[1]["status"] == "error"
    first_line = rows[1]["error"].splitlines()[0]
    _, last = measured_window(DEFAULT_START_PROFILE_STEP, DEFAULT_END_PROFILE_STEP)
    assert first_line.startswith(f"training ended after 8 optimizer steps; dsat needs {last + 1}")
    said = f"trial {rows[1]['trial']} {rows[1]['name']}: error: {first_line[:150]}"
    assert said in run.stdout  # said, not kept
    assert rows[1]["cause"] == "script"


def test_a_script_that_feeds_its_own_batch_size_fails_the_search_and_says_so(
    tmp_path: Path,
) -> None:
    """A DataLoader built with batch_size=8, whatever the trial's micro-batch: every trial ran
    the same work, a larger micro-batch read as faster (3.03x "your config" for the same steps),
    and nothing was said."""
    example = copy_example(tmp_path / "core_api_mlp")
    script = (example / "train.py").read_text()
    assert "engine.train_micro_batch_size_per_gpu(), width" in script
    (example / "train.py").write_text(
        script.replace("engine.train_micro_batch_size_per_gpu(), width", "8, width")
    )  # the example's own micro-batch, in ds_config.json: the baseline runs it
    command = [sys.executable, "-m", "dsat", "binary", "deepspeed.yaml", ".", "-z", "1"]
    command += ["--max-trials", "4", "--results-dir", str(tmp_path / "results")]
    run = subprocess.run(
        command, cwd=example, env=env(), capture_output=True, text=True, timeout=540
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(
        "dsat: search failed: the training script feeds every trial batches "
        "of 8 whatever its micro-batch: "
    ), line
    assert line.endswith("engine.train_micro_batch_size_per_gpu(); docs/porting-core-api.md)")
    assert not [row for row in trials(tmp_path / "results") if row["kind"] == "confirm"]
    assert not (tmp_path / "results" / "best_ds_config.json").exists()  # none measured its own


@pytest.mark.parametrize("length", [20, {"records": 3000}])
def test_the_full_run_of_an_op_length_loop_trains_the_searchers_length(
    tmp_path: Path, length: int | dict[str, int]
) -> None:
    """Off a cluster Determined's operation has length 1: the Core API idiom trained one step
    in the full run and said "full experiment finished"; it has the experiment's
    searcher.max_length, as on a cluster (in records: batches of the hand-over's global batch,
    as Determined's master counts them; they trained one step)."""
    example = example_without_steps(tmp_path, None)
    experiment = yaml.safe_load((example / "deepspeed.yaml").read_text())
    assert experiment["searcher"]["max_length"] == 20
    experiment["searcher"]["max_length"] = length
    (example / "deepspeed.yaml").write_text(yaml.safe_dump(experiment))
    command = [sys.executable, "-m", "dsat", "binary", "deepspeed.yaml", ".", "-z", "1"]
    command += ["--max-trials", "2", "--search-range-factor", "0.005", "--no-baseline"]
    command += ["--results-dir", str(tmp_path / "results"), "--run-full-experiment"]
    run = subprocess.run(
        command, cwd=example, env=env(), capture_output=True, text=True, timeout=540
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    batch = json.loads((tmp_path / "results" / "best_ds_config.json").read_text())
    steps = (
        length if isinstance(length, int) else -(-length["records"] // batch["train_batch_size"])
    )
    assert f"trained {steps} steps, loss" in run.stdout, run.stdout[-3000:]
