"""The local runner end to end, through the CLI: real DeepSpeed trials on the CPU as processes."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from dsat.constants import TRIAL_OUTCOME_FILE
from dsat.experiment.ds_config_check import deepspeed_config_error
from dsat.runners.local.runner import HOST_TRIAL_MARK
from dsat.runners.local.runner import WARM_TRIAL_MARK as WARM_MARK
from tests.conftest import copy_example, measured_a_window
from tests.dsat_process import dsat, env, trials

pytestmark = pytest.mark.slow
FIXTURE = Path(__file__).parents[1] / "fixtures" / "behaviour_train.py"


def model_dir(tmp_path: Path, **config: Any) -> tuple[Path, Path]:
    """A copy of the CPU example plus the misbehaving entrypoint; returns (yaml, model dir)."""
    directory = tmp_path / "model"
    copy_example(directory)
    shutil.copy(FIXTURE, directory / "behaviour_train.py")
    experiment = yaml.safe_load((directory / "deepspeed.yaml").read_text())
    experiment["entrypoint"] = "python3 behaviour_train.py"
    experiment["hyperparameters"].update({"width": 32, "depth": 2})
    experiment.update(config)
    path = directory / "deepspeed.yaml"
    path.write_text(yaml.safe_dump(experiment))
    return path, directory


def binary_search(
    tmp_path: Path,
    max_trials: int,
    *flags: str,
    zero_stage: int = 1,
    range_factor: float = 0.005,
    config: dict[str, Any] | None = None,
    baseline: bool = False,
    **extra: str,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A small binary search of the test model (ZeRO-1 unless asked; ``config``: changes to its
    experiment YAML); returns the run and its results dir."""
    path, directory = model_dir(tmp_path, **(config or {}))
    results = tmp_path / "results"
    run = dsat(
        "binary",
        str(path),
        str(directory),
        "-z",
        str(zero_stage),
        "--max-trials",
        str(max_trials),
        "--search-range-factor",
        str(range_factor),
        "--results-dir",
        str(results),
        *flags,
        baseline=baseline,
        **extra,
    )
    return run, results


def test_small_search_writes_a_best_config_deepspeed_accepts(tmp_path: Path) -> None:
    path, directory = model_dir(tmp_path)
    user_files = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    results = tmp_path / "results"
    run = dsat(
        "asha",
        str(path),
        str(directory),
        "-z",
        "0",
        "1",
        "2",
        "3",
        "--max-trials",
        "7",
        "--max-slots",
        "2",
        "--search-range-factor",
        "0.01",
        "--results-dir",
        str(results),
        "--run-full-experiment",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = trials(results)
    confirmations = trials(results, confirmations=True)
    # Progress: one plain line per finished trial (stdout is a pipe here, so no live display).
    assert "dsat: trial 1 model profile: completed | running" in run.stdout  # logs/001-*
    finished_lines = re.findall(r"^dsat: trial \d+ ", run.stdout, re.MULTILINE)
    assert len(finished_lines) == 7 + len(confirmations)
    assert "\x1b[" not in run.stdout
    assert len(rows) == 7 and all(row["status"] == "completed" for row in rows)
    # The leaders ran again; the handed-over config is one of them, measured by dsat itself.
    assert len(confirmations) >= 2 and "confirmation round" in run.stdout
    assert all(measured_a_window(row["metrics"]) for row in rows[1:])
    assert rows[0]["kind"] == "model_profile" and rows[0]["metrics"]["num_params"] > 0
    # Trials ran in trial hosts (one per slot: the CPU's default); the full run started fresh.
    trial_logs = sorted((results / "logs").glob("[0-9]*.log"))
    assert len(trial_logs) == 7 + len(confirmations)
    assert all(HOST_TRIAL_MARK in log.read_text().splitlines()[0] for log in trial_logs)
    # A worker's log is kept only where it says something (why it went cold, or a host left).
    assert all(log.read_text().strip() for log in (results / "logs").glob("warm-worker-*.log"))
    full_log = (results / "logs" / "full-experiment.log").read_text()
    assert WARM_MARK not in full_log and HOST_TRIAL_MARK not in full_log
    assert json.loads((results / "settings.json").read_text())["trial_host"] is None
    # A normal run's logs hold no traceback (warm workers stopping at the end included).
    logs = (results / "logs").glob("*.log")
    assert not [log.name for log in logs if "Traceback" in log.read_text()]
    # The report was drawn at the end, from real trials (peak memory measured), and on demand.
    assert f"dsat: report: {results / 'report.png'}" in run.stdout
    assert (results / "report.png").read_bytes().startswith(b"\x89PNG")
    peak = rows[1]["metrics"]["memory_peak_bytes"] / 2**30
    assert f"<td>{rows[1]['name']}</td><td>completed</td>" in (results / "report.html").read_text()
    assert f"<td>{peak:.2f}</td>" in (results / "report.html").read_text()
    again = dsat("report", str(results))
    assert again.returncode == 0 and "| stage | trials |" in again.stdout
    assert "| global" in run.stdout and str(results / "best_ds_config.json") in run.stdout
    best = json.loads((results / "best_ds_config.json").read_text())
    assert "autotuning" not in best
    confirmed = {(row["zero_stage"], row["mbs"]) for row in confirmations}
    assert (best["zero_optimization"]["stage"], best["train_micro_batch_size_per_gpu"]) in confirmed
    check = (
        "import json, sys, torch, deepspeed\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from model import TinyMLP\n"
        "m = TinyMLP(32, 2)\n"
        "engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), "
        "config=json.load(open(sys.argv[1])))\n"
        "print('initialized', engine.train_micro_batch_size_per_gpu())\n"
    )
    initialized = subprocess.run(
        [sys.executable, "-c", check, str(results / "best_ds_config.json"), str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517"
        ),
    )
    assert initialized.returncode == 0, initialized.stderr[-3000:]
    assert f"initialized {best['train_micro_batch_size_per_gpu']}" in initialized.stdout
    # The user's model dir is never modified: trials ran in copies.
    assert {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()} == user_files
    assert len(list((results / "trials").iterdir())) == 7 + len(confirmations)
    # --run-full-experiment trained once more with the best overrides and no autotuning block.
    full_hparams = json.loads((results / "full-experiment" / "dsat_hparams.json").read_text())
    overwrites = full_hparams["overwrite_deepspeed_args"]
    assert "autotuning" not in overwrites
    assert overwrites["train_micro_batch_size_per_gpu"] == best["train_micro_batch_size_per_gpu"]
    assert "trained 20 steps, loss" in run.stdout
    assert "trained 20 steps" in (results / "logs" / "full-experiment.log").read_text()
    assert run.stdout.rstrip().endswith("full-experiment.log")
    # Asked once, trained once: the printed resume command does not train again, and asking
    # again does not wipe what the full run wrote (a checkpoint, say): one line.
    full_log = (results / "logs" / "full-experiment.log").read_bytes()
    (results / "full-experiment" / "checkpoint.pt").write_bytes(b"weights")
    again = dsat("asha", "--resume", str(results))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "full experiment" not in again.stdout
    assert (results / "logs" / "full-experiment.log").read_bytes() == full_log
    refused = dsat("asha", "--resume", str(results), "--run-full-experiment")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"dsat: error: --run-full-experiment: {results / 'full-experiment'} holds an earlier "
        "full run (what it wrote, checkpoints among them); move it away, then run the same "
        "command again"
    ]
    assert (results / "full-experiment" / "checkpoint.pt").read_bytes() == b"weights"
    # A file in its place was found only once the run had trained (on Ray its files then stayed
    # on the nodes): one line before it starts.
    (results / "full-experiment").rename(tmp_path / "kept-full-run")
    (results / "full-experiment").write_text("not a directory")
    in_the_way = dsat("asha", "--resume", str(results), "--run-full-experiment")
    assert in_the_way.returncode == 2, in_the_way.stdout[-3000:] + in_the_way.stderr[-3000:]
    assert "full-experiment is not a directory, and the full run writes there" in in_the_way.stderr


def test_a_search_runs_its_trials_in_a_trial_host(tmp_path: Path) -> None:
    # ZeRO-3, in a model dir with its deepspeed.yaml as a user's has: that file once kept the
    # host from importing DeepSpeed before its baseline, and every ZeRO-3 trial that DeepSpeed's
    # autotuning ended inside its step left its engine alive and its host replaced.
    run, results = binary_search(tmp_path, 5, "--trial-host", "--max-slots", "1", zero_stage=3)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = trials(results)
    assert len(rows) == 5 and all(row["status"] == "completed" for row in rows)
    assert all(measured_a_window(row["metrics"]) for row in rows[1:])
    trial_logs = sorted((results / "logs").glob("[0-9]*.log"))
    assert trial_logs and all(HOST_TRIAL_MARK in log.read_text() for log in trial_logs)
    # No host was replaced for an engine left alive or DeepSpeed imported after its baseline. One
    # may leave for its measured pace: after ZeRO-3 on the CPU, gloo's threads keep OpenMP pools
    # that slow small products, most where another process loads the cores (CI's other worker).
    worker_path = results / "logs" / "warm-worker-cpu0.log"  # none where it said nothing
    worker_log = worker_path.read_text() if worker_path.exists() else ""
    reasons = [
        reason
        for line in worker_log.splitlines()
        if line.startswith("dsat: this trial host leaves: ")
        for reason in line.removeprefix("dsat: this trial host leaves: ").split("; ")
    ]
    assert all(reason.startswith("torch's small CPU operations") for reason in reasons), reasons
    assert json.loads((results / "settings.json").read_text())["trial_host"] is True


def test_guided_search_runs_real_trials_and_hands_over_a_config(tmp_path: Path) -> None:
    path, directory = model_dir(tmp_path)
    results = tmp_path / "results"
    run = dsat(
        "guided",
        str(path),
        str(directory),
        "-z",
        "1",
        "2",
        "--max-trials",
        "6",
        "--max-slots",
        "2",
        "--confirm-top",
        "0",
        "--results-dir",
        str(results),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = trials(results)
    assert rows[0]["kind"] == "model_profile"
    search = rows[1:]
    assert len(search) == 5 and {row["zero_stage"] for row in search} == {1, 2}
    assert all(row["status"] == "completed" for row in search)
    best = json.loads((results / "best_ds_config.json").read_text())
    # What is handed over is one of the trials, knobs and all (guided may measure one stage and
    # micro-batch twice, with other bucket sizes), and the summary's global row names it with its
    # measured value. guided hands over by its estimate, which pools neighbouring trials, so on
    # the CPU's noise that need not be the single fastest measurement.
    handed = [
        row
        for row in search
        if row["mbs"] == best["train_micro_batch_size_per_gpu"]
        and row["overwrites"]["zero_optimization"]
        == {k: best["zero_optimization"].get(k) for k in row["overwrites"]["zero_optimization"]}
    ]
    assert handed
    global_row = (results / "summary.txt").read_text().splitlines()
    global_row = [line for line in global_row if line.startswith("| global")]
    assert f"z{best['zero_optimization']['stage']}_mb{handed[0]['mbs']}" in global_row[0]
    assert any(f"{row['metrics']['FLOPS_per_gpu']:.6g}" in global_row[0] for row in handed)
    assert "-m dsat guided --resume" in run.stdout  # the resume hint names the method


OOM_ABOVE = 4


def test_oom_lowers_the_ceiling(tmp_path: Path) -> None:
    run, results = binary_search(tmp_path, 6, DSAT_TEST_BEHAVIOUR=f"oom_above:{OOM_ABOVE}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = trials(results)[1:]
    # The first micro-batch comes from the memory model (CPU-measured activations, so it varies
    # from run to run, 19-31 seen); any of them is above the test model's limit.
    assert rows[0]["mbs"] > OOM_ABOVE and rows[0]["status"] == "oom"
    assert "OutOfMemoryError" in rows[0]["error"]
    for row in rows:
        assert (row["status"] == "oom") == (row["mbs"] > OOM_ABOVE)
    assert rows[1]["mbs"] < rows[0]["mbs"]  # the lineage's ceiling came down
    assert any(row["status"] == "completed" for row in rows)


def test_a_model_that_fits_only_offloaded_climbs_the_ladder_with_real_deepspeed(
    tmp_path: Path,
) -> None:
    """Every trial without the optimizer's states on the CPU runs out of memory, the model
    profile too: the search profiles again with ZeRO-3, then with CPU offload, and searches and
    hands over offloaded configurations that DeepSpeed trains on the CPU."""
    run, results = binary_search(
        tmp_path, 5, zero_stage=3, range_factor=0.002, DSAT_TEST_BEHAVIOUR="fits_offloaded"
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = trials(results)
    profiles = [row for row in rows if row["kind"] == "model_profile"]
    assert [row["status"] for row in profiles] == ["oom", "oom", "completed"]
    offloads = [
        row["overwrites"].get("zero_optimization", {}).get("offload_optimizer") for row in profiles
    ]
    assert offloads[:2] == [None, None] and offloads[2]["device"] == "cpu"
    searched = [row for row in rows if row["kind"] == "search"]
    assert searched and all(
        row["overwrites"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
        for row in searched
    )
    assert any(row["status"] == "completed" for row in searched)
    best = json.loads((results / "best_ds_config.json").read_text())
    assert best["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "to fit: ZeRO-3, optimizer states" in (results / "summary.txt").read_text()


def test_a_fixed_global_batch_is_kept_by_every_trial_and_the_hand_over(tmp_path: Path) -> None:
    """--global-batch 64 on one slot, with micro-batches above 16 out of memory: every trial
    trains at 64 samples per optimizer step, the micro-batches that fit with accumulation."""
    run, results = binary_search(
        tmp_path, 5, "--global-batch", "64", DSAT_TEST_BEHAVIOUR=f"oom_above:{4 * OOM_ABOVE}"
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = trials(results) + trials(results, confirmations=True)
    for row in rows:
        batch = row["overwrites"]
        assert batch["train_batch_size"] == 64
        assert batch["train_micro_batch_size_per_gpu"] * batch["gradient_accumulation_steps"] == 64
    ran = [row for row in rows[1:] if row["status"] == "completed"]
    assert ran and all(row["gas"] > 1 for row in ran)  # 16 at most fits: accumulation made up 64
    assert all(measured_a_window(row["metrics"]) for row in ran)
    best = json.loads((results / "best_ds_config.json").read_text())
    assert best["train_batch_size"] == 64
    assert best["train_micro_batch_size_per_gpu"] <= 4 * OOM_ABOVE
    assert best["train_micro_batch_size_per_gpu"] * best["gradient_accumulation_steps"] == 64
    assert deepspeed_config_error(best, world_size=1) is None  # ready for deepspeed.initialize
    assert "global batch: 64 (micro-batch" in (results / "summary.txt").read_text()
    assert "kept in every trial" in run.stdout


def test_the_users_own_config_runs_once_and_the_hand_over_is_compared_with_it(
    tmp_path: Path,
) -> None:
    """The baseline, with real DeepSpeed: the example's own config (ZeRO-1, micro-batch 8) runs
    once after the profile, on top of the trials, and the last lines on screen compare."""
    run, results = binary_search(tmp_path, 4, baseline=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = trials(results)
    assert [row["kind"] for row in rows[:2]] == ["model_profile", "baseline"]
    # At most --max-trials 4, the profile included: the baseline is on top.
    assert 1 <= sum(row["kind"] == "search" for row in rows) <= 3
    baseline = rows[1]
    assert baseline["status"] == "completed" and (baseline["zero_stage"], baseline["mbs"]) == (1, 8)
    assert measured_a_window(baseline["metrics"])
    assert f"dsat: trial {baseline['trial']} your config (z1_mb8): completed" in run.stdout
    assert Path(baseline["log"]).name.startswith(f"{baseline['trial']:03d}-")
    if "dsat: found ZeRO-1 micro-batch 8: your own config;" in run.stdout:
        # The search handed over the user's own configuration: no speed-up to state.
        assert "your config is the one handed over (ZeRO-1 micro-batch 8)" in run.stdout
    else:
        found = re.search(
            r"^dsat: found .*: (\d+\.\d\d)x your config's FLOPS_per_gpu(?:; .+)?$",
            run.stdout,
            re.M,
        )
        assert found and f"{found.group(1)}x your config (" in run.stdout  # as the summary says
        line = next(x for x in run.stdout.splitlines() if "x your config (" in x)
        assert re.match(
            r"^\d+\.\d\dx your config \(FLOPS_per_gpu [0-9.e+]+(?:, with the search's .+ of it "
            r"\(z1_mb8[^)]*\))?\): ZeRO-1 micro-batch 8 -> ",
            line,
        )
    assert "1 baseline" in (results / "summary.txt").read_text()


def test_a_script_that_changes_directory_still_reports_its_trials(tmp_path: Path) -> None:
    # Hydra moves into an output folder before main runs: DeepSpeed's and dsat's result files
    # must still reach the trial's directory, not read as "exited without reporting".
    run, results = binary_search(tmp_path, 3, DSAT_TEST_BEHAVIOUR="chdir")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = trials(results)
    assert [row["status"] for row in rows] == ["completed"] * 3
    assert json.loads((results / "best_ds_config.json").read_text())[
        "train_micro_batch_size_per_gpu"
    ]
    for trial in (results / "trials").iterdir():
        # dsat's own outcome (its step clock's figures), not only DeepSpeed's file, is there
        assert json.loads((trial / TRIAL_OUTCOME_FILE).read_text())["status"] == "completed"
        assert not any((trial / "outputs").iterdir())  # nothing was left where it moved


def test_a_script_that_sets_its_own_micro_batch_is_blamed_not_the_config(tmp_path: Path) -> None:
    run, results = binary_search(tmp_path, 2, DSAT_TEST_BEHAVIOUR="own_micro_batch:8")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    [profile] = trials(results)
    assert profile["cause"] == "script"
    assert (
        "changed the batch sizes dsat gave the trial (train_micro_batch_size_per_gpu 8, not 1)"
        in (profile["error"])
    )
    assert "no configuration can pass until the training script is fixed" in run.stderr


def test_a_script_whose_own_batch_sizes_deepspeed_takes_is_blamed_not_handed_over(
    tmp_path: Path,
) -> None:
    """Every trial ran the script's micro-batch, and the search handed over one no trial ran."""
    run, results = binary_search(tmp_path, 3, DSAT_TEST_BEHAVIOUR="own_batch:3")
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    searched = [row for row in trials(results) if row["kind"] == "search"]
    assert searched and all(row["cause"] == "script" for row in searched), searched
    assert "train_micro_batch_size_per_gpu 3, not " in searched[0]["error"]
    assert "so it measured another configuration than the trial's" in searched[0]["error"]
    assert not (results / "best_ds_config.json").exists()


def test_crashing_trial_is_an_error_not_a_crash_of_the_search(tmp_path: Path) -> None:
    # In fresh processes, so that path runs real DeepSpeed too.
    run, results = binary_search(tmp_path, 3, "--fresh-processes", DSAT_TEST_BEHAVIOUR="crash")
    assert run.returncode == 1  # no search trial worked: a failed search, reported as such
    assert "dsat: search failed" in run.stderr and "Traceback" not in run.stderr
    rows = trials(results)
    assert [row["status"] for row in rows] == ["completed", "error", "error"]
    assert "ValueError: this trial crashes on purpose" in rows[1]["error"]
    # Each failed trial's line says why and where its log is; the error may be the config's.
    assert rows[1]["cause"] == "unknown" and rows[1]["log"].startswith(str(results / "logs"))
    assert (
        f"trial {rows[1]['trial']} {rows[1]['name']}: error: ValueError: this trial crashes on "
        "purpose (exit code "
        f"1) (log: {rows[1]['log']})" in run.stdout
    )
    assert not any(WARM_MARK in log.read_text() for log in (results / "logs").glob("*.log"))


def trial_processes(tmp_path: Path) -> list[psutil.Process]:
    """Live processes working in this test's directories (other tests may run trials too)."""
    found = []
    for process in psutil.process_iter(["cwd", "status"]):
        cwd = process.info["cwd"] or ""
        if cwd.startswith(str(tmp_path)) and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def _descendants_alive(pids: list[int]) -> list[int]:
    return [
        pid
        for pid in pids
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]


def test_hanging_trial_is_stopped_by_the_timeout(tmp_path: Path) -> None:
    run, results = binary_search(tmp_path, 2, "--trial-timeout", "20", DSAT_TEST_BEHAVIOUR="hang")
    rows = trials(results)
    assert [row["status"] for row in rows] == ["completed", "timeout"]
    assert "trial timeout of 20 s" in rows[1]["error"]
    assert run.returncode == 1
    assert trial_processes(tmp_path) == []


def stopped_output(process: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """The output of a dsat asked to stop; if it has not ended within ``timeout``, the test
    fails with where each of its threads was (dsat prints that on SIGUSR1) and what still ran."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = [_described(p) for p in _tree(process.pid)]
        masks = _signal_masks(process.pid)
        process.send_signal(signal.SIGUSR1)
        time.sleep(2)
        process.kill()
        out, err = process.communicate()
        pytest.fail(
            f"dsat did not stop within {timeout} s; processes:\n"
            + "\n".join(tree)
            + f"\nits threads' signal masks (/proc):\n{masks}"
            + f"\nstdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"
        )


def _signal_masks(pid: int) -> str:
    """Each thread's pending, blocked, ignored and caught signals, as the kernel has them: a
    Ctrl-C that dsat once did not act on (once in many runs) left no other trace."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            status = (task / "status").read_text().splitlines()
        except OSError:
            continue
        fields = [line for line in status if line.startswith(("Name", "Sig", "ShdPnd"))]
        lines.append(f"{task.name}: " + "  ".join(" ".join(f.split()) for f in fields))
    return "\n".join(lines) or "(gone)"


def _described(process: psutil.Process) -> str:
    try:
        return f"{process.pid} {process.status()} {' '.join(process.cmdline())[:200]}"
    except psutil.Error:
        return f"{process.pid} (gone)"


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_sigint_stops_every_trial_and_resume_finishes(tmp_path: Path) -> None:
    path, directory = model_dir(tmp_path)
    results = tmp_path / "results"
    args = [
        "binary",
        str(path),
        str(directory),
        "-z",
        "1",
        "--max-trials",
        "4",
        "--max-slots",
        "2",
        "--search-range-factor",
        "0.005",
        "--no-baseline",
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "dsat", *args, "--results-dir", str(results)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(DSAT_TEST_BEHAVIOUR="hang"),
    )
    deadline = time.monotonic() + 240
    children: list[int] = []
    while time.monotonic() < deadline:  # wait until search trials (which hang) are running
        if (results / "trials.jsonl").is_file():
            children = [c.pid for c in psutil.Process(process.pid).children(recursive=True)]
            if children:
                break
        time.sleep(0.5)
    assert children, "no trial started"
    time.sleep(2)
    process.send_signal(signal.SIGINT)
    out, err = stopped_output(process, timeout=60)
    assert process.returncode == 130, out[-2000:] + err[-2000:]
    assert f"--resume {results}" in err
    time.sleep(1)
    assert _descendants_alive(children) == []
    assert trial_processes(tmp_path) == []
    resumed = dsat(*args, "--resume", str(results))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    rows = trials(results)
    assert len(rows) == 4 and all(row["status"] == "completed" for row in rows)
    assert len({row["request_id"] for row in rows}) == 4
    # The resumed run's trials come after the first run's on the search's clock.
    ends = [row["end"] for row in trials(results) + trials(results, confirmations=True)]
    assert ends == sorted(ends) and rows[1]["start"] >= rows[0]["end"]
    # The runs the Ctrl-C cut short held their slots: the rows of the trials that ran again
    # keep them, with their logs, and the cost counts them.
    cut_short = [run for row in rows for run in row.get("interrupted", [])]
    assert cut_short and max(run["end"] - run["start"] for run in cut_short) >= 2
    assert all(Path(run["log"]).is_file() for run in cut_short)
    # Once it has ended, a plain resume writes the report again and opens no runner: it neither
    # claims this machine's slots (waiting for another search's) nor builds DeepSpeed's ops.
    again = dsat(*args, "--resume", str(results))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "slot(s) on this machine" not in again.stdout and "report:" in again.stdout
    assert trials(results) == rows
