"""The runner contract (``dsat.runners.trial_runner``): every runner that runs trials for a search
here passes the same tests. The local runner runs real processes; the Ray runner real processes on
a real local multi-node Ray cluster (tests/runners/conftest.py); the simulated one a function.

A trial's micro-batch says how it behaves, so both runners are told the same thing: 1 completes
with throughput 10, 2 runs out of memory, 3 crashes, 4 runs until it is stopped.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from dsat.constants import LINGERED_KEY, OVERWRITE_KEY
from dsat.errors import DsatError
from dsat.runners.local.runner import HOST_TRIAL_MARK, HPARAMS_FILE, WARM_TRIAL_MARK, LocalRunner
from dsat.runners.local.slots import SlotPool
from dsat.runners.local.trial_timeout import TrialTimeout
from dsat.runners.ray.runner import RayRunner
from dsat.runners.ray.setup import open_runner
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.runners.trial_runner import TrialRunner
from dsat.trial import TrialStatus

COMPLETES, RUNS_OUT_OF_MEMORY, CRASHES, RUNS_UNTIL_STOPPED = 1, 2, 3, 4
LEAVES_CHILDREN, LINGERS = 5, 6  # both complete
LEAVES_CHILDREN_UNTIL_STOPPED = 7
BLOCKS_AFTER_IT_REPORTED = 8  # completes

BEHAVIOUR_SCRIPT = """
import json, os, signal, subprocess, sys, threading, time
hparams = json.load(open(os.environ["DSAT_HPARAMS_FILE"]))
mbs = hparams["overwrite_deepspeed_args"]["train_micro_batch_size_per_gpu"]
open("ran", "w").write(str(mbs))
print(f"ran at micro-batch {mbs}", flush=True)
if mbs in (1, 5, 6, 8):
    json.dump({"status": "completed", "values": {"throughput": 10.0}},
              open("dsat_trial_outcome.json", "w"))
if mbs in (5, 7):  # one child in the trial's process group, one in a session of its own
    for session in (False, True):
        child = subprocess.Popen(["sleep", "300"], start_new_session=session)
        print(f"left pid {child.pid}", flush=True)
    if mbs == 7:
        time.sleep(120)
elif mbs == 6:  # a thread that is no daemon keeps the process from exiting
    threading.Thread(target=time.sleep, args=(300,)).start()
elif mbs == 8:  # its main thread blocks (an upload that hangs), deaf to SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(300)
elif mbs == 2:
    json.dump({"status": "oom"}, open("dsat_trial_outcome.json", "w"))
    sys.exit(1)
elif mbs == 3:
    sys.exit(3)
elif mbs == 4:
    time.sleep(120)
"""


def simulated_performance(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
    mbs = ds_config["train_micro_batch_size_per_gpu"]
    if mbs == RUNS_OUT_OF_MEMORY:
        raise MemoryError("needs more than the device has")
    if mbs == CRASHES:
        raise RuntimeError("the script crashed")
    seconds = 1e6 if mbs == RUNS_UNTIL_STOPPED else 5.0
    return {"throughput": 10.0, "seconds": seconds}


def make_local(tmp_path: Path, warm: bool = True, trial_host: bool = False) -> LocalRunner:
    model = tmp_path / "model"
    model.mkdir()
    (model / "job.py").write_text(BEHAVIOUR_SCRIPT)
    environ = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": ""}
    pool = SlotPool(["cpu0", "cpu1"], on_gpu=False)
    return LocalRunner(
        ["python3", "job.py"],
        model,
        (),
        tmp_path / "results",
        pool,
        1,
        TrialTimeout(60),
        environ,
        warm=warm,
        trial_host=trial_host,
    )


def make_simulated(tmp_path: Path) -> SimulatedRunner:
    return SimulatedRunner(simulated_performance, slots_per_trial=1)


def make_ray(tmp_path: Path) -> RayRunner:
    import ray

    model = tmp_path / "model"
    model.mkdir()
    (model / "job.py").write_text(BEHAVIOUR_SCRIPT)
    return open_runner(
        ray,
        ["python3", "job.py"],
        model,
        (),
        tmp_path / "results",
        1,
        TrialTimeout(60),
        {"DS_ACCELERATOR": "cpu"},
        "the tests' cluster",
    )


RUNNERS: dict[str, Callable[[Path], TrialRunner]] = {
    "local": make_local,
    "local-fresh": lambda tmp_path: make_local(tmp_path, warm=False),
    "ray": make_ray,
    "simulated": make_simulated,
}


@pytest.fixture(params=sorted(set(RUNNERS) - {"local-fresh"}))
def runner(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TrialRunner]:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    made = RUNNERS[request.param](tmp_path)
    try:
        yield made
    finally:
        made.stop_all()
        made.close()


def start(runner: TrialRunner, number: int, mbs: int) -> str:
    """Start a trial as the driver would: the overrides in its hyperparameters, merged config."""
    request_id = f"00000000-0000-0000-0000-{number:012d}"
    ds_config = {"train_micro_batch_size_per_gpu": mbs}
    runner.start(request_id, {OVERWRITE_KEY: ds_config}, ds_config, 6)
    return request_id


def test_every_outcome_comes_back_once_with_its_kind(runner: TrialRunner) -> None:
    started = {
        start(runner, 1, COMPLETES): TrialStatus.COMPLETED,
        start(runner, 2, RUNS_OUT_OF_MEMORY): TrialStatus.OOM,
    }
    assert runner.running_count() == 2
    outcomes = [runner.wait(), runner.wait()]
    assert runner.running_count() == 0
    started[start(runner, 3, CRASHES)] = TrialStatus.ERROR
    outcomes.append(runner.wait())
    assert {o.request_id: o.status for o in outcomes} == started
    for outcome in outcomes:
        assert outcome.start <= outcome.end
        if outcome.status is TrialStatus.COMPLETED:
            assert outcome.metrics["throughput"] == 10.0 and outcome.error is None
        else:
            assert outcome.metrics == {} and outcome.error


def test_stop_all_stops_every_trial_and_the_runner_goes_on(runner: TrialRunner) -> None:
    started = {start(runner, 1, RUNS_UNTIL_STOPPED), start(runner, 2, RUNS_UNTIL_STOPPED)}
    assert runner.running_count() == 2
    stopped = runner.stop_all()
    assert runner.running_count() == 0
    # What it stopped, for a resume's cost: each run's time, and its log (Ray's may still have
    # been waiting for room, which held no slot).
    assert {run.request_id for run in stopped} <= started
    assert len(stopped) == 2 or isinstance(runner, RayRunner)
    assert all(run.end >= run.start for run in stopped)
    if isinstance(runner, (LocalRunner, RayRunner)):
        assert all(run.log is not None and Path(run.log).is_file() for run in stopped)
    request_id = start(runner, 3, COMPLETES)  # the stopped trials gave their slots back
    outcome = runner.wait()
    assert (outcome.request_id, outcome.status) == (request_id, TrialStatus.COMPLETED)


def test_close_between_trials_loses_nothing(runner: TrialRunner) -> None:
    start(runner, 1, COMPLETES)
    runner.wait()
    runner.close()
    start(runner, 2, COMPLETES)
    assert runner.wait().status is TrialStatus.COMPLETED


def test_limits_are_what_the_search_may_rely_on(runner: TrialRunner) -> None:
    assert runner.slot_limit is None or runner.slot_limit >= 1
    assert isinstance(runner.takes_real_time, bool)


def test_the_full_run_trains_or_is_refused_in_one_line(runner: TrialRunner) -> None:
    hparams = {OVERWRITE_KEY: {"train_micro_batch_size_per_gpu": COMPLETES}}
    if isinstance(runner, SimulatedRunner):
        with pytest.raises(DsatError, match="--run-full-experiment"):
            runner.run_full_experiment(hparams)
        return
    assert isinstance(runner, (LocalRunner, RayRunner))
    runner.run_full_experiment(hparams)
    log = (runner.results_dir / "logs" / "full-experiment.log").read_text()
    assert "ran at micro-batch 1" in log
    directory = runner.results_dir / "full-experiment"  # Ray's comes back from its node
    assert (directory / "ran").read_text() == "1"
    assert json.loads((directory / HPARAMS_FILE).read_text()) == hparams
    assert runner.slot_limit == 2  # the slots came back
    assert runner.running_count() == 0


@pytest.mark.parametrize("runner", ["local-fresh", "ray"], indirect=True)  # simulated: no process
def test_a_trial_that_reported_and_ran_on_to_its_timeout_says_so_in_its_log(
    runner: TrialRunner,
) -> None:
    """Its row said completed and its log ended mid-run: nothing said dsat had stopped it. (A
    trial forked from a warm worker leaves at its end, threads or not.)"""
    assert isinstance(runner, (LocalRunner, RayRunner))
    runner.linger_s, runner.timeout = 600.0, TrialTimeout(8)
    start(runner, 1, LINGERS)
    outcome = runner.wait()
    assert outcome.status is TrialStatus.COMPLETED and outcome.metrics["throughput"] == 10.0
    said = Path(outcome.log or "").read_text()
    assert "ran on to the trial timeout of 8 s" in said and "its result kept" in said


@pytest.mark.parametrize("runner", ["local", "ray"], indirect=True)  # simulated: no full run
def test_what_the_full_run_leaves_running_is_stopped_and_named(
    runner: TrialRunner, capsys: pytest.CaptureFixture[str]
) -> None:
    """A daemon in a session of its own outlived the full run's process group (on Ray, on its
    node) and held what it held after the search had ended."""
    assert isinstance(runner, (LocalRunner, RayRunner))
    runner.run_full_experiment({OVERWRITE_KEY: {"train_micro_batch_size_per_gpu": LEAVES_CHILDREN}})
    log = (runner.results_dir / "logs" / "full-experiment.log").read_text()
    pids = [int(line.split()[-1]) for line in log.splitlines() if line.startswith("left pid")]
    assert len(pids) == 2
    assert "stopped what the full experiment left running: sleep (pid" in capsys.readouterr().out
    assert not [pid for pid in pids if psutil.pid_exists(pid)]


def test_a_local_trial_stopped_is_gone(tmp_path: Path) -> None:
    """The local runner's stop is real: the trial's process is no longer there."""
    runner = make_local(tmp_path)
    start(runner, 1, RUNS_UNTIL_STOPPED)
    process = next(iter(runner.running.values())).process
    runner.stop_all()
    assert process.poll() is not None
    assert runner.pool.size == 2


@pytest.mark.parametrize("warm", [True, False])
def test_a_stopped_trials_children_are_stopped_with_it(tmp_path: Path, warm: bool) -> None:
    """Ctrl-C stopped the trial's process group, and the child it had started in a session of
    its own ran on under init, the search's results directory in its environment."""
    runner = make_local(tmp_path, warm=warm)
    start(runner, 1, LEAVES_CHILDREN_UNTIL_STOPPED)
    trial = next(iter(runner.running.values()))
    deadline = time.monotonic() + 60
    pids: list[int] = []
    while len(pids) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
        lines = trial.log_path.read_text().splitlines()
        pids = [int(line.split()[-1]) for line in lines if line.startswith("left pid")]
    assert len(pids) == 2
    runner.stop_all()
    assert not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids
    )


def test_what_a_trial_leaves_running_is_stopped_and_its_result_kept(runner: TrialRunner) -> None:
    """A child it did not wait for (in a session of its own too) kept holding what it held (on a
    GPU, memory the next trial ran short of); a thread that kept it from exiting after it
    reported lost the result to the timeout, and a profile trial waited 20 minutes for it."""
    if isinstance(runner, SimulatedRunner):
        assert start(runner, 1, LEAVES_CHILDREN) and runner.wait().status is TrialStatus.COMPLETED
        return
    assert isinstance(runner, (LocalRunner, RayRunner))
    runner.linger_s = 2.0
    start(runner, 1, LEAVES_CHILDREN)
    start(runner, 2, LINGERS)
    outcomes = {o.request_id[-1]: o for o in (runner.wait(), runner.wait())}
    for outcome in outcomes.values():
        assert outcome.status is TrialStatus.COMPLETED, outcome.error
        assert outcome.metrics["throughput"] == 10.0
    assert outcomes["2"].end - outcomes["2"].start < 30  # not the timeout's 60 s
    left = Path(outcomes["1"].log or "").read_text()
    pids = [int(line.split()[-1]) for line in left.splitlines() if line.startswith("left pid")]
    assert len(pids) == 2 and "stopped what the trial left running: sleep (pid" in left
    assert not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids
    )
    lingered = Path(outcomes["2"].log or "").read_text()
    # A trial forked from a warm worker ends with os._exit, which no thread holds up.
    assert WARM_TRIAL_MARK in lingered.splitlines()[0] or "has not exited since" in lingered


def test_a_hosted_trial_whose_main_thread_blocks_after_it_reported_is_stopped(
    tmp_path: Path,
) -> None:
    """A trial host says itself what a trial left running once the trial returns: one that
    never returned (its upload hung) held its slot until the trial timeout, 20 minutes for the
    model profile."""
    runner = make_local(tmp_path, trial_host=True)
    runner.linger_s = 2.0
    try:
        start(runner, 1, BLOCKS_AFTER_IT_REPORTED)
        outcome = runner.wait()
    finally:
        runner.stop_all()
    assert outcome.status is TrialStatus.COMPLETED and outcome.end - outcome.start < 30
    log = Path(outcome.log or "").read_text()
    assert HOST_TRIAL_MARK in log.splitlines()[0] and "has not exited since" in log
    assert outcome.metrics[LINGERED_KEY] >= runner.linger_s  # its terminal line says so
    # The later trials' timeout follows the trial until its result, not the time it lingered.
    profile = runner.timeout.profile_seconds
    assert profile is not None and profile < outcome.end - outcome.start - runner.linger_s


def test_a_fresh_local_trial_kept_alive_after_it_reported_is_stopped(tmp_path: Path) -> None:
    runner = make_local(tmp_path, warm=False)
    runner.linger_s = 2.0
    start(runner, 1, LINGERS)
    outcome = runner.wait()
    assert outcome.status is TrialStatus.COMPLETED and outcome.end - outcome.start < 30
    assert "has not exited since" in Path(outcome.log or "").read_text()
