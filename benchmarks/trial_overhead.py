"""What the local runner costs: one trial through it vs the same script run bare, and `make demo`.

Both sides run the CPU example with the same search-trial hyperparameters (a ZeRO-1 trial with
DeepSpeed's autotuning block, as the search makes them), the same thread count and environment;
the runner side adds what dsat does per trial (copy the model dir, write the hyperparameters,
start a process group, classify the outcome). They alternate, so machine noise hits both alike.
Then `make demo` runs end to end. Prints a table; writes benchmarks/results/trial_overhead.json.

    python3 benchmarks/trial_overhead.py [--repeats 7] [--mbs 64] [--skip-demo]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dsat.atomic_file import write_json_atomic
from dsat.config import load_experiment
from dsat.constants import ENV_HPARAMS_FILE
from dsat.runners.local import HPARAMS_FILE, LocalExecutor, SlotPool
from dsat.runners.trial_timeout import TrialTimeout
from dsat.search import make_search_method
from dsat.search.base import SearchSpec
from dsat.search.trial import TrialKind, TrialStatus
from dsat.settings import SearchSettings

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "core_api_mlp"
RESULTS = Path(__file__).resolve().parent / "results" / "trial_overhead.json"


def search_trial(mbs: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The hyperparameters and merged config of one ZeRO-1 search trial, made by dsat's search."""
    config_path = str(EXAMPLE / "deepspeed.yaml")
    experiment = load_experiment(config_path, str(EXAMPLE), ())
    settings = SearchSettings(method="binary", config_path=config_path, model_dir=str(EXAMPLE))
    spec = SearchSpec(experiment.hparams, experiment.ds_config, experiment.slots_per_trial)
    record = make_search_method(settings, spec).make_trial(TrialKind.SEARCH, {"stage": 1}, mbs)
    return record.hparams, record.ds_config


def trial_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DET_MASTER", "CUDA_VISIBLE_DEVICES")}
    env.update({"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)})
    return env


def through_runner(work: Path, hparams: dict[str, Any], ds_config: dict[str, Any]) -> float:
    results = work / "runner"
    shutil.rmtree(results, ignore_errors=True)
    pool = SlotPool.for_machine(1, 1, trial_environment())
    executor = LocalExecutor(
        ["python3", "train.py"],
        EXAMPLE,
        (),
        results,
        pool,
        1,
        TrialTimeout(3600.0),
        trial_environment(),
    )
    start = time.perf_counter()
    executor.start("00000000-0000-0000-0000-000000000001", hparams, ds_config, 20)
    outcome = executor.wait()
    elapsed = time.perf_counter() - start
    if outcome.status is not TrialStatus.COMPLETED:
        raise SystemExit(f"the runner's trial did not complete: {outcome.error}")
    return elapsed


def bare(work: Path, hparams: dict[str, Any]) -> float:
    """The user's script by hand: same directory contents, same variables, same threads."""
    directory = work / "bare"
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(EXAMPLE, directory)
    write_json_atomic(directory / HPARAMS_FILE, hparams)
    env = trial_environment()
    env.update(
        {
            ENV_HPARAMS_FILE: str(directory / HPARAMS_FILE),
            # The runner gives a lone CPU trial every core; so does this.
            "OMP_NUM_THREADS": str(os.cpu_count() or 1),
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29533",
        }
    )
    # Output to a file, as the runner does (through a pipe the same trial runs ~0.7 s slower).
    log_path = work / "bare.log"
    start = time.perf_counter()
    with log_path.open("wb") as log:
        run = subprocess.run(
            [sys.executable, "train.py"],
            cwd=directory,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    elapsed = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"the bare trial failed:\n{log_path.read_text()[-2000:]}")
    return elapsed


def demo(work: Path) -> dict[str, Any]:
    results = work / "demo"
    start = time.perf_counter()
    run = subprocess.run(
        ["make", "-s", "demo", f"DEMO_ARGS=--results-dir {results}"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    elapsed = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"make demo failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    trials = (results / "trials.jsonl").read_text().splitlines()
    return {"seconds": elapsed, "trials": len(trials)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--mbs", type=int, default=64)
    parser.add_argument("--skip-demo", action="store_true")
    args = parser.parse_args()

    hparams, ds_config = search_trial(args.mbs)
    runner_times: list[float] = []
    bare_times: list[float] = []
    with tempfile.TemporaryDirectory(prefix="dsat-overhead-") as tmp:
        work = Path(tmp)
        bare(work, hparams)  # warm-up: DeepSpeed's JIT builds and the page cache, for both
        for _ in range(args.repeats):
            runner_times.append(through_runner(work, hparams, ds_config))
            bare_times.append(bare(work, hparams))
        demo_result = None if args.skip_demo else demo(work)

    runner_median = statistics.median(runner_times)
    bare_median = statistics.median(bare_times)
    ratio = runner_median / bare_median
    print(f"one ZeRO-1 trial at micro-batch {args.mbs}, median of {args.repeats} (alternating):")
    print("| path | median s | min s | all runs s |")
    print("| --- | ---: | ---: | --- |")
    for name, times in (("dsat local runner", runner_times), ("bare script", bare_times)):
        runs = ", ".join(f"{t:.2f}" for t in times)
        print(f"| {name} | {statistics.median(times):.2f} | {min(times):.2f} | {runs} |")
    print(f"runner / bare = {ratio:.3f} (overhead {100 * (ratio - 1):+.1f}%; target under +10%)")
    if demo_result is not None:
        print(
            f"make demo: {demo_result['seconds']:.1f} s end to end, {demo_result['trials']} trials "
            "(target: under 5 minutes)"
        )
    report = {
        "machine_cpus": os.cpu_count(),
        "mbs": args.mbs,
        "runner_seconds": runner_times,
        "bare_seconds": bare_times,
        "runner_median": runner_median,
        "bare_median": bare_median,
        "ratio": ratio,
        "demo": demo_result,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(RESULTS, report)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
