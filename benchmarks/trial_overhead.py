"""What a trial costs: warm, hosted and fresh trials through the local runner, a bare run, and
`make demo`.

A search's trials, as the local runner starts them: one local runner forking trials from its warm
worker, one running them in a trial host (``--trial-host``), one starting every trial in a fresh
interpreter (``--fresh-processes``), all running the
CPU example with the same search-trial hyperparameters (a ZeRO-1 trial with DeepSpeed's autotuning
block, as the search makes them), one trial each in turn (the order swapped every round) so
machine noise hits both alike. Each
trial's wall time (start to outcome, copying the model dir included) and its measured throughput
are recorded; the warm side's first trials include starting the worker and learning its imports.
A bare run of the script by hand is the runner-overhead baseline. Then `make demo` end to end,
warm and with --fresh-processes, alternating. Prints tables; writes
benchmarks/results/trial_overhead.json.

    python3 benchmarks/trial_overhead.py [--repeats 9] [--mbs 64] [--demo-repeats 2] [--output F]
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
from dsat.constants import AUTOTUNING_KEY, ENV_HPARAMS_FILE
from dsat.experiment.config import load_experiment
from dsat.runners.local.entrypoint import interpreter_first
from dsat.runners.local.runner import COPY_IGNORE, HPARAMS_FILE, LocalRunner
from dsat.runners.local.slots import SlotPool
from dsat.runners.local.trial_timeout import TrialTimeout
from dsat.search import MethodSettings, make_search_method
from dsat.search.trial_builder import SearchSpec
from dsat.trial import TrialKind, TrialStatus

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "core_api_mlp"
RESULTS = Path(__file__).resolve().parent / "results" / "trial_overhead.json"


def search_trial(mbs: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The hyperparameters and merged config of one ZeRO-1 search trial, made by dsat's search."""
    config_path = str(EXAMPLE / "deepspeed.yaml")
    experiment = load_experiment(config_path, str(EXAMPLE), ())
    settings = MethodSettings(method="binary")
    spec = SearchSpec(experiment.hparams, experiment.ds_config, experiment.slots_per_trial)
    record = make_search_method(settings, spec).make_trial(TrialKind.SEARCH, {"stage": 1}, mbs)
    return record.hparams, record.ds_config


def trial_environment() -> dict[str, str]:
    """The environment of a user whose venv is active: its ``ninja`` first on PATH, as in the
    runner's trials (entrypoint.interpreter_first). With the system's ``ninja`` instead, the bare
    script rebuilt DeepSpeed's CPU op (30-40 s) each time it ran after a runner's trial."""
    env = {k: v for k, v in os.environ.items() if k not in ("DET_MASTER", "CUDA_VISIBLE_DEVICES")}
    env.update({"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)})
    return interpreter_first(env)


def local_runner(work: Path, name: str, warm: bool, host: bool = False) -> LocalRunner:
    results = work / name
    shutil.rmtree(results, ignore_errors=True)
    pool = SlotPool.for_machine(1, 1, trial_environment())
    return LocalRunner(
        ["python3", "train.py"],
        EXAMPLE,
        (),
        results,
        pool,
        1,
        TrialTimeout(3600.0),
        trial_environment(),
        warm=warm,
        trial_host=host,
    )


def through_runner(
    runner: LocalRunner, n: int, hparams: dict[str, Any], ds_config: dict[str, Any]
) -> tuple[float, float]:
    """One trial's wall time and measured throughput."""
    start = time.perf_counter()
    runner.start(f"{n:08d}-0000-0000-0000-000000000000", hparams, ds_config, 20)
    outcome = runner.wait()
    elapsed = time.perf_counter() - start
    if outcome.status is not TrialStatus.COMPLETED:
        raise SystemExit(f"the runner's trial did not complete: {outcome.error}")
    return elapsed, float(outcome.metrics["throughput"])


def bare(work: Path, hparams: dict[str, Any]) -> float:
    """The user's script by hand: same directory contents, same variables, same threads."""
    directory = work / "bare"
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(EXAMPLE, directory, ignore=COPY_IGNORE)  # not a dsat-results/ left there
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


def demo(work: Path, name: str, *flags: str) -> dict[str, Any]:
    results = work / name
    start = time.perf_counter()
    run = subprocess.run(
        ["make", "-s", "demo", f"DEMO_ARGS=--results-dir {results} {' '.join(flags)}"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    elapsed = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"make demo failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    trials = (results / "trials.jsonl").read_text().splitlines()
    return {"seconds": elapsed, "trials": len(trials)}


def table(rows: dict[str, list[float]], unit: str, digits: int) -> None:
    print(f"| path | median {unit} | min {unit} | all runs {unit} |")
    print("| --- | ---: | ---: | --- |")
    for name, values in rows.items():
        runs = ", ".join(f"{v:.{digits}f}" for v in values)
        print(
            f"| {name} | {statistics.median(values):.{digits}f} | {min(values):.{digits}f} | {runs} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--mbs", type=int, default=64)
    parser.add_argument("--demo-repeats", type=int, default=2, help="0 skips make demo")
    parser.add_argument(
        "--window-steps",
        type=int,
        default=0,
        help="measure over this many steps instead of a search trial's window (0: the search's)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args()

    hparams, ds_config = search_trial(args.mbs)
    if args.window_steps:  # a longer window than a search trial's, to see past the noise
        hparams["steps"] = args.window_steps + 10
        hparams["overwrite_deepspeed_args"][AUTOTUNING_KEY]["end_profile_step"] = args.window_steps
    times: dict[str, list[float]] = {"warm": [], "host": [], "fresh": [], "bare": []}
    throughput: dict[str, list[float]] = {"warm": [], "host": [], "fresh": []}
    demos: dict[str, list[dict[str, Any]]] = {"warm": [], "fresh": []}
    with tempfile.TemporaryDirectory(prefix="dsat-overhead-") as tmp:
        work = Path(tmp)
        bare(work, hparams)  # warm-up: the page cache, for all
        runners = {
            "warm": local_runner(work, "warm", True),
            "host": local_runner(work, "host", True, host=True),
            "fresh": local_runner(work, "fresh", False),
        }
        try:
            for n in range(args.repeats):
                order = list(runners.items())
                for name, runner in order if n % 2 == 0 else order[::-1]:
                    seconds, samples = through_runner(runner, n, hparams, ds_config)
                    times[name].append(seconds)
                    throughput[name].append(samples)
        finally:
            for runner in runners.values():
                runner.close()
        times["bare"] = [bare(work, hparams) for _ in range(args.repeats)]
        for n in range(args.demo_repeats):
            demos["warm"].append(demo(work, f"demo-warm-{n}"))
            demos["fresh"].append(demo(work, f"demo-fresh-{n}", "--fresh-processes"))

    median = {name: statistics.median(values) for name, values in times.items()}
    trial_ratio = median["warm"] / median["fresh"]
    speed_ratio = statistics.median(throughput["warm"]) / statistics.median(throughput["fresh"])
    print(f"one ZeRO-1 search trial at micro-batch {args.mbs}, {args.repeats} of each, in turn:")
    table(
        {
            "dsat, warm worker (--no-trial-host)": times["warm"],
            "dsat, trial host (the default)": times["host"],
            "dsat, --fresh-processes": times["fresh"],
            "bare script": times["bare"],
        },
        "s",
        2,
    )
    print(f"warm / fresh trial wall time = {trial_ratio:.3f} (target: at most 0.5)")
    print(f"fresh runner / bare = {median['fresh'] / median['bare']:.3f} (runner overhead)")
    host_ratio = median["host"] / median["warm"]
    host_speed = statistics.median(throughput["host"]) / statistics.median(throughput["fresh"])
    print(f"trial host / warm worker trial wall time = {host_ratio:.3f}")
    table(
        {
            "warm worker": throughput["warm"],
            "trial host": throughput["host"],
            "fresh process": throughput["fresh"],
        },
        "samples/s",
        0,
    )
    print(f"throughput warm / fresh = {speed_ratio:.3f} (target: within 3%)")
    print(f"throughput host / fresh = {host_speed:.3f} (target: within 2%)")
    report: dict[str, Any] = {
        "machine_cpus": os.cpu_count(),
        "mbs": args.mbs,
        "seconds": times,
        "median_seconds": median,
        "warm_over_fresh_seconds": trial_ratio,
        "throughput": throughput,
        "warm_over_fresh_throughput": speed_ratio,
        "host_over_warm_seconds": host_ratio,
        "host_over_fresh_throughput": host_speed,
        "demo": demos,
    }
    if demos["warm"]:
        demo_median = {k: statistics.median(d["seconds"] for d in v) for k, v in demos.items()}
        report["demo_fresh_over_warm"] = demo_median["fresh"] / demo_median["warm"]
        for name, runs in demos.items():
            listed = ", ".join(f"{d['seconds']:.1f} s ({d['trials']} trials)" for d in runs)
            print(f"make demo, {name}: {listed}")
        print(
            f"make demo fresh / warm = {report['demo_fresh_over_warm']:.2f} (target: at least 1.7)"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.output, report)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
