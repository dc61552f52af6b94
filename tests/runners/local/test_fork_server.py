"""The warm worker with cheap scripts: each trial a process of its own, imports shared, never
the user's modules, cold when a fork would no longer be safe."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil
import pytest

from dsat.runners.local.fork_server import is_local, local_names, run_entry, script_imports
from dsat.runners.local.warm_trials import LOST_RETURNCODE, WarmProcess, WarmWorker

# Appends the pid of whichever process imports it, so a test sees who imported what.
RECORDS_IMPORT = "import os\nwith open(os.environ['IMPORTS_FILE'], 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n"


def test_script_imports_are_absolute_names_in_order() -> None:
    source = (
        "import os, json as j\nfrom a.b import c\nfrom . import local\n"
        "def f():\n    import torch.nn\n"
    )
    assert script_imports(source) == ["os", "json", "a.b", "torch.nn"]


def test_the_model_dirs_modules_and_the_includes_are_local(tmp_path: Path) -> None:
    model = tmp_path / "model"
    (model / "pkg").mkdir(parents=True)
    (model / "model.py").write_text("")
    (model / "fast.cpython-311-x86_64-linux-gnu.so").write_text("")
    # Beside every script: the experiment config and the DeepSpeed config, not modules. Counted
    # as local, a ``deepspeed.yaml`` kept the worker from importing DeepSpeed for its trials.
    (model / "deepspeed.yaml").write_text("")
    (model / "ds_config.json").write_text("")
    (tmp_path / "extra").mkdir()
    (tmp_path / "helpers.py").write_text("")
    local = local_names(model, [tmp_path / "extra", tmp_path / "helpers.py"])
    assert local == {"pkg", "model", "fast", "extra", "helpers"}
    assert is_local("pkg.sub", local) and is_local("helpers", local)
    assert not is_local("json", local)
    assert not is_local("deepspeed", local) and not is_local("ds_config", local)


def setup(tmp_path: Path, script: str) -> tuple[Path, Path, dict[str, str]]:
    """A model dir with ``job.py``, a site dir on PYTHONPATH, and the environment for both."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "job.py").write_text(script)
    site = tmp_path / "site"
    site.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": os.pathsep.join([str(site), *sys.path[1:]]),
        "IMPORTS_FILE": str(tmp_path / "imports.txt"),
    }
    return model, site, env


@contextlib.contextmanager
def warm_worker(
    tmp_path: Path, model: Path, env: dict[str, str], includes: Sequence[Path] = ()
) -> Iterator[WarmWorker]:
    worker = WarmWorker([sys.executable, "job.py"], model, env, tmp_path / "worker.log", includes)
    try:
        yield worker
    finally:
        worker.close()


def run_trial(
    worker: WarmWorker, model: Path, env: dict[str, str], n: int, **extra: str
) -> WarmProcess:
    trial = worker.run(
        [sys.executable, "job.py", str(n)], model, {**env, **extra}, model / f"trial{n}.log"
    )
    assert trial is not None, (worker.cold_reason, worker.process.poll())
    return trial


def imports_seen(tmp_path: Path) -> list[int]:
    path = tmp_path / "imports.txt"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def test_a_trial_is_a_process_group_of_its_own_with_its_env_dir_and_log(tmp_path: Path) -> None:
    script = (
        "import os, sys\nprint(os.getpid(), os.getpgrp(), os.getcwd(), os.environ['TRIAL_NAME'], "
        "sys.argv[1:])\nraise SystemExit(int(sys.argv[1]))\n"
    )
    model, _, env = setup(tmp_path, script)
    with warm_worker(tmp_path, model, env) as worker:
        trial = run_trial(worker, model, env, 3, TRIAL_NAME="third")
        assert trial.wait(30) == 3
        pid, group, cwd, name, argv = (model / "trial3.log").read_text().split(maxsplit=4)
        assert int(pid) == int(group) == trial.pid  # its own group: stopped as a whole
        assert (cwd, name, argv.strip()) == (str(model), "third", "['3']")
        assert run_trial(worker, model, env, 0, TRIAL_NAME="next").wait(30) == 0


def test_a_trial_that_raises_or_is_killed_exits_as_a_fresh_interpreter_would(
    tmp_path: Path,
) -> None:
    script = (
        "import os, signal, sys\nif sys.argv[1] == '1':\n    raise RuntimeError('boom')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    model, _, env = setup(tmp_path, script)
    with warm_worker(tmp_path, model, env) as worker:
        assert run_trial(worker, model, env, 1).wait(30) == 1
        assert "RuntimeError: boom" in (model / "trial1.log").read_text()
        assert run_trial(worker, model, env, 2).wait(30) == -signal.SIGKILL


def test_the_worker_learns_third_party_imports_but_never_the_users_modules(
    tmp_path: Path,
) -> None:
    # Imported by name at run time, so only the first trial's imports can tell the worker.
    script = "import importlib, os\nimportlib.import_module(os.environ['LIBRARY'])\nimport helper\n"
    model, site, env = setup(tmp_path, script)
    (site / "library_x.py").write_text(RECORDS_IMPORT)
    (model / "helper.py").write_text(RECORDS_IMPORT.replace("IMPORTS_FILE", "HELPER_FILE"))
    env.update({"LIBRARY": "library_x", "HELPER_FILE": str(tmp_path / "helper.txt")})
    with warm_worker(tmp_path, model, env) as worker:
        first = run_trial(worker, model, env, 1)
        assert first.wait(30) == 0
        second = run_trial(worker, model, env, 2)
        assert second.wait(30) == 0
        worker_pid = worker.process.pid
        # The library: imported by the first trial, then by the worker, not by the second.
        assert imports_seen(tmp_path) == [first.pid, worker_pid]
        helper = [int(x) for x in (tmp_path / "helper.txt").read_text().split()]
        assert helper == [first.pid, second.pid]  # each trial imports its own copy


def test_an_import_that_starts_a_thread_makes_the_worker_cold(tmp_path: Path) -> None:
    model, site, env = setup(tmp_path, "import threaded_lib\n")
    (site / "threaded_lib.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    with warm_worker(tmp_path, model, env) as worker:
        assert worker.run([sys.executable, "job.py"], model, env, model / "t.log") is None
        assert worker.cold_reason is not None and "started threads" in worker.cold_reason
        assert "(threaded_lib)" in worker.cold_reason  # the import to blame
        assert not worker.alive


def test_a_cold_worker_names_a_native_thread_and_the_import_that_started_it(
    tmp_path: Path,
) -> None:
    """A thread started in C (faulthandler's watchdog here; CUDA's or a driver's on a GPU) is
    not in ``threading.enumerate()``: the reason names it as the system does, and the import."""
    model, site, env = setup(tmp_path, "import json, native_threaded\n")
    (site / "native_threaded.py").write_text(
        "import faulthandler\nfaulthandler.dump_traceback_later(3600)\n"
    )
    with warm_worker(tmp_path, model, env) as worker:
        assert worker.run([sys.executable, "job.py"], model, env, model / "t.log") is None
        reason = worker.cold_reason
        assert reason is not None and "an import (native_threaded) started threads (" in reason
        named = reason.split("started threads (")[1].split(")")[0]
        assert named and named != "native"  # the system's name for it, not a placeholder


def test_threads_a_library_stops_for_a_fork_keep_the_worker_warm(tmp_path: Path) -> None:
    """numpy's OpenBLAS starts a thread on import when more than one is allowed, and stops it for
    a fork; a plain thread that stops for a fork (``os.register_at_fork``) is the same case."""
    model, site, env = setup(
        tmp_path, "import numpy, stops_for_fork\nassert numpy.ones(3).sum() == 3\n"
    )
    (site / "stops_for_fork.py").write_text(
        "import os, threading\n"
        "stop = threading.Event()\n"
        "thread = threading.Thread(target=stop.wait, daemon=True)\n"
        "thread.start()\n"
        "def before_fork():\n"
        "    stop.set()\n"
        "    thread.join()\n"
        "os.register_at_fork(before=before_fork)\n"
    )
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "2"
    with warm_worker(tmp_path, model, env) as worker:
        assert run_trial(worker, model, env, 1).wait(30) == 0
        assert worker.cold_reason is None and worker.alive
        assert run_trial(worker, model, env, 2).wait(30) == 0


def test_a_worker_that_dies_takes_its_trial_down_and_says_so(tmp_path: Path) -> None:
    model, _, env = setup(tmp_path, "import time\ntime.sleep(60)\n")
    with warm_worker(tmp_path, model, env) as worker:
        trial = run_trial(worker, model, env, 1)
        os.kill(worker.process.pid, signal.SIGKILL)
        assert trial.wait(30) == LOST_RETURNCODE
        assert "warm worker that ran this trial exited" in (model / "trial1.log").read_text()
        deadline = time.monotonic() + 15
        while psutil.pid_exists(trial.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = not psutil.pid_exists(trial.pid)
        assert gone or psutil.Process(trial.pid).status() == psutil.STATUS_ZOMBIE
        assert not worker.alive


def test_a_name_an_include_provides_is_left_to_the_trial(tmp_path: Path) -> None:
    # The script imports `shadowed` at its top; an include of that name is copied into every
    # trial, so the worker must not import site-packages' `shadowed` in its place.
    model, site, env = setup(tmp_path, "import shadowed\n")
    (site / "shadowed.py").write_text(RECORDS_IMPORT)
    include = tmp_path / "include" / "shadowed.py"
    include.parent.mkdir()
    include.write_text("")
    with warm_worker(tmp_path, model, env, [include]) as worker:
        trial = run_trial(worker, model, env, 1)
        assert trial.wait(30) == 0
        assert imports_seen(tmp_path) == [trial.pid]  # the trial's own import, not the worker's


def test_what_a_trial_changes_in_a_shared_module_stays_in_that_trial(tmp_path: Path) -> None:
    script = (
        "import json, os\nprint(getattr(json, 'changed_by', None), os.environ.get('LEFT'))\n"
        "json.changed_by = 'a trial'\nos.environ['LEFT'] = 'behind'\n"
    )
    model, _, env = setup(tmp_path, script)
    with warm_worker(tmp_path, model, env) as worker:
        for n in (1, 2):
            assert run_trial(worker, model, env, n).wait(30) == 0
            assert (model / f"trial{n}.log").read_text() == "None None\n"


# Runs the worker with its cleanup interrupted: dsat closes the worker's stdin and then sends
# SIGTERM, which may arrive once the worker has left its loop and is removing its files.
SIGTERM_IN_CLEANUP = """
import os, shutil, signal, sys
from dsat.runners.local import fork_server

def rmtree(path, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    shutil.rmtree(path, **kwargs)

fork_server.shutil = type("Shutil", (), {"rmtree": staticmethod(rmtree)})
fork_server.main(sys.argv)
"""


def test_a_sigterm_while_the_worker_stops_leaves_no_traceback(tmp_path: Path) -> None:
    model, _, env = setup(tmp_path, "print('job')\n")
    worker = [str(os.getpid()), str(model), "--", sys.executable, "job.py"]
    stopped = subprocess.run(
        [sys.executable, "-c", SIGTERM_IN_CLEANUP, *worker],
        input="",  # dsat closed the channel: the worker stops
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert stopped.returncode == 0 and "Traceback" not in stopped.stderr, stopped.stderr


def test_the_worker_runs_one_openmp_thread_and_each_trial_sets_its_own(tmp_path: Path) -> None:
    """The worker imports torch with one OpenMP thread, so no pool exists when it forks; each
    trial gets its own count: its OMP_NUM_THREADS, else every core it may use."""
    script = (
        "import os, sys, torch\n"
        "from pathlib import Path\n"
        "Path(f'threads{sys.argv[1]}.txt').write_text(str(torch.get_num_threads()))\n"
    )
    model, _, env = setup(tmp_path, script)
    cores = len(os.sched_getaffinity(0))
    with warm_worker(tmp_path, model, env) as worker:
        assert run_trial(worker, model, env, 1, OMP_NUM_THREADS=str(cores + 1)).wait(60) == 0
        assert run_trial(worker, model, env, 2).wait(60) == 0
        assert worker.cold_reason is None and worker.alive
    assert (model / "threads1.txt").read_text() == str(cores + 1)
    assert (model / "threads2.txt").read_text() == str(cores)


def test_a_trial_forked_after_the_worker_ran_an_openmp_op_does_not_hang(tmp_path: Path) -> None:
    """libgomp's pool has no fork handler: a child forked after a parallel op in its parent
    hangs at its next one. A library the worker learns runs one on import (as some do); its
    one OpenMP thread leaves no pool, so the trials forked after it, each with several
    threads, run theirs."""
    script = (
        "import importlib, os, sys, torch\n"
        "importlib.import_module(os.environ['LIBRARY'])\n"
        "torch.set_num_threads(2)\n"
        "x = torch.ones(512, 512)\n"
        "for _ in range(20):\n"
        "    x = torch.tanh(x @ x / 512)\n"
        "open(f'done{sys.argv[1]}.txt', 'w').write(str(torch.get_num_threads()))\n"
    )
    model, site, env = setup(tmp_path, script)
    (site / "parallel_on_import.py").write_text(
        RECORDS_IMPORT + "import torch\nx = torch.ones(512, 512)\ny = (x @ x).sum()\n"
    )
    env["LIBRARY"] = "parallel_on_import"
    with warm_worker(tmp_path, model, env) as worker:
        assert run_trial(worker, model, env, 1).wait(60) == 0
        second = run_trial(worker, model, env, 2)
        assert second.wait(60) == 0  # a hang would time out here
        assert worker.process.pid in imports_seen(tmp_path)  # the worker ran the op
        assert worker.cold_reason is None
    assert (model / "done2.txt").read_text() == "2"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ("pass", 0),
        ("raise ValueError('x')", 1),
        ("import sys; sys.exit(3)", 3),
        ("import sys; sys.exit('a message')", 1),
        # A trial host said exit code 1 where a fresh process dies of SIGINT: judged apart.
        ("raise KeyboardInterrupt", -signal.SIGINT),
    ],
)
def test_a_script_run_in_this_process_exits_as_the_interpreter_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, status: int
) -> None:
    script = tmp_path / "job.py"
    script.write_text(body + "\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert run_entry(["python3", str(script)]) == status
    fresh = subprocess.run([sys.executable, str(script)], capture_output=True)
    assert fresh.returncode == status
