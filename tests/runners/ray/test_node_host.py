"""A trial's actor on a node, as a plain object here: what it starts and with which interpreter."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from dsat.constants import MEMORY_RAN_OUT, RUN_ALONE
from dsat.runners.local.entrypoint import NODE_PYTHON, trial_command
from dsat.runners.ray.model_archive import model_archive
from dsat.runners.ray.node_host import TrialNodeHost
from dsat.runners.ray.runner import RayTrial, note_shared_nodes


def test_a_command_built_on_the_driver_runs_with_the_nodes_own_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dsat's interpreter path on the machine it runs on (a laptop's venv) need not exist on the
    cluster's nodes: the driver names none, each node runs its own."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "job.py").write_text("import sys\nprint('ran by', sys.executable)\n")
    command = trial_command(["python3", "job.py"], 1, 0, python=NODE_PYTHON)
    assert command == [NODE_PYTHON, "job.py"] and sys.executable not in command
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "node-tmp"))
    (tmp_path / "node-tmp").mkdir()
    host = TrialNodeHost("search/001-node0")
    host.prepare(model_archive(model, (), tmp_path / "results"), {})
    host.start(command, {})
    deadline = time.monotonic() + 60
    while host.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    log = host.read_log(0, 1 << 20).decode()
    assert host.poll() == 0, log
    assert f"ran by {sys.executable}" in log and NODE_PYTHON not in log
    host.clean()


def test_cleaning_a_trial_where_the_searchs_directory_is_a_file_leaves_it_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It raised NotADirectoryError through Ray, and the search stopped with a traceback."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    host = TrialNodeHost("search/001-node0")
    host.directory.parent.parent.mkdir(parents=True)
    host.directory.parent.write_text("not a directory")
    host.clean()
    assert host.directory.parent.read_text() == "not a directory"


def test_the_version_a_node_reports_is_every_module_of_its_dsat(tmp_path: Path) -> None:
    """A node whose reporting code differed, its node host the same, ran trials unrefused."""
    import shutil
    import subprocess

    import dsat

    package = Path(dsat.__file__).parent
    other = tmp_path / "other"
    shutil.copytree(package, other / "dsat", ignore=shutil.ignore_patterns("__pycache__"))
    code = "from dsat.runners.ray.node_host import protocol; print(protocol())"

    def version(root: Path) -> str:
        run = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
            cwd=tmp_path,  # not a checkout's, whose dsat -c would import first
            check=True,
        )
        return run.stdout.strip()

    assert version(other) == version(package.parent)
    reporting = other / "dsat" / "training" / "reporting.py"
    reporting.write_text(reporting.read_text() + "\n# another version\n")
    assert version(other) != version(package.parent)


HOST_OOM = """
import sys
sys.stderr.write("RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
                 "can't allocate memory: you tried to allocate 8 GB\\n")
sys.exit(1)
"""


@pytest.mark.parametrize("shared", [False, True])
def test_a_node_whose_memory_ran_out_beside_other_trials_blames_the_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """As on the local runner: alone, the configuration's OOM; beside others, run it alone."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "job.py").write_text(HOST_OOM)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "node-tmp"))
    (tmp_path / "node-tmp").mkdir()
    host = TrialNodeHost("search/001-node0")
    host.prepare(model_archive(model, (), tmp_path / "results"), {})
    host.start(trial_command(["python3", "job.py"], 1, 0, python=NODE_PYTHON), {})
    deadline = time.monotonic() + 60
    while host.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    outcome = host.outcome(False, 60, on_gpu=True, shared=shared)
    host.clean()
    if shared:
        assert (outcome["status"], outcome["cause"]) == ("error", "machine")
        assert outcome["metrics"] == {MEMORY_RAN_OUT: "host", RUN_ALONE: True}
    else:
        assert (outcome["status"], outcome["cause"]) == ("oom", "config")
        assert outcome["metrics"] == {MEMORY_RAN_OUT: "host"}


def test_trials_on_one_node_are_marked_as_sharing_it_and_others_are_not() -> None:
    def placed(*nodes: str) -> RayTrial:
        return RayTrial("r", "001-r", {}, 1, None, None, nodes=list(nodes))

    first, second, elsewhere = placed("a"), placed("b", "a"), placed("c")
    note_shared_nodes(first, [first])
    note_shared_nodes(elsewhere, [first, elsewhere])
    assert not first.shared and not elsewhere.shared
    note_shared_nodes(second, [first, elsewhere, second])
    assert first.shared and second.shared and not elsewhere.shared
