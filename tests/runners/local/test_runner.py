"""The local runner's parts with cheap processes: slot pool, trial environment, outcomes."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from dsat.cli import parse_settings
from dsat.constants import RUN_ALONE
from dsat.results.directory import FULL_RUN_DIR
from dsat.runners.local import log_cap
from dsat.runners.local.entrypoint import OPENMP_SPIN_TURNS
from dsat.runners.local.runner import WARM_TRIAL_MARK, LocalRunner, free_ports
from dsat.runners.local.setup import hosts_trials
from dsat.runners.local.slots import SlotPool
from dsat.runners.local.trial_outcome import oom_kill_count
from dsat.runners.local.trial_timeout import TrialTimeout
from dsat.trial import TrialOutcome, TrialStatus
from dsat.trial_failure import FailureCause

RID = "00000000-0000-0000-0000-00000000000{}"


@pytest.fixture(params=[True, False], ids=["warm", "fresh"])
def warm(request: pytest.FixtureRequest) -> bool:
    """Each outcome is classified alike whether the trial was forked by a warm worker or not."""
    return bool(request.param)


def local_runner(
    tmp_path: Path,
    script: str,
    timeout: float = 60.0,
    warm: bool = True,
    environ_extra: dict[str, str] | None = None,
    trial_host: bool = False,
    slots: int = 1,
) -> LocalRunner:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "job.py").write_text(script)
    environ = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": "", **(environ_extra or {})}
    pool = SlotPool([f"cpu{i}" for i in range(slots)], on_gpu=False)
    return LocalRunner(
        ["python3", "job.py"],
        model,
        (),
        tmp_path / "results",
        pool,
        1,
        TrialTimeout(timeout),
        environ,
        warm=warm,
        trial_host=trial_host,
    )


def run_one(ex: LocalRunner, n: int = 1) -> tuple[TrialStatus, dict[str, object], str | None]:
    """One trial, then the runner stops its warm worker."""
    try:
        ex.start(RID.format(n), {"lr": 0.5}, {}, 5)
        outcome = ex.wait()
    finally:
        ex.close()
    return outcome.status, outcome.metrics, outcome.error


ENV_DUMP = """
import json, os
keys = ["DS_ACCELERATOR", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "MASTER_PORT"]
env = {k: os.environ.get(k) for k in keys}
env["hparams"] = json.load(open(os.environ["DSAT_HPARAMS_FILE"]))
json.dump(env, open("env.json", "w"))
json.dump({"status": "completed", "values": {"throughput": 7.0}},
          open("dsat_trial_outcome.json", "w"))
"""


def test_trial_runs_in_a_copy_with_its_hparams_and_cpu_environment(
    tmp_path: Path, warm: bool
) -> None:
    ex = local_runner(tmp_path, ENV_DUMP, warm=warm)
    status, metrics, error = run_one(ex)
    assert (status, metrics, error) == (TrialStatus.COMPLETED, {"throughput": 7.0}, None)
    [trial_dir] = (tmp_path / "results" / "trials").iterdir()
    env = json.loads((trial_dir / "env.json").read_text())
    assert env["hparams"] == {"lr": 0.5}
    assert env["DS_ACCELERATOR"] == "cpu" and int(env["OMP_NUM_THREADS"]) >= 1
    # One process: its store binds port 0, so no other process can take its port first.
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("0", "1", "0")
    assert not (tmp_path / "model" / "env.json").exists()  # the user's dir is untouched
    log = (tmp_path / "results" / "logs" / f"{trial_dir.name}.log").read_text()
    assert log.startswith(f"$ {sys.executable} job.py")
    assert (WARM_TRIAL_MARK in log.splitlines()[0]) is warm
    assert ex.pool.size == 1  # the slot came back


@pytest.mark.parametrize(
    ("script", "status", "needle"),
    [
        ("print('hello')", TrialStatus.ERROR, "the script exited without reporting metrics"),
        ("raise SystemExit(3)", TrialStatus.ERROR, "exit code 3"),
        ("raise RuntimeError('CUDA out of memory. Tried')", TrialStatus.OOM, "out of memory"),
        (
            "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
            # Where the kernel counts its OOM kills, a SIGKILL it did not send is from outside.
            TrialStatus.OOM if oom_kill_count() is None else TrialStatus.ERROR,
            "killed by SIGKILL",
        ),
    ],
)
def test_outcomes(
    tmp_path: Path, script: str, status: TrialStatus, needle: str, warm: bool
) -> None:
    got_status, metrics, error = run_one(local_runner(tmp_path, script, warm=warm))
    assert got_status is status and metrics == {}
    assert error is not None and needle in error


def test_deepspeed_metric_file_without_dsat_counts(tmp_path: Path, warm: bool) -> None:
    script = "import json; json.dump({'throughput': 3.5}, open('autotuning_metric.json', 'w'))"
    status, metrics, _ = run_one(local_runner(tmp_path, script, warm=warm))
    assert status is TrialStatus.COMPLETED and metrics["throughput"] == 3.5


def test_timeout_kills_the_trial(tmp_path: Path, warm: bool) -> None:
    ex = local_runner(
        tmp_path, "import os, time; print(os.getpid(), flush=True); time.sleep(60)", 2.0, warm
    )
    status, _, error = run_one(ex)
    assert status is TrialStatus.TIMEOUT and error is not None and "trial timeout of 2 s" in error
    pid = int(error.splitlines()[-1])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_multi_process_trials_get_their_own_determined_broadcast_ports(tmp_path: Path) -> None:
    # Determined's DistributedContext uses two fixed TCP ports unless these variables are set;
    # two 2-process trials at once on one machine would otherwise fight over them.
    model = tmp_path / "model"
    model.mkdir()
    environ = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    pool = SlotPool.for_machine(2, None, environ)
    ex = LocalRunner(
        ["python3", "t.py"], model, (), tmp_path / "r", pool, 2, TrialTimeout(60.0), environ
    )
    first = ex.environment(tmp_path, pool.take(2), free_ports(3))
    second = ex.environment(tmp_path, pool.take(2), free_ports(3))
    names = ("INTER_TRAIN_PROCESS_COMM_PORT_1", "INTER_TRAIN_PROCESS_COMM_PORT_2")
    ports = [int(env[name]) for env in (first, second) for name in names]
    assert len(set(ports)) == 4
    assert (first["CUDA_VISIBLE_DEVICES"], second["CUDA_VISIBLE_DEVICES"]) == ("0,1", "2,3")
    assert "RANK" not in first  # torchrun sets the ranks of a multi-process trial


def test_free_ports_are_distinct() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(p > 0 for p in ports)


def test_a_results_dir_inside_the_model_dir_is_not_copied_into_trials(tmp_path: Path) -> None:
    # `python3 -m dsat asha deepspeed.yaml . --results-dir out` puts the results in MODEL_DIR.
    model = tmp_path / "model"
    (model / "out" / "trials").mkdir(parents=True)
    (model / "out" / "big.log").write_text("x")
    # An earlier search's, under another name: each search copied every earlier one into each
    # of its trials. A folder of the user's that merely has a settings.json is kept.
    (model / "out1").mkdir()
    (model / "out1" / "trials.jsonl").write_text("{}\n")
    (model / "out2").mkdir()
    (model / "out2" / "dsat_search_state.json").write_text("{}")
    (model / "conf").mkdir()
    (model / "conf" / "settings.json").write_text("{}")
    (model / "job.py").write_text(ENV_DUMP)
    environ = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": ""}
    pool = SlotPool.for_machine(1, 1, environ)
    ex = LocalRunner(
        ["python3", "job.py"], model, (), model / "out", pool, 1, TrialTimeout(60.0), environ
    )
    assert run_one(ex)[0] is TrialStatus.COMPLETED
    [trial] = (model / "out" / "trials").iterdir()
    assert (trial / "job.py").is_file() and not (trial / "out").exists()
    assert not (trial / "out1").exists() and not (trial / "out2").exists()
    assert (trial / "conf" / "settings.json").is_file()


def test_a_folder_holding_only_results_is_left_out_of_a_trials_copy(tmp_path: Path) -> None:
    """`--results-dir runs/a` left an empty `runs/` in every trial's copy; a folder above the
    results that holds a file of the user's too is copied, without the results."""
    import shutil

    from dsat.runners.local.runner import copy_ignore

    model = tmp_path / "model"
    results = model / "runs" / "a"
    (results / "trials").mkdir(parents=True)
    (model / "runs" / "earlier").mkdir()
    (model / "runs" / "earlier" / "trials.jsonl").write_text("{}\n")
    (model / "train.py").write_text("")
    shutil.copytree(model, tmp_path / "copy", ignore=copy_ignore(results))
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == ["train.py"]
    (model / "runs" / "notes.txt").write_text("mine")
    shutil.copytree(model, tmp_path / "copy2", ignore=copy_ignore(results))
    assert sorted(p.name for p in (tmp_path / "copy2" / "runs").iterdir()) == ["notes.txt"]


def test_links_to_folders_are_followed_into_a_trials_copy_but_not_round_a_loop(
    tmp_path: Path,
) -> None:
    """``loop -> .`` (or two folders linking each other) copied the model dir into itself until
    its paths grew too long, a copy hundreds of times its size; ``data -> /datasets/x`` is how
    a script points at its data, and stays followed (the Ray runner's archive, alike)."""
    from dsat.runners.local.runner import prepare_trial_directory
    from dsat.runners.ray.model_archive import model_archive, unpack

    shared = tmp_path / "datasets" / "x"
    shared.mkdir(parents=True)
    (shared / "x.txt").write_text("x")
    model = tmp_path / "model"
    (model / "a").mkdir(parents=True)
    (model / "b").mkdir()
    (model / "train.py").write_text("print(1)\n")
    (model / "data").symlink_to(shared, target_is_directory=True)
    (model / "loop").symlink_to(".", target_is_directory=True)
    (model / "up").symlink_to("..", target_is_directory=True)
    (model / "a" / "to_b").symlink_to("../b", target_is_directory=True)
    (model / "b" / "to_a").symlink_to("../a", target_is_directory=True)
    expected = ["data/x.txt", "dsat_hparams.json", "train.py"]

    copy = tmp_path / "trial"
    prepare_trial_directory(copy, model, (), {"x": 1}, tmp_path / "results")
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file()) == expected
    assert (copy / "a").is_dir() and (copy / "b" / "to_a").is_dir()  # one turn of the pair

    node = tmp_path / "node"
    unpack(model_archive(model, (), tmp_path / "results"), node)
    assert sorted(str(p.relative_to(node)) for p in node.rglob("*") if p.is_file()) == [
        "data/x.txt",
        "train.py",
    ]


def test_a_read_only_model_dir_gives_writable_copies(tmp_path: Path) -> None:
    """copytree keeps modes: a read-only model dir (a shared checkout) gave read-only copies,
    and every search stopped at its first trial ("cannot write .../dsat_hparams.json"). Root
    writes regardless, so the modes are what is checked; executable bits stay."""
    import stat

    from dsat.runners.local.runner import prepare_trial_directory

    model = tmp_path / "model"
    (model / "conf").mkdir(parents=True)
    (model / "train.sh").write_text("#!/bin/sh\n")
    (model / "conf" / "a.yaml").write_text("a: 1\n")
    os.chmod(model / "train.sh", 0o555)
    os.chmod(model / "conf" / "a.yaml", 0o444)
    for folder in (model / "conf", model):
        os.chmod(folder, 0o555)
    try:
        copy = tmp_path / "trial"
        prepare_trial_directory(copy, model, (), {"x": 1}, tmp_path / "results")
    finally:
        for folder in (model, model / "conf"):
            os.chmod(folder, 0o755)
    for path in (copy, copy / "conf", copy / "conf" / "a.yaml", copy / "train.sh"):
        assert os.stat(path).st_mode & stat.S_IWUSR, path
    assert os.access(copy / "train.sh", os.X_OK) and (copy / "dsat_hparams.json").is_file()


LARGE_FILES = """
import json
assert len(open("data.bin", "rb").read()) == 3 * 2**20  # the trial reads it from its copy
open("written.bin", "wb").write(b"w" * 2**21)
with open("rewritten.bin", "r+b") as f:
    f.write(b"x")
json.dump({"status": "completed", "values": {"throughput": 7.0}},
          open("dsat_trial_outcome.json", "w"))
"""


def test_a_finished_trial_keeps_what_it_wrote_not_copies_of_large_files(tmp_path: Path) -> None:
    """A 300 MB data file in MODEL_DIR was kept in every trial's copy: 20 GB for a search."""
    runner = local_runner(tmp_path, LARGE_FILES, warm=False)
    model = tmp_path / "model"
    (model / "data.bin").write_bytes(b"d" * 3 * 2**20)
    (model / "rewritten.bin").write_bytes(b"r" * 2**20)
    (model / "small.txt").write_text("kept")
    assert run_one(runner)[0] is TrialStatus.COMPLETED
    [trial] = (tmp_path / "results" / "trials").iterdir()
    assert not (trial / "data.bin").exists() and (model / "data.bin").stat().st_size == 3 * 2**20
    assert (trial / "written.bin").stat().st_size == 2**21  # the trial's own
    assert (trial / "rewritten.bin").read_bytes()[:2] == b"xr"  # changed by the trial: kept
    assert (trial / "small.txt").read_text() == "kept" and (trial / "job.py").is_file()
    [log] = (tmp_path / "results" / "logs").iterdir()
    assert "left unchanged (3 MiB; the originals are where they were)" in log.read_text()


def test_a_trial_stopped_by_an_interrupt_drops_its_copies_of_large_files_too(
    tmp_path: Path,
) -> None:
    """An interrupted trial runs again under a new number on resume: its copy, with the 300 MB
    data file, stayed for good."""
    runner = local_runner(tmp_path, "import time\nopen('started', 'w').close()\ntime.sleep(60)\n")
    (tmp_path / "model" / "data.bin").write_bytes(b"d" * 2 * 2**20)
    runner.start(RID.format(1), {}, {}, 5)
    [trial] = (tmp_path / "results" / "trials").iterdir()
    deadline = time.monotonic() + 30
    while not (trial / "started").exists():
        assert time.monotonic() < deadline, "the trial did not start"
        time.sleep(0.1)
    runner.stop_all()
    assert not (trial / "data.bin").exists() and (trial / "job.py").is_file()
    assert (tmp_path / "model" / "data.bin").stat().st_size == 2 * 2**20


def test_one_slot_trials_are_hosted_unless_asked_otherwise() -> None:
    assert hosts_trials(None)  # on the CPU and, since the H100 check, on a GPU
    assert hosts_trials(True) and not hosts_trials(False)
    assert parse_settings(["guided", "c.yaml", "."]).trial_host is None
    assert parse_settings(["guided", "c.yaml", ".", "--trial-host"]).trial_host is True
    assert parse_settings(["guided", "c.yaml", ".", "--no-trial-host"]).trial_host is False


def test_a_resumed_search_numbers_its_trials_on(tmp_path: Path) -> None:
    """Each resume numbered from 001 again: the trial the interrupt stopped, run again, took
    its earlier run's name, and the second resume overwrote the first one's log of it."""
    run_one(local_runner(tmp_path, ENV_DUMP, warm=False))
    again = local_runner(tmp_path, ENV_DUMP, warm=False)  # a resume: a new runner, same results
    run_one(again)
    logs = sorted(path.name for path in (tmp_path / "results" / "logs").glob("0*.log"))
    assert [name[:4] for name in logs] == ["001-", "002-"]


def one_trial(ex: LocalRunner) -> TrialOutcome:
    """A trial without hyperparameters, then the runner closed."""
    try:
        ex.start(RID.format(1), {}, {}, 5)
        return ex.wait()
    finally:
        ex.close()


UNGUARDED_SPAWN = """
import torch
from torch.utils.data import DataLoader, TensorDataset
rows = TensorDataset(torch.ones(8, 2))
for batch in DataLoader(rows, batch_size=2, num_workers=1, multiprocessing_context="spawn"):
    pass
"""


@pytest.mark.parametrize("warm", [True, False])
def test_a_spawn_that_runs_the_unguarded_script_again_is_the_scripts_fault(
    tmp_path: Path, warm: bool
) -> None:
    """The parent says only "DataLoader worker exited unexpectedly" (cause unknown, the config
    blamed); the worker's own traceback says why, over several lines."""
    outcome = one_trial(local_runner(tmp_path, UNGUARDED_SPAWN, warm=warm))
    assert outcome.status is TrialStatus.ERROR and outcome.cause is FailureCause.SCRIPT
    assert outcome.error is not None and 'if __name__ == "__main__":' in outcome.error


CAUGHT_PROBE_THEN_FAILS = """
import logging
try:
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (a probe)")
except RuntimeError:
    logging.exception("probe failed, going on with a smaller one")
print("step 1")
raise ValueError("loss became NaN at step 3")
"""


@pytest.mark.parametrize("warm", [True, False])
def test_an_oom_the_script_caught_is_not_the_trials_end(tmp_path: Path, warm: bool) -> None:
    """It made the ValueError that ended the script an OOM: the configuration's ceiling fell."""
    outcome = one_trial(local_runner(tmp_path, CAUGHT_PROBE_THEN_FAILS, warm=warm))
    assert outcome.status is TrialStatus.ERROR and outcome.cause is FailureCause.UNKNOWN
    assert outcome.error is not None and outcome.error.startswith("ValueError: loss became NaN")


PRINTS_THEN_DIES = """
import os, sys
print("printed first")
sys.stderr.write("written second\\n")
print("printed third")
os._exit(3)
"""


@pytest.mark.parametrize("mode", ["fresh", "forked", "hosted"])
def test_a_trials_log_has_its_prints_in_order_even_when_it_dies_at_once(
    tmp_path: Path, mode: str
) -> None:
    """Into a file, a script's stdout is block-buffered unless told otherwise: its prints came
    after its traceback, or never where the process was killed (here, exiting without flushing),
    and blame read a log in another order than a terminal shows."""
    ex = local_runner(tmp_path, PRINTS_THEN_DIES, warm=mode != "fresh", trial_host=mode == "hosted")
    outcome = one_trial(ex)
    assert outcome.status is TrialStatus.ERROR
    [log] = (tmp_path / "results" / "logs").glob("001-*.log")
    assert "printed first\nwritten second\nprinted third\n" in log.read_text()


def test_a_users_own_choice_of_buffering_is_kept(tmp_path: Path) -> None:
    script = "import os, sys; print(os.environ['PYTHONUNBUFFERED']); os._exit(3)"
    environ = {"PYTHONUNBUFFERED": ""}  # empty: Python buffers; the user's to choose
    one_trial(local_runner(tmp_path, script, warm=False, environ_extra=environ))
    [log] = (tmp_path / "results" / "logs").glob("001-*.log")
    assert "KeyError" not in log.read_text() and log.read_text().count("\n") == 1


def test_a_trial_that_printed_too_much_keeps_the_ends_of_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reason comes from the end kept, and the first lines say how the trial began."""
    monkeypatch.setattr(log_cap, "LOG_CAP_BYTES", 256 * 1024)
    monkeypatch.setattr(log_cap, "KEEP_HEAD_BYTES", 16 * 1024)
    monkeypatch.setattr(log_cap, "KEEP_TAIL_BYTES", 64 * 1024)
    script = (
        "for step in range(20_000):\n    print('step', step, 'x' * 40)\nraise ValueError('done')"
    )
    outcome = one_trial(local_runner(tmp_path, script, warm=False))
    assert outcome.status is TrialStatus.ERROR and outcome.error is not None
    assert outcome.error.startswith("ValueError: done")
    [log] = (tmp_path / "results" / "logs").glob("001-*.log")
    text = log.read_text()
    assert len(text) < 100 * 1024 and "output cut here" in text
    assert text.startswith("$ ") and "step 0 " in text and "step 19999 " in text


HOST_OOM_AFTER = """
import json, os, sys, time
hparams = json.load(open(os.environ["DSAT_HPARAMS_FILE"]))
time.sleep(hparams["seconds"])
if hparams["oom"]:
    sys.stderr.write("RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
                     "can't allocate memory: you tried to allocate 8 GB\\n")
    sys.exit(1)
json.dump({"status": "completed", "values": {"throughput": 1.0}},
          open("dsat_trial_outcome.json", "w"))
"""


def test_the_hosts_memory_running_out_beside_another_trial_is_the_machines_until_alone(
    tmp_path: Path,
) -> None:
    """Whichever of the two started first; alone, the same configuration is its own OOM."""
    ex = local_runner(tmp_path, HOST_OOM_AFTER, slots=2)
    try:
        ex.start(RID.format(1), {"seconds": 0.5, "oom": True}, {}, 5)
        ex.start(RID.format(2), {"seconds": 2.0, "oom": False}, {}, 5)
        beside = ex.wait()
        assert (beside.request_id, beside.status) == (RID.format(1), TrialStatus.ERROR)
        assert beside.cause is FailureCause.MACHINE and beside.metrics == {RUN_ALONE: True}
        assert beside.error is not None and beside.error.startswith(
            "the host's memory ran out while other trials shared this machine ("
        )
        assert ex.wait().status is TrialStatus.COMPLETED
        ex.start(RID.format(3), {"seconds": 0.0, "oom": True}, {}, 5)
        alone = ex.wait()
        assert (alone.status, alone.cause) == (TrialStatus.OOM, FailureCause.CONFIG)
        assert alone.metrics == {}
    finally:
        ex.close()


PRINTS_OPENMP_SETTINGS = """
import os, torch
print("threads", torch.get_num_threads(), "spin", os.environ.get("GOMP_SPINCOUNT"))
"""


@pytest.mark.parametrize("warm", [True, False])
@pytest.mark.parametrize("wait", [None, "ACTIVE"])
def test_a_trials_openmp_threads_wait_briefly_unless_the_user_says_how(
    tmp_path: Path, warm: bool, wait: str | None
) -> None:
    """libgomp's own spin (milliseconds) made a trial's steps 6-28x slower while another
    process kept one of the cores busy; a user's OMP_WAIT_POLICY is theirs to keep."""
    environ = {} if wait is None else {"OMP_WAIT_POLICY": wait}
    ex = local_runner(tmp_path, PRINTS_OPENMP_SETTINGS, warm=warm, environ_extra=environ)
    one_trial(ex)
    [log] = (tmp_path / "results" / "logs").glob("001-*.log")
    spin = str(OPENMP_SPIN_TURNS) if wait is None else "None"
    assert f"threads {ex.cpu_threads} spin {spin}\n" in log.read_text()


def test_on_the_cpu_the_full_run_has_every_core_not_a_slots_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --max-slots 2 on two cores a trial gets one thread, and so did the full run, which
    runs alone: the user's model trained on one core of two."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    ex = local_runner(tmp_path, ENV_DUMP, slots=2)
    assert ex.environment(tmp_path, ["cpu0"], free_ports(3))["OMP_NUM_THREADS"] == "2"
    ex.run_full_experiment({"lr": 0.5})
    env = json.loads((tmp_path / "results" / FULL_RUN_DIR / "env.json").read_text())
    assert env["OMP_NUM_THREADS"] == "4"
