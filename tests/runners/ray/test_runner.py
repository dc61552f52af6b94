"""The Ray runner on a real local multi-node cluster (tests/runners/conftest.py): real DeepSpeed
over two nodes, a lost node, a timeout, a trial that waits for room. The outcomes of every kind
are checked for every runner in tests/runners/test_trial_runner.py."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

import dsat.runners.ray.runner as ray_runner
from dsat.constants import MEMORY_RAN_OUT, OVERWRITE_KEY, RUN_ALONE
from dsat.errors import DsatError
from dsat.experiment.config import load_experiment
from dsat.runners.local.entrypoint import OPENMP_SPIN_TURNS, entrypoint_tokens
from dsat.runners.local.full_run import FullExperimentFailed
from dsat.runners.local.trial_processes import leftover_trials
from dsat.runners.local.trial_timeout import TrialTimeout
from dsat.runners.ray.node_host import NODE_ROOT, TrialNodeHost
from dsat.runners.ray.runner import RayRunner, speaking_rank
from dsat.runners.ray.setup import open_runner
from dsat.runners.trial_runner import RunnerStopped
from dsat.search import MethodSettings, make_search_method
from dsat.search.trial_builder import SearchSpec
from dsat.trial import TrialOutcome, TrialStatus
from dsat.trial_failure import FailureCause
from tests.conftest import copy_example
from tests.runners.conftest import RayTestCluster
from tests.runners.test_trial_runner import BEHAVIOUR_SCRIPT, COMPLETES, RUNS_UNTIL_STOPPED

pytestmark = pytest.mark.slow
NO_PROCESS_LEFT_WITHIN_S = 20.0


def runner_for(
    tmp_path: Path, model: Path, entrypoint: list[str], slots: int, timeout: float = 120
) -> RayRunner:
    import ray

    return open_runner(
        ray,
        entrypoint,
        model,
        (),
        tmp_path / "results",
        slots,
        TrialTimeout(timeout),
        {"DS_ACCELERATOR": "cpu"},
        "the tests' cluster",
    )


def behaviour_runner(tmp_path: Path, slots: int, timeout: float = 120) -> RayRunner:
    model = tmp_path / "model"
    model.mkdir()
    (model / "job.py").write_text(BEHAVIOUR_SCRIPT)
    return runner_for(tmp_path, model, ["python3", "job.py"], slots, timeout)


def start(runner: RayRunner, number: int, mbs: int) -> str:
    request_id = f"00000000-0000-0000-0000-{number:012d}"
    ds_config = {"train_micro_batch_size_per_gpu": mbs}
    runner.start(request_id, {OVERWRITE_KEY: ds_config}, ds_config, 6)
    return request_id


def assert_nothing_left(results: Path) -> None:
    """No process of a trial started for ``results`` on any node (all are on this host)."""
    deadline = time.monotonic() + NO_PROCESS_LEFT_WITHIN_S
    while leftover_trials(results) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftover_trials(results) == []


def wait_until_running(runner: RayRunner, processes: int) -> None:
    deadline = time.monotonic() + 60
    while len(leftover_trials(runner.results_dir)) < processes:
        assert time.monotonic() < deadline, "the trial's processes did not start"
        for trial in runner.running.values():
            runner._launch_if_placed(trial)
        time.sleep(0.2)


def test_a_deepspeed_trial_spread_over_two_nodes_trains_and_its_logs_come_back(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    model = copy_example(tmp_path / "model")
    experiment = load_experiment(model / "deepspeed_2slot.yaml", model)
    spec = SearchSpec(experiment.hparams, experiment.ds_config, experiment.slots_per_trial)
    method = make_search_method(MethodSettings(method="binary", zero_stages=(2,)), spec)
    profile = method.suggest()
    assert profile is not None
    method.observe(  # a profile as the example's gives, so that a search trial comes next
        TrialOutcome(
            profile.request_id,
            TrialStatus.COMPLETED,
            {
                "num_params": 263425,
                "trainable_num_params": 263425,
                "activation_mem_per_gpu": 1982464,
                "gpu_mem": 2 * 2**30,
            },
            None,
            0.0,
            1.0,
        )
    )
    record = method.suggest()
    assert record is not None and record.zero_stage == 2
    entrypoint = entrypoint_tokens(experiment.config["entrypoint"], "deepspeed_2slot.yaml")
    runner = runner_for(tmp_path, model, entrypoint, 2)
    assert (runner.layout.nodes, runner.layout.slots_per_node) == (2, 1)
    runner.start(record.request_id, record.hparams, record.ds_config, method.trial_length(record))
    outcome = runner.wait()
    assert outcome.status is TrialStatus.COMPLETED, outcome.error
    assert outcome.metrics["throughput"] > 0 and outcome.metrics["measured_steps"] > 0
    logs = runner.results_dir / "logs"
    first, second = logs / f"001-{record.request_id[:8]}.log", next(logs.glob("*-node1.log"))
    assert "--nnodes 2 --node_rank 0" in first.read_text()
    assert "--nnodes 2 --node_rank 1" in second.read_text()
    kept = runner.results_dir / "trials" / first.stem
    assert (kept / "dsat_trial_outcome.json").is_file()
    assert_nothing_left(runner.results_dir)


@pytest.mark.parametrize("graceful", [True, False])
def test_a_node_lost_mid_trial_is_an_error_and_its_other_ranks_stop(
    ray_cluster: RayTestCluster, tmp_path: Path, graceful: bool
) -> None:
    """A node that died (not ``graceful``) was said to be "still up": Ray had not yet marked it
    dead when its actor could no longer be reached."""
    runner = behaviour_runner(tmp_path, slots=2)
    start(runner, 1, RUNS_UNTIL_STOPPED)
    wait_until_running(runner, processes=2)  # one trial guard per node
    trial = next(iter(runner.running.values()))
    # What node 1 printed comes back while the trial runs (it all came at the trial's end, and
    # a lost node took the whole log with it).
    node1_log = runner._log_path(trial, 1)
    deadline = time.monotonic() + 60
    while not node1_log.is_file() or "ran at micro-batch" not in node1_log.read_text():
        assert time.monotonic() < deadline, "node 1's log did not come back while it ran"
        assert runner._advance(trial) is None
        time.sleep(0.2)
    try:
        ray_cluster.remove(trial.nodes[1], graceful)
        outcome = runner.wait()
    finally:
        ray_cluster.restore()
    assert outcome.status is TrialStatus.ERROR
    assert outcome.error is not None and outcome.error.startswith("node lost: ")
    assert outcome.cause is FailureCause.MACHINE  # the search loop runs it again
    assert trial.nodes[1] in outcome.error
    kept = node1_log.read_text()
    assert f"ran at micro-batch {RUNS_UNTIL_STOPPED}" in kept
    assert kept.endswith("[dsat: the rest of this log was lost with its node]\n")
    assert_nothing_left(runner.results_dir)
    assert runner.running_count() == 0


def test_a_trial_whose_actor_died_on_a_node_still_up_keeps_its_log_and_leaves_no_copy(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    """Ray's memory monitor, or a crash of Ray's worker, ends the trial's actor while its node
    stays: the log it wrote there comes back, and nothing of the trial is left on the node."""
    import ray

    runner = behaviour_runner(tmp_path, slots=1)
    start(runner, 1, RUNS_UNTIL_STOPPED)
    wait_until_running(runner, processes=1)
    trial = next(iter(runner.running.values()))
    # The nodes of the test cluster share this host's /tmp.
    on_node = TrialNodeHost(runner._node_directory(trial, 0))
    deadline = time.monotonic() + 30
    while b"ran at micro-batch" not in on_node.read_log(0, 1 << 16):
        assert time.monotonic() < deadline, "the trial printed nothing"
        time.sleep(0.2)
    ray.kill(trial.hosts[0])
    outcome = runner.wait()
    assert outcome.status is TrialStatus.ERROR and outcome.cause is FailureCause.MACHINE
    assert outcome.error is not None
    # Ray's words after the reason, whole: in it, a terminal line cut them off mid-word. One
    # node: no "other nodes" to stop.
    reason, _, ray_said = outcome.error.partition("\n")
    assert reason == "the trial's Ray actor died on a node that is still up", outcome.error
    assert ray_said.startswith("Ray: ") and "actor" in ray_said.lower(), outcome.error
    assert outcome.log is not None
    assert f"ran at micro-batch {RUNS_UNTIL_STOPPED}" in Path(outcome.log).read_text()
    assert not on_node.directory.exists() and not on_node.log_path.exists()
    assert not on_node.directory.parent.exists()  # the search's own, its only trial gone
    assert_nothing_left(runner.results_dir)


RANK_ONE_FAILS = """
import os, sys, time
if os.environ["RANK"] == "1":
    print("ModuleNotFoundError: No module named 'only_on_node_zero'", flush=True)
    sys.exit(1)
time.sleep(120)  # rank 0 waits, as in a collective with the rank that failed
"""


def test_a_spread_trial_says_what_the_rank_that_failed_said_not_the_rank_dsat_stopped(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    """The rank dsat stopped read as "killed by SIGKILL from outside dsat": a machine fault, run
    again three times, and the failing node's own error lost."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "job.py").write_text(RANK_ONE_FAILS)
    runner = runner_for(tmp_path, model, ["python3", "job.py"], slots=2)
    assert runner.layout.nodes == 2
    start(runner, 1, RUNS_UNTIL_STOPPED)
    outcome = runner.wait()
    assert outcome.status is TrialStatus.ERROR
    assert outcome.error is not None and "only_on_node_zero" in outcome.error, outcome.error
    assert outcome.cause is not FailureCause.MACHINE
    assert outcome.log is not None and outcome.log.endswith("-node1.log")
    assert_nothing_left(runner.results_dir)


RANK_ONE_FAILS_UNDER_TORCHRUN = """
import os, sys, time
if os.environ["RANK"] == "1":  # as node 1's torchrun says it: its own ranks only
    print("[rank1]: ValueError: the real failure, on rank 1")
    print("Failures:\\n  <NO_OTHER_FAILURES>\\nRoot Cause (first observed failure):\\n[0]:")
    print("  rank      : 1 (local_rank: 0)\\n  exitcode  : 1 (pid: 7)\\n" + "=" * 60, flush=True)
    sys.exit(1)
time.sleep(120)
"""


def test_a_failure_on_node_1_is_not_rank_0_leaving_early(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    """Node 1's torchrun lists only its own ranks among the failures: that rank 0 is not among
    them made every spread trial whose rank 1 failed the script's fault (three in a row end a
    search), with a reason that said rank 0 had left early."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "job.py").write_text(RANK_ONE_FAILS_UNDER_TORCHRUN)
    runner = runner_for(tmp_path, model, ["python3", "job.py"], slots=2)
    start(runner, 1, RUNS_UNTIL_STOPPED)
    outcome = runner.wait()
    assert outcome.status is TrialStatus.ERROR and outcome.cause is FailureCause.UNKNOWN
    assert outcome.error is not None and outcome.error.startswith("ValueError: the real failure")
    assert_nothing_left(runner.results_dir)


WRITES_ITS_OUTPUTS = """
import os
rank = os.environ["RANK"]
os.makedirs("output/shards", exist_ok=True)
open(f"output/shards/rank{rank}.pt", "wb").write(os.urandom(3 << 20) + rank.encode())
open("output/latest", "w").write(f"written by rank {rank}")
print(f"rank {rank} saved", flush=True)
"""


def full_run_on_two_nodes(tmp_path: Path) -> RayRunner:
    model = tmp_path / "model"
    model.mkdir()
    (model / "job.py").write_text(WRITES_ITS_OUTPUTS)
    runner = runner_for(tmp_path, model, ["python3", "job.py"], slots=2)
    assert runner.layout.nodes == 2
    return runner


RANK_ONE_FAILS_IN_THE_FULL_RUN = """
import os, sys, time
if os.environ["RANK"] == "1":
    print("rank 1 fails", flush=True)
    sys.exit(3)
time.sleep(120)  # rank 0 ends cleanly, once its launcher's exit barrier gives up (5 min)
"""


def test_a_full_run_whose_other_node_fails_fails_at_once_naming_that_node(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    """It was judged by its first node alone: "finished", exit 0, five minutes after node 1 had
    failed, and node 1's failure said nowhere."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "job.py").write_text(RANK_ONE_FAILS_IN_THE_FULL_RUN)
    runner = runner_for(tmp_path, model, ["python3", "job.py"], slots=2)
    assert runner.layout.nodes == 2
    began = time.monotonic()
    with pytest.raises(
        FullExperimentFailed, match=r"exited with code [1-9][0-9]* on node 1 of 2"
    ) as failed:
        runner.run_full_experiment({OVERWRITE_KEY: {"train_micro_batch_size_per_gpu": 1}})
    assert time.monotonic() - began < 60
    assert str(failed.value).endswith("full-experiment-node1.log")
    assert "rank 1 fails" in (runner.results_dir / "logs" / "full-experiment-node1.log").read_text()
    assert_nothing_left(runner.results_dir)


def test_a_full_run_a_node_cannot_prepare_is_one_line_in_the_nodes_words(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    """Its disk full (here an archive that is no zip): Ray's RayTaskError came out as a
    traceback, where the same failure in a search trial is the machine's, said in one line."""
    import ray

    runner = behaviour_runner(tmp_path, slots=1)
    runner.archive = ray.put(b"not a zip archive")
    with pytest.raises(FullExperimentFailed) as failed:
        runner.run_full_experiment({OVERWRITE_KEY: {"train_micro_batch_size_per_gpu": 1}})
    said = str(failed.value)
    assert said.startswith(
        "the full experiment with the best config ended: a node failed to run it: BadZipFile: "
    )
    assert "\n" not in said
    assert_nothing_left(runner.results_dir)


PRINTS_BLOCKS_THEN_ENDS = """
import sys
for line in range(3000):  # wide characters, split across the chunks the output comes in
    print("\u2588" * 400)
"""


def test_a_full_runs_output_keeps_its_characters_and_its_log_is_its_own(
    ray_cluster: RayTestCluster, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A character split between two chunks printed as two replacement marks (tqdm's bars);
    and an earlier full run's node log stayed beside this one's."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "job.py").write_text(PRINTS_BLOCKS_THEN_ENDS)
    runner = runner_for(tmp_path, model, ["python3", "job.py"], slots=1)
    earlier = runner.results_dir / "logs" / "full-experiment-node1.log"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("an earlier run's node 1\n")
    runner.run_full_experiment({OVERWRITE_KEY: {"train_micro_batch_size_per_gpu": 1}})
    out = capfd.readouterr().out
    assert out.count("\u2588" * 400) == 3000 and "\ufffd" not in out
    assert not earlier.exists()
    log = (runner.results_dir / "logs" / "full-experiment.log").read_text()
    assert log.count("\u2588" * 400) == 3000


class HostThatDiesInTheFullRun(TrialNodeHost):
    """A Ray actor that dies on a node that stays up (a crash of Ray's worker), once the full
    run has written its checkpoint there: at the next call, whichever it is (a node the runner
    polls no more after another's death is asked for its files)."""

    def _die_once_written(self) -> None:
        if (Path(self.directory) / "output" / "latest").is_file():
            os._exit(1)

    def poll(self) -> int | None:
        self._die_once_written()
        return super().poll()

    def files(self) -> list[tuple[str, int, int]]:
        self._die_once_written()
        return super().files()


def test_a_full_run_whose_actor_died_leaves_what_it_wrote_on_its_node(
    ray_cluster: RayTestCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Reading its log back removed the node's copy, checkpoint and all, and the lines said
    "a node was lost" and "what the full run wrote is in full-experiment/", which was not."""
    import ray

    runner = full_run_on_two_nodes(tmp_path)
    runner._host_class = ray.remote(HostThatDiesInTheFullRun)
    with pytest.raises(FullExperimentFailed) as failed:
        runner.run_full_experiment({OVERWRITE_KEY: {"train_micro_batch_size_per_gpu": 1}})
    assert "ended: its Ray actor died on a node that is still up" in str(failed.value)
    said = capsys.readouterr().out
    assert "could not come back" in said and "full-experiment-node<rank>" in said
    assert "what the full run wrote is in" not in said
    copies = node_copies(runner)
    try:
        assert copies and all((copy / "output" / "latest").is_file() for copy in copies)
    finally:
        if copies:
            shutil.rmtree(copies[0].parent)


def test_ctrl_c_while_a_full_runs_files_come_back_leaves_them_on_its_nodes(
    ray_cluster: RayTestCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run had finished; a large checkpoint's silent copy invited a Ctrl-C, which removed
    the nodes' copies with it."""
    runner = full_run_on_two_nodes(tmp_path)

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    runner._copy_back = interrupted  # type: ignore[method-assign]
    said = interrupted_full_run(runner, capsys)
    assert "interrupted while what the full run wrote came back; it stays on its Ray nodes" in said
    assert_kept_on_both_nodes(runner)


def test_ctrl_c_while_a_full_run_trains_leaves_what_it_wrote_on_its_nodes(
    ray_cluster: RayTestCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The nodes' copies, the checkpoints the run had written among them, were removed with the
    run: hours of training lost to one Ctrl-C (the local runner's full run works in
    full-experiment/ and keeps them)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "job.py").write_text(WRITES_ITS_OUTPUTS + "import time\ntime.sleep(120)\n")
    runner = runner_for(tmp_path, model, ["python3", "job.py"], slots=2)
    poll = runner._poll

    def ctrl_c_once_written(trial: Any) -> list[int | None]:
        codes = poll(trial)
        copies = node_copies(runner)
        if len(copies) == 2 and all((c / "output" / "latest").is_file() for c in copies):
            raise KeyboardInterrupt
        return codes

    runner._poll = ctrl_c_once_written  # type: ignore[method-assign]
    said = interrupted_full_run(runner, capsys)
    assert "the full run was interrupted, and what it wrote did not come back: it stays" in said
    assert_kept_on_both_nodes(runner)


def interrupted_full_run(runner: RayRunner, capsys: pytest.CaptureFixture[str]) -> str:
    """What a full run that Ctrl-C stops says on screen."""
    with pytest.raises(KeyboardInterrupt):
        runner.run_full_experiment({OVERWRITE_KEY: {"train_micro_batch_size_per_gpu": 1}})
    return capsys.readouterr().out


def assert_kept_on_both_nodes(runner: RayRunner) -> None:
    """Both nodes' copies of the full run hold what it wrote (then removed: the tests' own)."""
    copies = node_copies(runner)
    try:
        assert len(copies) == 2 and all((c / "output" / "latest").is_file() for c in copies)
    finally:
        if copies:
            shutil.rmtree(copies[0].parent)
    assert_nothing_left(runner.results_dir)


def node_copies(runner: RayRunner) -> list[Path]:
    """The full run's copies on the nodes (all on this host in the tests' cluster)."""
    import tempfile

    root = Path(tempfile.gettempdir()) / NODE_ROOT / runner.search_name
    return sorted(path for path in root.glob("full-experiment-node*") if path.is_dir())


def test_what_a_full_run_writes_on_its_nodes_comes_back_as_one_directory(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    """Without storage the nodes share, a checkpoint the script wrote in its own directory was
    removed with the node's copy; now each rank's shards come back beside the model dir, larger
    than one piece of the copy, byte for byte; a file every rank wrote is the first node's."""
    runner = full_run_on_two_nodes(tmp_path)
    runner.run_full_experiment({OVERWRITE_KEY: {"train_micro_batch_size_per_gpu": 1}})
    kept = runner.results_dir / "full-experiment"
    assert (kept / "job.py").read_text() == WRITES_ITS_OUTPUTS
    for rank in (0, 1):
        shard = (kept / "output" / "shards" / f"rank{rank}.pt").read_bytes()
        assert len(shard) == (3 << 20) + 1 and shard.endswith(str(rank).encode())
    assert (kept / "output" / "latest").read_text() == "written by rank 0"
    assert not list(kept.rglob("*.dsat-part"))
    assert node_copies(runner) == []
    assert_nothing_left(runner.results_dir)


def test_a_full_run_whose_files_cannot_come_back_leaves_them_on_its_nodes(
    ray_cluster: RayTestCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where this machine cannot take them (here a file stands where the directory goes; a full
    disk alike), the copies on the nodes are not removed, and the line says where they are."""
    runner = full_run_on_two_nodes(tmp_path)
    runner.results_dir.mkdir(parents=True, exist_ok=True)
    (runner.results_dir / "full-experiment").write_text("in the way")
    runner.run_full_experiment({OVERWRITE_KEY: {"train_micro_batch_size_per_gpu": 1}})
    said = capsys.readouterr().out
    assert "could not all come back" in said and "full-experiment-node<rank>" in said
    copies = node_copies(runner)
    try:
        assert len(copies) == 2
        assert all((copy / "output" / "latest").is_file() for copy in copies)
    finally:
        shutil.rmtree(copies[0].parent)


def test_a_step_that_fails_on_a_node_is_that_nodes_fault_in_its_own_words(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    """Unpacking the model dir there raised (a full disk, here an archive that is no zip): the
    search got Ray's RayTaskError as a traceback and ended."""
    import ray

    runner = behaviour_runner(tmp_path, slots=1)
    runner.archive = ray.put(b"not a zip archive")
    start(runner, 1, COMPLETES)
    outcome = runner.wait()
    assert outcome.status is TrialStatus.ERROR and outcome.cause is FailureCause.MACHINE
    assert outcome.error is not None
    assert outcome.error.startswith("a node of this trial failed to run it: BadZipFile: ")
    assert runner.running_count() == 0
    # The log it names says so, with the node's traceback: it had pointed at an empty file.
    said = Path(outcome.log or "").read_text()
    assert f"dsat: {outcome.error.splitlines()[0]}" in said
    assert "TrialNodeHost.prepare()" in said and "File is not a zip file" in said
    assert "\x1b[" not in said


class HostThatCannotStart(TrialNodeHost):
    """What a node without dsat installed does with the trial's actor."""

    def __init__(self, name: str) -> None:
        raise ModuleNotFoundError("No module named 'dsat'")


def test_a_node_that_cannot_run_dsat_ends_the_search_in_one_line(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    """Each trial ran three times as "node lost" and the search ended with no trial done."""
    import ray

    runner = behaviour_runner(tmp_path, slots=1)
    runner._host_class = ray.remote(HostThatCannotStart)
    start(runner, 1, COMPLETES)
    with pytest.raises(DsatError, match="dsat cannot run on a node of the Ray cluster") as info:
        runner.wait()
    message = str(info.value)
    assert "No module named 'dsat'" in message and "\n" not in message
    assert "install dsat with its ray extra on every node" in message
    assert runner.running_count() == 0


class HostOfAnOlderDsat(TrialNodeHost):
    """What a node with an older dsat answers: its node() said no protocol, and its outcome()
    took fewer arguments (a TypeError in the trial's last step, read as the machine's)."""

    def node(self) -> tuple[str, str]:  # type: ignore[override]
        node_id, address, _ = super().node()
        return node_id, address


class HostOfAnotherDsat(TrialNodeHost):
    def node(self) -> tuple[str, str, str]:
        node_id, address, _ = super().node()
        return node_id, address, "0123456789abcdef"


@pytest.mark.parametrize("host", [HostOfAnOlderDsat, HostOfAnotherDsat])
def test_a_node_with_another_dsat_ends_the_search_in_one_line_before_the_trial_runs(
    ray_cluster: RayTestCluster, tmp_path: Path, host: type[TrialNodeHost]
) -> None:
    """Each trial trained to its end, failed there, and ran three times as the machine's fault;
    then the search failed."""
    import ray

    runner = behaviour_runner(tmp_path, slots=1)
    runner._host_class = ray.remote(host)
    start(runner, 1, COMPLETES)
    with pytest.raises(DsatError, match="runs another version of dsat than this machine") as info:
        runner.wait()
    assert "install dsat with its ray extra on every node" in str(info.value)
    assert runner.running_count() == 0


def test_a_trial_the_cluster_can_no_longer_place_ends_the_search_in_one_line(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    """A two-node trial after one of the two GPU nodes left: Ray's placement group waited for
    ever, and the search with it, saying nothing."""
    runner = behaviour_runner(tmp_path, slots=2)
    runner.placement_check_s = 0.5
    assert (runner.layout.nodes, runner.layout.slots_per_node) == (2, 1)
    live = [n["NodeID"] for n in ray_cluster_nodes() if n["Resources"].get("GPU")]
    try:
        ray_cluster.remove(live[0])
        start(runner, 1, COMPLETES)
        with pytest.raises(
            RunnerStopped, match="the Ray cluster can no longer place a trial"
        ) as info:
            runner.wait()
    finally:
        ray_cluster.restore()
    assert "1 GPU(s) on each of 2 nodes" in info.value.why and info.value.remedy == "add nodes"
    assert runner.running_count() == 0
    assert info.value.stopped == []  # never placed, it held no slot: nothing to count


def ray_cluster_nodes() -> list[dict[str, object]]:
    import ray

    return [n for n in ray.nodes() if n["Alive"]]


def test_a_trial_over_its_timeout_is_stopped_and_counted_as_a_timeout(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    runner = behaviour_runner(tmp_path, slots=1, timeout=3)
    start(runner, 1, RUNS_UNTIL_STOPPED)
    outcome = runner.wait()
    assert outcome.status is TrialStatus.TIMEOUT
    assert outcome.error is not None and "trial timeout of 3 s" in outcome.error
    assert_nothing_left(runner.results_dir)


RANK_ONE_HANGS = """
import os, time
print(f"rank {os.environ['RANK']} starts", flush=True)
time.sleep(120)  # rank 1 hangs; rank 0 waits on it, as in a collective
"""


def test_a_spread_trial_over_its_timeout_names_every_nodes_log(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    """The reason and its log named node 0's, which shows only waiting, when the hang may be
    node 1's."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "job.py").write_text(RANK_ONE_HANGS)
    # 8 s: on a loaded machine (CI's two cores shared with other tests) node 1's interpreter
    # once took over 4 s to print its first line.
    runner = runner_for(tmp_path, model, ["python3", "job.py"], slots=2, timeout=8)
    assert runner.layout.nodes == 2
    request_id = start(runner, 1, RUNS_UNTIL_STOPPED)
    outcome = runner.wait()
    assert outcome.status is TrialStatus.TIMEOUT and outcome.error is not None
    first_line = outcome.error.splitlines()[0]
    node1 = runner.results_dir / "logs" / f"001-{request_id[:8]}-node1.log"
    assert "trial timeout of 8 s" in first_line and f"node 1: {node1}" in first_line, first_line
    assert "rank 1 starts" in node1.read_text()
    assert_nothing_left(runner.results_dir)


def test_a_trial_that_cannot_be_placed_yet_waits_for_room(
    ray_cluster: RayTestCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(ray_runner, "PLACEMENT_NOTE_S", 0.0)  # said at once
    runner = behaviour_runner(tmp_path, slots=1)
    runner.placement_check_s = 0.0
    assert runner.slot_limit == 2  # two GPUs in the cluster
    ids = [start(runner, n, COMPLETES) for n in (1, 2, 3)]
    with caplog.at_level("INFO", logger="dsat"):
        outcomes = [runner.wait() for _ in ids]
    # By its number, as the progress lines name it: it said "trial 003-1f2e3d4c".
    assert "trial 3 waits for room on the Ray cluster (" in caplog.text
    assert {o.request_id for o in outcomes} == set(ids)
    assert all(o.status is TrialStatus.COMPLETED for o in outcomes)
    last = max(outcomes, key=lambda o: o.start)
    # The third one started once another had finished and given its GPU back.
    assert any(o.end <= last.start for o in outcomes if o is not last)


def test_ray_s_memory_monitor_is_out_of_memory_not_a_lost_node() -> None:
    """A node low on host memory has Ray kill the trial's worker; the node is still there."""
    from ray.exceptions import ActorDiedError, OutOfMemoryError, RayActorError

    from dsat.runners.ray.runner import ran_out_of_host_memory

    assert ran_out_of_host_memory(
        OutOfMemoryError("Task was killed due to the node running low on memory.")
    )
    assert ran_out_of_host_memory(
        RayActorError(error_msg="The actor died: the node was running low on memory.")
    )
    assert not ran_out_of_host_memory(ActorDiedError())  # a node gone: its own case


@pytest.mark.parametrize("shared", [False, True])
def test_ray_s_memory_monitor_beside_other_trials_on_the_node_is_the_machines(
    ray_cluster: RayTestCluster, tmp_path: Path, shared: bool
) -> None:
    """As on the local runner: alone on its node, the configuration's OOM; beside other trials
    there, the machine's, run again alone. Either way the host's, not the GPU's. (The tests'
    cluster gives each one-GPU trial a node of its own: sharing is marked as placement would.)"""
    from ray.exceptions import OutOfMemoryError

    runner = behaviour_runner(tmp_path, slots=1)
    request_id = start(runner, 1, RUNS_UNTIL_STOPPED)
    wait_until_running(runner, 1)
    trial = runner.running.pop(request_id)
    trial.shared = shared
    killed = OutOfMemoryError("Task was killed due to the node running low on memory.")
    outcome = runner._host_memory_out(trial, killed)
    assert outcome.metrics == (
        {MEMORY_RAN_OUT: "host", RUN_ALONE: True} if shared else {MEMORY_RAN_OUT: "host"}
    )
    if shared:
        assert (outcome.status, outcome.cause) == (TrialStatus.ERROR, FailureCause.MACHINE)
        assert (outcome.error or "").startswith(
            "the host's memory ran out while other trials shared its node"
        )
    else:
        assert (outcome.status, outcome.cause) == (TrialStatus.OOM, FailureCause.CONFIG)
    assert_nothing_left(runner.results_dir)  # its processes were stopped, as Ray's kill would


def test_of_ranks_that_failed_together_the_one_that_failed_by_itself_speaks() -> None:
    """Both nodes ended within one look: the first node's error, a connection its peer closed,
    was the reason, and the peer's own failure was lost."""
    peer_gone = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:4"
    own = "ValueError: the real failure, on rank 1"
    failed = [{"status": "error", "error": peer_gone}, {"status": "error", "error": own}]
    assert speaking_rank(failed, None) == 1
    assert speaking_rank(failed, [0, 1]) == 1
    # The first node speaks where it failed by itself, or where nothing else failed by itself.
    assert speaking_rank([{"status": "oom", "error": "CUDA out of memory"}, failed[1]], None) == 0
    assert speaking_rank([failed[0], {"status": "completed", "error": None}], None) == 0
    # dsat stopped the first node after another ended: the other speaks, as before.
    stopped = {"status": "error", "error": "stopped by SIGTERM from outside dsat"}
    assert speaking_rank([stopped, failed[1]], [1]) == 1


PRINTS_THREADS = """
import os
print("threads", os.environ["OMP_NUM_THREADS"], "spin", os.environ.get("GOMP_SPINCOUNT"))
"""


def test_a_trials_processes_get_their_slots_threads_that_wait_briefly(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    """Each node's process: its slot's share of the node's CPUs, with libgomp's short spin (its
    default spin slowed steps 6-28x on a core another process kept busy)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "job.py").write_text(PRINTS_THREADS)
    runner = runner_for(tmp_path, model, ["python3", "job.py"], slots=2)
    request_id = start(runner, 1, 1)
    runner.wait()
    logs = runner.results_dir / "logs"
    expected = set(runner._threads().values())
    for log in (logs / f"001-{request_id[:8]}.log", logs / f"001-{request_id[:8]}-node1.log"):
        said = re.search(r"threads (\d+) spin (\S+)", log.read_text())
        assert said is not None and int(said[1]) in expected, log.read_text()
        assert said[2] == str(OPENMP_SPIN_TURNS)
