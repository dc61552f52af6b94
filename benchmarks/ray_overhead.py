"""What a trial costs on the Ray runner, against the local runner starting fresh processes.

Both run the CPU example with the same search-trial hyperparameters (a ZeRO-1 trial with
DeepSpeed's autotuning block, as the search makes them), one trial each in turn (the order swapped
every round), on this one machine: the local runner with ``--fresh-processes`` on one slot, and
the Ray runner on a Ray instance started here with one (fake) GPU, so that each trial has the
machine's cores as the local one does. A trial's wall time runs from ``start`` to its outcome:
for Ray that includes its placement group, its actor, unpacking the model dir and sending its
log back. Prints a table; writes benchmarks/results/ray_overhead.json.

    python3 benchmarks/ray_overhead.py [--repeats 7] [--mbs 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from trial_overhead import (  # benchmarks/, next to this script
    EXAMPLE,
    local_runner,
    search_trial,
    table,
    through_runner,
)

from dsat.atomic_file import write_json_atomic
from dsat.runners.local.trial_timeout import TrialTimeout
from dsat.runners.ray.setup import open_runner

RESULTS = Path(__file__).resolve().parent / "results" / "ray_overhead.json"
TARGET = 1.3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--mbs", type=int, default=64)
    args = parser.parse_args()

    import ray

    hparams, ds_config = search_trial(args.mbs)
    times: dict[str, list[float]] = {"ray": [], "fresh": []}
    throughput: dict[str, list[float]] = {"ray": [], "fresh": []}
    started = time.perf_counter()
    ray.init(
        num_cpus=os.cpu_count() or 1,
        num_gpus=1,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    ray_start = time.perf_counter() - started
    with tempfile.TemporaryDirectory(prefix="dsat-ray-overhead-") as tmp:
        work = Path(tmp)
        runners: dict[str, Any] = {
            "fresh": local_runner(work, "fresh", False),
            "ray": open_runner(
                ray,
                ["python3", "train.py"],
                EXAMPLE,
                (),
                work / "ray",
                1,
                TrialTimeout(3600.0),
                {"DS_ACCELERATOR": "cpu"},
                "a Ray instance started on this machine",
            ),
        }
        try:
            # A first trial each, not counted: DeepSpeed's JIT op load and the page cache.
            for runner in runners.values():
                through_runner(runner, 99, hparams, ds_config)
            for n in range(args.repeats):
                order = list(runners.items())
                for name, runner in order if n % 2 == 0 else order[::-1]:
                    seconds, samples = through_runner(runner, n, hparams, ds_config)
                    times[name].append(seconds)
                    throughput[name].append(samples)
        finally:
            for runner in runners.values():
                runner.close()
            ray.shutdown()

    median = {name: statistics.median(values) for name, values in times.items()}
    ratio = median["ray"] / median["fresh"]
    print(f"one ZeRO-1 search trial at micro-batch {args.mbs}, {args.repeats} of each, in turn:")
    table({"ray runner": times["ray"], "local runner, --fresh-processes": times["fresh"]}, "s", 2)
    print(f"ray / local fresh trial wall time = {ratio:.3f} (target: at most {TARGET})")
    speed = statistics.median(throughput["ray"]) / statistics.median(throughput["fresh"])
    print(f"throughput ray / local fresh = {speed:.3f}")
    print(f"starting Ray here took {ray_start:.1f} s (once per search)")
    report: dict[str, Any] = {
        "machine_cpus": os.cpu_count(),
        "mbs": args.mbs,
        "seconds": times,
        "median_seconds": median,
        "ray_over_fresh_seconds": ratio,
        "throughput": throughput,
        "ray_over_fresh_throughput": speed,
        "ray_start_seconds": ray_start,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(RESULTS, report)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
