"""One-slot trials run one after another in a trial host (--trial-host), through the local runner."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from dsat.runners.local.runner import HOST_TRIAL_MARK, LocalRunner
from dsat.runners.local.slots import SlotPool
from dsat.runners.local.trial_timeout import TrialTimeout
from dsat.trial import TrialOutcome, TrialStatus
from dsat.trial_failure import FailureCause
from tests.conftest import REPO_ROOT

FIXTURES = Path(__file__).parent.parent / "fixtures"

JOB = """
import json, os, sys, threading, time
import job_helper  # the trial's own module: imported anew by each trial
job_helper.COUNT += 1
hparams = json.load(open(os.environ["DSAT_HPARAMS_FILE"]))
mode = hparams.get("mode", "complete")
values = {"pid": os.getpid(), "parent": os.getppid(), "count": job_helper.COUNT}
values["left_over"] = int("LEFT_BY_A_TRIAL" in os.environ)
values["stdin_empty"] = int(sys.stdin.read() == "")  # not the host's requests
os.environ["LEFT_BY_A_TRIAL"] = "1"
first_run = "flag" in hparams and not os.path.exists(hparams["flag"])  # the *_once modes
if first_run:
    open(hparams["flag"], "w").close()
if mode == "thread":
    threading.Thread(target=time.sleep, args=(600,), name="left-running", daemon=True).start()
if mode == "raise" or (mode == "raise_once" and first_run):
    raise ValueError("the script failed")
if mode == "missing_module":
    import a_module_the_script_lacks  # noqa: F401
if mode == "oom" or (mode == "oom_once" and first_run):
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
if mode == "slow_fail_once":
    time.sleep(hparams["sleep"])
    if first_run:
        raise ValueError("failed slowly in the host")
if mode == "oom_then_fail":
    if first_run:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    raise ValueError("a failure of its own")
if mode == "oom_crash":
    print("RuntimeError: CUDA out of memory. Tried to allocate 2 GiB", file=sys.stderr, flush=True)
    os._exit(3)
if mode == "crash" or (mode == "crash_once" and first_run):
    os._exit(3)
if mode == "killed_once" and first_run:  # as another process's SIGKILL would end it
    import signal
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "exit_0":
    os._exit(0)
if mode == "segfault":
    import signal
    os.kill(os.getpid(), signal.SIGSEGV)
if mode == "hang":
    time.sleep(600)
if mode == "settings":  # what a script may set for its whole process, each trial again
    import logging, signal, warnings
    warnings.warn("made an error by an earlier trial's filter, unless put back")
    logging.getLogger(__name__).addHandler(logging.StreamHandler(sys.stdout))
    logging.getLogger(__name__).warning("a line of the trial's own")
    warnings.simplefilter("error")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "draws":
    import numpy, random, torch
    values.update(python=random.random(), numpy=float(numpy.random.rand()))
    values["torch"] = float(torch.rand(1))
if mode == "big":
    def touch_and_free(size=800 * 2**20):
        block = bytearray(size)
        block[:: 4096] = b"x" * len(block[:: 4096])
    touch_and_free()
import resource
values["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
json.dump({"status": "completed", "values": values}, open("dsat_trial_outcome.json", "w"))
"""


def host_runner(
    tmp_path: Path,
    files: dict[str, str],
    entrypoint: list[str],
    timeout: float = 60.0,
    environ_extra: dict[str, str] | None = None,
    gpu_pool: SlotPool | None = None,
) -> LocalRunner:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    for name, text in files.items():
        (model / name).write_text(text)
    environ = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": "", **(environ_extra or {})}
    pool = gpu_pool or SlotPool.for_machine(1, 1, environ)
    return LocalRunner(
        entrypoint,
        model,
        (),
        tmp_path / "results",
        pool,
        1,
        TrialTimeout(timeout),
        environ,
        trial_host=True,
    )


def run(ex: LocalRunner, n: int, hparams: dict[str, Any]) -> TrialOutcome:
    ex.start(f"{n:08d}-0000-0000-0000-000000000000", hparams, {}, 5)
    return ex.wait()


def job_runner(
    tmp_path: Path, timeout: float = 60.0, gpu_pool: SlotPool | None = None
) -> LocalRunner:
    files = {"job.py": JOB, "job_helper.py": "COUNT = 0\n"}
    return host_runner(tmp_path, files, ["python3", "job.py"], timeout, gpu_pool=gpu_pool)


def run_all(ex: LocalRunner, trials: list[dict[str, Any]]) -> list[TrialOutcome]:
    """Each of ``trials`` (their hyperparameters) in turn, then the runner closed."""
    try:
        return [run(ex, n, hparams) for n, hparams in enumerate(trials)]
    finally:
        ex.close()


def pid(outcome: TrialOutcome) -> int:
    assert outcome.status is TrialStatus.COMPLETED, outcome.error
    return int(outcome.metrics["pid"])


def test_trials_run_one_after_another_in_one_host_each_as_if_fresh(tmp_path: Path) -> None:
    ex = job_runner(tmp_path)
    try:
        outcomes = [run(ex, n, {}) for n in range(3)]
        assert ex.warm_workers is not None
        worker = ex.warm_workers.workers["cpu0"].process.pid
    finally:
        ex.close()
    assert {pid(o) for o in outcomes} == {worker}  # the worker is the host: nothing forked
    assert {int(o.metrics["parent"]) for o in outcomes} == {os.getpid()}
    # Each trial imported its own module anew and found no environment a trial left.
    assert [int(o.metrics["count"]) for o in outcomes] == [1, 1, 1]
    assert [int(o.metrics["left_over"]) for o in outcomes] == [0, 0, 0]
    assert [int(o.metrics["stdin_empty"]) for o in outcomes] == [1, 1, 1]
    # Its log said nothing (it never went cold, no host left): none is left behind.
    assert list((tmp_path / "results" / "logs").glob("warm-worker-*")) == []


def test_each_trial_of_a_host_draws_its_own_random_numbers(tmp_path: Path) -> None:
    """As a new interpreter: the host put back its baseline's state, the same draws each trial."""
    outcomes = run_all(job_runner(tmp_path), [{"mode": "draws"}] * 3)
    assert len({pid(o) for o in outcomes}) == 1
    for generator in ("python", "numpy", "torch"):
        assert len({o.metrics[generator] for o in outcomes}) == 3, generator


POOL = """
import json, multiprocessing, os, sys, time
def square(x):
    return x * x
if __name__ == "__main__":
    context = multiprocessing.get_context(sys.argv[1])
    with context.Pool(1) as pool:
        values = {"sum": sum(pool.map(square, [1, 2, 3])), "pid": os.getpid()}
    if sys.argv[2:] == ["daemon"]:  # left running, holding the tracker's pipe
        context.Process(target=time.sleep, args=(600,), daemon=True).start()
    json.dump({"status": "completed", "values": values}, open("dsat_trial_outcome.json", "w"))
"""


@pytest.mark.parametrize("command", [["spawn"], ["forkserver"], ["spawn", "daemon"]], ids=" ".join)
def test_multiprocessing_helpers_a_trial_started_end_with_it(
    tmp_path: Path, command: list[str]
) -> None:
    """Their resource tracker (and fork server) ignore SIGTERM: stopped as what a trial left
    running, each cost 5 s, and the next trial warned that the tracker had died. A daemonic
    child left running ends as at a process's exit (the tracker waited for it: a hang)."""
    ex = host_runner(tmp_path, {"job.py": POOL}, ["python3", "job.py", *command], timeout=40.0)
    outcomes = run_all(ex, [{}, {}])
    assert len({pid(o) for o in outcomes}) == 1 and outcomes[1].metrics["sum"] == 14
    for number in (1, 2):
        log = log_of(tmp_path, number)
        assert "left running" not in log and "died unexpectedly" not in log, log
        assert "stopped the trial" not in log and "trial timeout" not in log, log


def log_of(tmp_path: Path, number: int) -> str:
    return next((tmp_path / "results" / "logs").glob(f"{number:03d}-*.log")).read_text()


RERUN = "in the trial host; running it again in a fresh process"


def test_an_oom_in_the_host_after_other_trials_is_confirmed_fresh_and_the_host_goes_on(
    tmp_path: Path,
) -> None:
    first, oom, last = run_all(job_runner(tmp_path), [{}, {"mode": "oom"}, {}])
    assert oom.status is TrialStatus.OOM
    assert "out of memory " + RERUN in log_of(tmp_path, 2)
    assert pid(first) == pid(last)  # on the CPU the host stays


def test_a_failure_in_the_host_after_other_trials_is_confirmed_fresh_in_a_new_host(
    tmp_path: Path,
) -> None:
    """A failed trial may have broken its host (a sticky CUDA error fails every later one)."""
    first, failed, last = run_all(job_runner(tmp_path), [{}, {"mode": "raise"}, {}])
    assert failed.status is TrialStatus.ERROR and "the script failed" in (failed.error or "")
    assert "failed " + RERUN in log_of(tmp_path, 2)
    assert pid(first) != pid(last)
    assert HOST_TRIAL_MARK in log_of(tmp_path, 3).splitlines()[0]  # a new host, not none


def test_a_failure_in_the_host_that_a_process_of_its_own_does_not_repeat_is_no_failure(
    tmp_path: Path,
) -> None:
    trials = [{}, {"mode": "raise_once", "flag": str(tmp_path / "flag")}]
    first, confirmed = run_all(job_runner(tmp_path), trials)
    assert (tmp_path / "flag").exists()  # it did fail in the host
    assert confirmed.status is TrialStatus.COMPLETED
    assert pid(confirmed) != pid(first)  # in a fresh process


def test_a_failure_that_is_the_scripts_is_not_run_again_fresh(tmp_path: Path) -> None:
    """No configuration is blamed for it, so a second run tells nothing: it doubled the cost
    of every such trial (a new process, a new import of torch and DeepSpeed)."""
    first, failed, last = run_all(job_runner(tmp_path), [{}, {"mode": "missing_module"}, {}])
    assert failed.status is TrialStatus.ERROR and failed.cause is FailureCause.SCRIPT
    assert RERUN not in log_of(tmp_path, 2)
    assert pid(first) != pid(last)  # the host it failed in is replaced all the same
    assert HOST_TRIAL_MARK in log_of(tmp_path, 3).splitlines()[0]


@pytest.mark.parametrize("mode", ["raise", "oom"])
def test_a_hosts_first_trial_fails_as_its_own(tmp_path: Path, mode: str) -> None:
    """Nothing ran in the host before it, so a fresh process would fail alike: not run twice."""
    failed, after = run_all(job_runner(tmp_path), [{"mode": mode}, {}])
    assert failed.status is (TrialStatus.OOM if mode == "oom" else TrialStatus.ERROR)
    assert RERUN not in log_of(tmp_path, 1)
    assert after.status is TrialStatus.COMPLETED
    assert HOST_TRIAL_MARK in log_of(tmp_path, 2).splitlines()[0]


def test_on_a_gpu_the_host_goes_before_its_oom_is_confirmed(tmp_path: Path) -> None:
    """Its CUDA context would hold memory the fresh process lacks. A slot named as a GPU's (the
    job never touches a device), so the runner takes it for one."""
    trials = [{}, {"mode": "oom"}, {}]
    first, oom, last = run_all(job_runner(tmp_path, gpu_pool=SlotPool(["0"], on_gpu=True)), trials)
    assert oom.status is TrialStatus.OOM
    assert pid(first) != pid(last)  # a new host after the confirmation, not none:
    last_log = next((tmp_path / "results" / "logs").glob("003-*.log")).read_text()
    assert HOST_TRIAL_MARK in last_log.splitlines()[0]


def test_an_oom_in_the_host_that_a_process_of_its_own_does_not_repeat_is_not_an_oom(
    tmp_path: Path,
) -> None:
    trials = [{}, {"mode": "oom_once", "flag": str(tmp_path / "flag")}, {}]
    first, confirmed, last = run_all(job_runner(tmp_path), trials)
    assert (tmp_path / "flag").exists()  # it did run out of memory in the host
    assert pid(confirmed) not in (pid(first), pid(last))  # then completed in a fresh process
    assert pid(first) == pid(last)


def test_each_trial_finds_logging_warnings_and_signals_as_a_fresh_process_does(
    tmp_path: Path,
) -> None:
    """A handler a trial's module adds at import, a warning filter and a SIGTERM handler it
    sets: the next trials of the host print each line once, are not failed by the filter, and
    are stopped by SIGTERM."""
    ex = job_runner(tmp_path)
    try:
        outcomes = [run(ex, n, {"mode": "settings"}) for n in range(3)]
        assert ex.warm_workers is not None
        host = ex.warm_workers.workers["cpu0"].process.pid
        sigterm = _signal_disposition(host, signal.SIGTERM)
    finally:
        ex.close()
    assert [o.status for o in outcomes] == [TrialStatus.COMPLETED] * 3, [o.error for o in outcomes]
    assert {pid(o) for o in outcomes} == {host}  # no failure in the host to run again fresh
    for n in (1, 2, 3):
        assert log_of(tmp_path, n).count("a line of the trial's own") == 1
    assert sigterm == "default"


def _signal_disposition(process_id: int, number: int) -> str:
    """How the process takes a signal now, as the kernel says: ignored, caught or default."""
    fields = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{process_id}/status").read_text().splitlines()
    )
    bit = 1 << (number - 1)
    if int(fields["SigIgn"], 16) & bit:
        return "ignored"
    return "caught" if int(fields["SigCgt"], 16) & bit else "default"


def test_a_trials_peak_memory_is_its_own_not_an_earlier_trials_of_the_host(
    tmp_path: Path,
) -> None:
    """The CPU's figure, the peak resident set, lasts the process's life unless reset: a small
    trial after a large one must not report the large one's peak (the margin and the memory
    model read it)."""
    big, small = run_all(job_runner(tmp_path), [{"mode": "big"}, {}])
    assert pid(big) == pid(small)  # one host
    assert big.metrics["peak_rss"] - small.metrics["peak_rss"] > 400 * 2**20  # of 800 MiB


def test_a_host_a_trial_left_a_thread_in_is_replaced(tmp_path: Path) -> None:
    leaking, after, again = run_all(job_runner(tmp_path), [{"mode": "thread"}, {}, {}])
    assert pid(leaking) != pid(after) == pid(again)
    logs = tmp_path / "results" / "logs"
    assert (
        "this trial host is replaced: thread 'left-running'"
        in next(logs.glob("001-*.log")).read_text()
    )
    assert "this trial host leaves" in (logs / "warm-worker-cpu0.log").read_text()


def test_a_slot_whose_trials_each_leave_the_host_unfit_forks_them_instead(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A new host per trial pays a new process and its imports each time, and nothing said so
    on the terminal; a fork of a worker that imported once is cheaper, and the thread dies with
    it."""
    caplog.set_level(logging.INFO, logger="dsat")
    outcomes = run_all(job_runner(tmp_path), [{"mode": "thread"}] * 5)
    assert hosted(tmp_path) == [True, True, True, False, False]
    hosts = [pid(o) for o in outcomes[:3]]
    assert len(set(hosts)) == 3  # a new host for each
    forked = outcomes[3:]
    assert len({pid(o) for o in forked}) == 2 and forked[0].metrics["parent"] not in hosts
    said = [r.getMessage() for r in caplog.records if "fork from a warm worker" in r.getMessage()]
    assert len(said) == 1 and "thread 'left-running' still running" in said[0], said


def test_the_fresh_run_is_judged_by_its_own_output(tmp_path: Path) -> None:
    """The host's OOM (and the notice that says so) is in the log before it: not the fresh
    run's outcome."""
    trials = [{}, {"mode": "oom_then_fail", "flag": str(tmp_path / "flag")}]
    _, confirmed = run_all(job_runner(tmp_path), trials)
    assert confirmed.status is TrialStatus.ERROR
    assert "a failure of its own" in (confirmed.error or "")


def test_the_fresh_run_gets_a_whole_trial_timeout_of_its_own(tmp_path: Path) -> None:
    """5 s in the host, then 5 s and more fresh: each inside 8 s, together not."""
    trials = [{}, {"mode": "slow_fail_once", "sleep": 5, "flag": str(tmp_path / "flag")}]
    _, confirmed = run_all(job_runner(tmp_path, timeout=8.0), trials)
    assert confirmed.status is TrialStatus.COMPLETED, confirmed.error


def hosted(tmp_path: Path) -> list[bool]:
    """Whether each trial's log says it started in a trial host."""
    logs = sorted((tmp_path / "results" / "logs").glob("[0-9]*.log"))
    return [HOST_TRIAL_MARK in log.read_text().splitlines()[0] for log in logs]


def test_after_a_host_hung_in_a_trial_the_slot_s_trials_start_fresh(tmp_path: Path) -> None:
    first, hung, *later = run_all(
        job_runner(tmp_path, timeout=20.0), [{}, {"mode": "hang"}, {}, {}]
    )
    assert hung.status is TrialStatus.TIMEOUT
    assert len({pid(first), *(pid(o) for o in later)}) == 3  # a process each
    assert hosted(tmp_path) == [True, True, False, False]
    assert RERUN not in log_of(tmp_path, 2)  # a hang is not run again: it would cost as much
    assert "dsat: stopped the trial, and the trial host it ran in" in log_of(tmp_path, 2)
    assert "the trial ended the process" not in log_of(tmp_path, 2)


@pytest.mark.parametrize(
    ("mode", "status", "what"),
    [("crash", TrialStatus.ERROR, "failed"), ("oom_crash", TrialStatus.OOM, "out of memory")],
)
def test_a_host_s_end_that_a_fresh_process_repeats_is_the_configs_and_hosts_go_on(
    tmp_path: Path, mode: str, status: TrialStatus, what: str
) -> None:
    first, ended, *later = run_all(job_runner(tmp_path), [{}, {"mode": mode}, {}, {}])
    assert ended.status is status
    assert f"{what} {RERUN}" in log_of(tmp_path, 2)
    assert hosted(tmp_path) == [True, True, True, True]
    assert pid(later[0]) == pid(later[1]) != pid(first)  # a new host


def test_a_crash_in_a_hosts_first_trial_is_its_own_and_hosts_go_on(tmp_path: Path) -> None:
    crashed, *later = run_all(job_runner(tmp_path), [{"mode": "crash"}, {}, {}])
    assert crashed.status is TrialStatus.ERROR
    assert RERUN not in log_of(tmp_path, 1)
    assert hosted(tmp_path) == [True, True, True]
    assert pid(later[0]) == pid(later[1])


def test_a_segfault_in_a_host_is_the_trials_own_end_not_a_lost_worker(tmp_path: Path) -> None:
    """The host is the trial's process: a segfault there read as "the warm worker this trial
    was forked from died", a machine fault, and ran three times."""
    crashed, later = run_all(job_runner(tmp_path), [{"mode": "segfault"}, {}])
    assert crashed.status is TrialStatus.ERROR and crashed.cause is not FailureCause.MACHINE
    assert crashed.error is not None and crashed.error.startswith("exit code -11 (SIGSEGV)")
    assert "the trial ended the process it ran in (exit code -11)" in log_of(tmp_path, 1)
    assert later.status is TrialStatus.COMPLETED


def test_a_crash_in_a_host_that_a_fresh_process_does_not_repeat_leaves_the_slot_fresh(
    tmp_path: Path,
) -> None:
    trials = [{}, {"mode": "crash_once", "flag": str(tmp_path / "flag")}, {}, {}]
    first, confirmed, *later = run_all(job_runner(tmp_path), trials)
    assert (tmp_path / "flag").exists()  # it did crash in the host
    assert confirmed.status is TrialStatus.COMPLETED  # and not in a process of its own
    assert hosted(tmp_path) == [True, True, False, False]  # hosts are not trusted again
    assert len({pid(first), pid(confirmed), *(pid(o) for o in later)}) == 4


def test_a_host_killed_from_outside_during_a_trial_leaves_the_slot_hosted(
    tmp_path: Path,
) -> None:
    """A SIGKILL from outside says nothing of what hosting leaves: the slot's trials all started
    fresh from then on (ten times slower for the rest of the search), its note pointed at the
    host's empty log, and the trial's log said the trial ended the process. And it is the
    machine's as in the host's first trial (on screen, run again by the search, counted among
    its attempts): after other trials it was run again fresh inside the runner, unsaid."""
    trials = [{}, {"mode": "killed_once", "flag": str(tmp_path / "flag")}, {}, {}]
    first, killed, *later = run_all(job_runner(tmp_path), trials)
    assert (tmp_path / "flag").exists()  # it was killed in the host
    assert (killed.status, killed.cause) == (TrialStatus.ERROR, FailureCause.MACHINE)
    assert (killed.error or "").startswith("killed by SIGKILL from outside dsat")
    log = log_of(tmp_path, 2)
    assert "running it again in a fresh process" not in log
    assert "the trial host it ran in was stopped by SIGKILL (exit code -9)" in log
    assert "the trial ended the process" not in log
    assert hosted(tmp_path) == [True, True, True, True]
    assert pid(later[0]) == pid(later[1]) != pid(first)  # a new host, kept


@pytest.mark.slow
def test_zero_0_then_3_then_1_in_one_host(tmp_path: Path) -> None:
    """Real DeepSpeed on the CPU: ZeRO-0, ZeRO-3 under zero.Init destroying the process group,
    then ZeRO-1, each from the runner, in one host that is never replaced; ZeRO-1 trains as a
    fresh process does."""
    model = tmp_path / "model"
    shutil.copytree(FIXTURES / "reset_trial", model)
    environ = {
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *sys.path[1:]]),
    }
    ex = host_runner(tmp_path, {}, ["python3", "train.py"], 600.0, environ)
    trials = [
        {"stage": 0, "init": False, "end": "return"},
        {"stage": 3, "init": True, "end": "destroy"},
        {"stage": 1, "init": False, "end": "exit"},
    ]
    outcomes = run_all(ex, trials)
    assert len({pid(o) for o in outcomes}) == 1
    trial_dirs = sorted((tmp_path / "results" / "trials").iterdir())
    losses = [json.loads((d / "losses.json").read_text()) for d in trial_dirs]
    assert losses[0] == losses[2]
    # The trials' atexit callbacks ran when each trial ended, as at a fresh process's exit.
    assert all((d / "atexit_ran").exists() for d in trial_dirs)


def test_a_trial_that_ends_its_host_with_exit_0_is_the_scripts_own_end(tmp_path: Path) -> None:
    """os._exit(0) in a hosted trial read as "the warm worker this trial was forked from died",
    a machine fault, run three times; the search ended saying to fix the machine."""
    _, ended = run_all(job_runner(tmp_path), [{}, {"mode": "exit_0"}])
    assert ended.status is TrialStatus.ERROR and ended.cause is FailureCause.SCRIPT, ended.error
    assert "the trial ended the process it ran in (exit code 0)" in log_of(tmp_path, 2)
