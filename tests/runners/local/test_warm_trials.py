"""Which trials run warm, and how the local runner falls back to fresh processes."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

from dsat.runners.local.runner import LocalRunner
from dsat.runners.local.slots import SlotPool
from dsat.runners.local.trial_processes import leftover_trials
from dsat.runners.local.trial_timeout import TrialTimeout
from dsat.runners.local.warm_trials import warm_command
from dsat.trial import TrialStatus
from tests.runners.local.test_runner import local_runner as plain_local_runner

COMPLETES = (
    "import json, os\njson.dump({'status': 'completed', 'values': {'pid': os.getpid(), "
    "'parent': os.getppid()}}, open('dsat_trial_outcome.json', 'w'))\n"
)


@pytest.mark.parametrize(
    ("command", "warm"),
    [
        (["python3", "train.py", "--lr", "1"], True),
        ([sys.executable, "-m", "package.train"], True),
        (["python3", "-u", "train.py"], False),  # interpreter options: run as written
        (["bash", "run.sh"], False),
        (["python3", "-m"], False),
        (["python3", "launcher"], False),  # not a .py file: maybe a zip or a directory
    ],
)
def test_which_commands_run_warm(command: list[str], warm: bool) -> None:
    assert warm_command(command) is warm


def local_runner(tmp_path: Path, script: str, site_module: str | None = None) -> LocalRunner:
    """test_runner's local runner, with a site dir on PYTHONPATH holding ``site_module``."""
    site = tmp_path / "site"
    site.mkdir()
    if site_module is not None:
        (site / "site_module.py").write_text(site_module)
    path = os.pathsep.join([str(site), *sys.path[1:]])
    return plain_local_runner(tmp_path, script, environ_extra={"PYTHONPATH": path})


def run(ex: LocalRunner, n: int) -> dict[str, int]:
    ex.start(f"{n:08d}-0000-0000-0000-000000000000", {}, {}, 5)
    outcome = ex.wait()
    assert outcome.status is TrialStatus.COMPLETED, outcome.error
    return {key: int(value) for key, value in outcome.metrics.items()}


def test_trials_fork_from_one_worker_which_a_resumed_search_would_find(tmp_path: Path) -> None:
    ex = local_runner(tmp_path, COMPLETES)
    try:
        first, second = run(ex, 1), run(ex, 2)
        assert ex.warm_workers is not None
        worker = ex.warm_workers.workers["cpu0"].process.pid
        assert first["parent"] == second["parent"] == worker and first["pid"] != second["pid"]
        # It carries the results directory in its environment, as trials do.
        assert worker in [p.pid for p in leftover_trials(tmp_path / "results")]
    finally:
        ex.close()


DRAWS = (
    "import json, random, numpy, torch\njson.dump({'status': 'completed', 'values': {"
    "'python': random.random(), 'numpy': float(numpy.random.rand()), 'torch': "
    "float(torch.rand(1))}}, open('dsat_trial_outcome.json', 'w'))\n"
)


def test_each_forked_trial_draws_its_own_random_numbers(tmp_path: Path) -> None:
    """As a new interpreter: torch's generator was the worker's in every fork, the same draws."""
    ex = local_runner(tmp_path, DRAWS)
    try:
        outcomes = []
        for n in range(3):
            ex.start(f"{n:08d}-0000-0000-0000-000000000000", {}, {}, 5)
            outcomes.append(ex.wait())
    finally:
        ex.close()
    assert all(o.status is TrialStatus.COMPLETED for o in outcomes), outcomes
    for generator in ("python", "numpy", "torch"):
        assert len({o.metrics[generator] for o in outcomes}) == 3, generator


def test_a_stopped_worker_leaves_no_pipe_open(tmp_path: Path) -> None:
    """Under PYTHONWARNINGS=error dsat's console showed "Exception ignored ... ResourceWarning:
    unclosed file <_io.BufferedReader name=11>": a stopped worker's event pipe was never
    closed."""
    ex = local_runner(tmp_path, COMPLETES)
    try:
        run(ex, 1)
        assert ex.warm_workers is not None
        worker = ex.warm_workers.workers["cpu0"]
        ex.warm_workers.stop("cpu0")
        assert worker.process.stdout is not None and worker.process.stdout.closed
    finally:
        ex.close()


def test_a_worker_lost_between_trials_is_started_again(tmp_path: Path) -> None:
    ex = local_runner(tmp_path, COMPLETES)
    try:
        first = run(ex, 1)
        assert ex.warm_workers is not None
        worker = ex.warm_workers.workers["cpu0"].process
        worker.kill()
        worker.wait()
        second = run(ex, 2)
        assert second["parent"] not in (first["parent"], os.getpid())
    finally:
        ex.close()


def test_a_cold_slot_runs_its_trials_fresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dsat")
    starts_a_thread = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    ex = local_runner(tmp_path, "import site_module\n" + COMPLETES, site_module=starts_a_thread)
    try:
        first, second = run(ex, 1), run(ex, 2)
        assert ex.warm_workers is not None and "started threads" in ex.warm_workers.cold["cpu0"]
        assert "slot cpu0: trials start in fresh processes from now on" in caplog.text
        assert first["parent"] != second["parent"]  # each under a trial guard of its own
        logs = sorted((tmp_path / "results" / "logs").glob("0*.log"))
        assert [log.read_text().startswith(f"$ {sys.executable} job.py\n") for log in logs] == [
            True,
            True,
        ]
    finally:
        ex.close()


def test_fresh_processes_start_no_worker(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    environ = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": ""}
    pool = SlotPool.for_machine(1, 1, environ)
    args = (["python3", "job.py"], model, (), tmp_path / "r", pool, 1, TrialTimeout(60.0), environ)
    assert LocalRunner(*args, warm=False).warm_workers is None
    assert LocalRunner(*args).warm_workers is not None
    two_slots = SlotPool.for_machine(2, 2, environ)
    multi = LocalRunner(
        ["python3", "job.py"], model, (), tmp_path / "r", two_slots, 2, TrialTimeout(60.0), environ
    )
    assert multi.warm_workers is None  # torchrun starts multi-process trials
