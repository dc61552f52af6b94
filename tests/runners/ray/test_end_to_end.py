"""`python3 -m dsat ... --runner ray` as a user runs it, against the tests' local multi-node Ray
cluster: a search with its report, Ctrl-C, kill -9 and a resume, and the one-line mistakes."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dsat.runners.local.trial_processes import leftover_trials
from dsat.runners.ray.node_host import NODE_ROOT
from dsat.runners.ray.setup import node_search_name
from tests.dsat_process import dsat, env, trials
from tests.runners.conftest import RayTestCluster
from tests.runners.local.test_end_to_end import model_dir
from tests.runners.ray.test_runner import assert_nothing_left

pytestmark = pytest.mark.slow


def search_args(tmp_path: Path, cluster: RayTestCluster, max_trials: int = 2) -> list[str]:
    path, directory = model_dir(tmp_path)
    return [
        str(path),
        str(directory),
        "-z",
        "1",
        "--max-trials",
        str(max_trials),
        "--runner",
        "ray",
        "--ray-address",
        cluster.address,
        "--results-dir",
        str(tmp_path / "results"),
    ]


def active_placement_groups() -> list[str]:
    """Placement groups of any job that still hold (or wait for) resources."""
    from ray.util.placement_group import placement_group_table

    return [
        group_id
        for group_id, group in placement_group_table().items()
        if group["state"] != "REMOVED"
    ]


def assert_no_placement_group_left() -> None:
    deadline = time.monotonic() + 30
    while active_placement_groups() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert active_placement_groups() == []


def start_hanging_search(tmp_path: Path, cluster: RayTestCluster) -> subprocess.Popen[str]:
    """A search whose search trials hang, returned once they run on the cluster."""
    args = search_args(tmp_path, cluster)
    (Path(args[1]) / "behaviour.txt").write_text("hang\n")  # travels with the model dir
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dsat",
            "binary",
            *args,
            "--search-range-factor",
            "0.005",
            "--no-baseline",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(),
    )
    results = tmp_path / "results"
    deadline = time.monotonic() + 180
    while not ((results / "trials.jsonl").is_file() and leftover_trials(results)):
        assert time.monotonic() < deadline, "the search trials did not start"
        assert process.poll() is None, process.communicate()[0][-3000:]
        time.sleep(0.3)
    return process


def test_a_guided_search_on_the_cluster_hands_over_a_config_with_its_report(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    run = dsat("guided", *search_args(tmp_path, ray_cluster), "--confirm-top", "0")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "dsat: runner ray (chosen with --runner)" in run.stdout
    assert "Ray cluster (" in run.stdout and "3 node(s), 2 GPU(s)" in run.stdout
    results = tmp_path / "results"
    best = json.loads((results / "best_ds_config.json").read_text())
    rows = trials(results)
    completed = [row for row in rows if row["status"] == "completed"]
    assert completed and best["zero_optimization"]["stage"] == 1
    assert (results / "report.html").is_file() and (results / "report.png").is_file()
    logs = sorted(p.name for p in (results / "logs").glob("0*.log"))
    assert len(logs) == len(rows)  # the model profile's and each search trial's
    assert_nothing_left(results)
    assert_no_placement_group_left()
    # Nothing of the search stays on the nodes (which share this host's temporary directory).
    assert not (Path(tempfile.gettempdir()) / NODE_ROOT / node_search_name(results)).exists()
    # A plain resume of the ended search writes its report again without the cluster.
    again = dsat("guided", "--resume", str(results), "--ray-address", "127.0.0.1:9")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "report:" in again.stdout and trials(results) == rows


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_every_trial_on_the_cluster(
    ray_cluster: RayTestCluster, tmp_path: Path, stop: signal.Signals
) -> None:
    """SIGTERM as Ctrl-C: ray.init replaced dsat's handler with one that exits at once (after a
    stack dump of Ray's core worker), with 15 and no resume command."""
    process = start_hanging_search(tmp_path, ray_cluster)
    process.send_signal(stop)
    output, _ = process.communicate(timeout=90)
    assert process.returncode == 128 + stop, output[-3000:]  # 130 or 143
    assert "SIGTERM received" not in output
    assert "interrupted; every trial was stopped. Resume with:" in output
    assert_nothing_left(tmp_path / "results")
    logs = sorted((tmp_path / "results" / "logs").glob("0*.log"))
    assert len(logs) == 2 and "$ " in logs[1].read_text()  # the stopped trial's output came back
    assert_no_placement_group_left()


def test_kill_9_leaves_nothing_on_the_cluster_and_the_search_resumes(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    process = start_hanging_search(tmp_path, ray_cluster)
    assert process.stdout is not None
    process.send_signal(signal.SIGKILL)
    output = process.communicate(timeout=30)[0]
    hint = next(
        line.split("resume with: ", 1)[1] for line in output.splitlines() if "resume with" in line
    )
    results = tmp_path / "results"
    assert_nothing_left(results)  # each trial dies with its node's actor, which dies with dsat
    assert_no_placement_group_left()
    # ... but nothing removed the trials' copies on the nodes (this host's temporary directory)
    copies = Path(tempfile.gettempdir()) / NODE_ROOT / node_search_name(results)
    assert any(copies.glob("0*-node0"))

    (tmp_path / "model" / "behaviour.txt").unlink()  # the trials no longer hang
    resumed = subprocess.run(
        shlex.split(hint), env=env(), capture_output=True, text=True, timeout=540
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    rows = trials(results)
    assert len(rows) == 2 and all(row["status"] == "completed" for row in rows)
    assert (results / "best_ds_config.json").is_file()
    # The resume ran those trials again under new names; the killed run's copies went as it
    # opened, each a whole model dir that stayed for good.
    assert not copies.exists()


def test_an_unreachable_cluster_is_one_line(experiment_yaml: Path) -> None:
    run = dsat(
        "asha",
        str(experiment_yaml),
        str(experiment_yaml.parent),
        "--runner",
        "ray",
        "--ray-address",
        "127.0.0.1:9",
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "dsat: error: no Ray cluster answers at 127.0.0.1:9 (--ray-address or RAY_ADDRESS); "
        "start one with `ray start --head` there, or fix the address"
    ]


def test_without_an_address_it_starts_its_own_instance_beside_a_running_cluster(
    ray_cluster: RayTestCluster, experiment_yaml: Path, tmp_path: Path
) -> None:
    """It joined the cluster already running here (the tests' three nodes), saying it had
    started one, and saved no address for its resume."""
    environ = {k: v for k, v in env().items() if k != "RAY_ADDRESS"}
    run = subprocess.run(
        [
            *(
                sys.executable,
                "-m",
                "dsat",
                "asha",
                str(experiment_yaml),
                str(experiment_yaml.parent),
            ),
            *("--runner", "ray", "--no-baseline", "--results-dir", str(tmp_path / "results")),
        ],
        capture_output=True,
        text=True,
        env=environ,
        timeout=300,
    )
    assert "dsat: Ray cluster (a Ray instance started on this machine): 1 node(s)" in run.stdout, (
        run.stdout[-3000:] + run.stderr[-3000:]
    )
    assert len(ray_cluster.cluster.worker_nodes) == 2  # the running cluster, untouched


def test_without_ray_installed_the_runner_is_one_line_saying_how_to_install_it(
    experiment_yaml: Path, tmp_path: Path
) -> None:
    blocked = tmp_path / "no_ray" / "ray"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    path = f"{tmp_path / 'no_ray'}:{env()['PYTHONPATH']}"
    run = dsat(
        "asha",
        str(experiment_yaml),
        str(experiment_yaml.parent),
        "--runner",
        "ray",
        timeout=60,
        PYTHONPATH=path,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "dsat: error: --runner ray needs Ray on this machine and the cluster's: pip install "
        "'ray>=2.9' (or reinstall dsat from its clone with the extra: pip install -e "
        "'/path/to/dsat[ray]')"
    ]
