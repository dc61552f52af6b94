"""dsat's search on a Determined cluster, through Determined's own RemoteSearchRunner.

Tested at the client boundary: the fake master (fake_master.py) answers the HTTP calls that
``RemoteSearchRunner``, ``determined.experimental.client`` and the Core API checkpoint context
make; the cluster environment is a ``ClusterInfo`` object like the one a task container holds; the
trials' outcomes are scripted. The upload the search runner works in is the one dsat submitted.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import responses
from determined.common.api import bindings

from dsat.cli import main
from dsat.constants import REPORTED_AT_KEY
from dsat.results.directory import BEST_CONFIG_FILE, BEST_METRICS_FILE, SUMMARY_FILE, TRIALS_FILE
from dsat.runners.determined.search_runner import run
from dsat.runners.determined.searcher_adapter import UNREPORTED_ERROR
from dsat.search.method import DsatSearchMethod
from tests.conftest import copy_example
from tests.runners.fake_master import (
    MASTER,
    TOKEN,
    FailedOutsideReporting,
    FakeMaster,
    logged_in_environment,
    trial_cluster_info,
)

STAGE_CEILING = {1: 40, 2: 56, 3: 90}  # micro-batches above these run out of memory
STAGE_SPEED = {1: 1.0, 2: 1.15, 3: 0.8}
ERRORING_TRIAL = 3  # the third search trial crashes, whatever it runs


class ScriptedTrials:
    """Each trial's result from its hyperparameters, as the trial code would report it."""

    def __init__(self) -> None:
        self.search_trials = 0

    def __call__(self, hparams: dict[str, Any]) -> dict[str, Any]:
        overwrites = hparams["overwrite_deepspeed_args"]
        assert hparams["_use_dsat_mode"] is True
        if overwrites["autotuning"].get("model_info", {}).get("profile"):
            return {
                "num_params": 50_000_000,
                "trainable_num_params": 50_000_000,
                "activation_mem_per_gpu": 150_000_000,
                "gpu_mem": 16 * 2**30,
            }
        baseline = "zero_optimization" not in overwrites  # the user's own section, as submitted
        self.search_trials += 0 if baseline else 1
        if self.search_trials == ERRORING_TRIAL and not baseline:
            raise RuntimeError("NCCL timeout")
        mbs = overwrites["train_micro_batch_size_per_gpu"]
        stage = overwrites.get("zero_optimization", {"stage": 1})["stage"]  # the example's: 1
        if mbs > STAGE_CEILING[stage]:
            raise MemoryError("CUDA out of memory")
        throughput = STAGE_SPEED[stage] * 100 * mbs / (1 + mbs / 32)
        return {
            "throughput": throughput,
            "FLOPS_per_gpu": throughput * 1e9,
            "latency": 1 / throughput,
        }


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeMaster]:
    logged_in_environment(monkeypatch, tmp_path / "home")
    fake = FakeMaster(ScriptedTrials())
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        fake.install(mock)
        yield fake


def submitted_context(
    master: FakeMaster, tmp_path: Path, *flags: str, method: str = "asha"
) -> tuple[Path, int]:
    """Submit with the CLI, then unpack the upload as the search runner's working directory."""
    model_dir = tmp_path / "user" / "mlp"
    copy_example(model_dir)
    assert main([method, str(model_dir / "deepspeed.yaml"), str(model_dir), *flags]) == 0
    runner = master.experiments[-1]
    workdir = tmp_path / "task"
    for path, content in runner.files.items():
        target = workdir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    return workdir, runner.id


def core_context(
    monkeypatch: pytest.MonkeyPatch, storage: Path, runner_id: int, latest: str | None
) -> Any:
    """The search runner's Core API context and cluster info, as a task container has them."""
    from determined import _info, core
    from determined.common import api
    from determined.common.storage import SharedFSStorageManager

    info = trial_cluster_info(runner_id, latest_checkpoint=latest)
    monkeypatch.setattr(_info, "_info", info)
    distributed = core.DummyDistributedContext()
    session = api.Session(master=MASTER, username="determined", token=TOKEN, cert=None)
    checkpoint = core.CheckpointContext(
        distributed,
        SharedFSStorageManager(str(storage)),
        session,
        info.task_id,
        info.allocation_id,
        core.TensorboardMode.MANUAL,
        None,
        None,
    )
    return core.Context(checkpoint=checkpoint, distributed=distributed, info=info)


def run_search(
    master: FakeMaster,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    crash_at_post: int | None,
    down_for: float = 0.0,
) -> tuple[DsatSearchMethod, Path]:
    workdir, runner_id = submitted_context(
        master, tmp_path, "--max-trials", "16", "--metric", "throughput"
    )
    storage = tmp_path / "checkpoints"
    if crash_at_post is not None:
        master.crash_at_post = crash_at_post
        with pytest.raises(Exception, match="container died"):
            run(core_context(monkeypatch, storage, runner_id, None), workdir, runner_id)
        # Determined restarts the search runner in a fresh container from its latest checkpoint,
        # after ``down_for`` seconds (minutes, when it waits for a node).
        time.sleep(down_for)
        fresh = tmp_path / "task-restarted"
        shutil.copytree(workdir, fresh, ignore=shutil.ignore_patterns("dsat-results"))
        workdir = fresh
    latest = master.checkpoints[-1] if master.checkpoints else None
    method = run(core_context(monkeypatch, storage, runner_id, latest), workdir, runner_id)
    return method, storage / master.checkpoints[-1]


def trial_lines(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (directory / TRIALS_FILE).read_text().splitlines()]


def test_a_whole_search_runs_through_remote_search_runner(
    cluster: FakeMaster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    method, checkpoint = run_search(cluster, monkeypatch, tmp_path, crash_at_post=None)
    custom = cluster.experiments[-1]
    assert custom.config["searcher"] == {
        "name": "custom",
        "metric": "throughput",
        "smaller_is_better": False,
    }
    assert custom.config["description"].startswith(f"(#{cluster.experiments[0].id}) generated")
    assert custom.config["hyperparameters"]["_use_dsat_mode"] is True
    assert "train.py" in custom.files and "dsat/__init__.py" in custom.files  # trials import dsat
    assert cluster.final_state is not None and cluster.final_state.name == "COMPLETED"
    lines = trial_lines(checkpoint)
    confirmations = [line for line in lines if line["kind"] == "confirm"]
    searched = [line for line in lines if line["kind"] not in ("confirm", "baseline")]
    baselines = [line for line in lines if line["kind"] == "baseline"]
    # --max-trials, the model profile included, then the confirmation round of the 3 leaders;
    # the user's own config ran once on top, and the summary compares the hand-over with it
    assert len(searched) == 16 and len(confirmations) == 3 and len(baselines) == 1
    assert len(cluster.created_order) == 16 + 3 + 1
    assert "x your config" in (checkpoint / "summary.txt").read_text()
    # Why the hand-over won, as the local summary says it (the cluster's said nothing).
    assert f"handed over: {method.tracker.best().name}: " in (checkpoint / SUMMARY_FILE).read_text()
    statuses = [line["status"] for line in searched]
    assert statuses.count("error") >= 1 and "completed" in statuses
    completed = [
        line for line in searched if line["status"] == "completed" and line["kind"] == "search"
    ]
    # What is handed over is a leader the round ran again (ranked by the denoised estimate, not
    # necessarily the best single measurement), and the files hold that trial.
    best = method.tracker.best()
    assert best is not None
    assert method.tracker.confirmation_runs(best.request_id)
    (best_line,) = [line for line in completed if line["request_id"] == best.request_id]
    best_config = json.loads((checkpoint / BEST_CONFIG_FILE).read_text())
    assert "autotuning" not in best_config
    assert best_config["train_micro_batch_size_per_gpu"] == best_line["mbs"]
    assert best_config["zero_optimization"]["stage"] == best_line["zero_stage"]
    best_metrics = json.loads((checkpoint / BEST_METRICS_FILE).read_text())
    assert best_metrics == {**best_line["metrics"], "value": best_line["value"]}
    assert "| global" in (checkpoint / SUMMARY_FILE).read_text()
    assert not list(checkpoint.glob("*.pkl")) and not (checkpoint / "ops").exists()
    assert cluster.progress and cluster.progress[-1] == pytest.approx(1.0)
    # The baseline and the confirmation round count from the start: it read 100% before them.
    assert cluster.progress == sorted(cluster.progress) and cluster.progress.count(1.0) <= 5


DOWN_FOR = 1.5  # seconds the search runner is down before Determined restarts it


def test_a_restarted_search_runner_resumes_and_ends_as_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    results = {}
    began = time.time()
    for crash in (None, 9):
        master = FakeMaster(ScriptedTrials())
        with (
            pytest.MonkeyPatch.context() as patch,
            responses.RequestsMock(assert_all_requests_are_fired=False) as mock,
        ):
            logged_in_environment(patch, tmp_path / "home")
            master.install(mock)
            run_dir = tmp_path / f"crash-{crash}"
            method, checkpoint = run_search(master, patch, run_dir, crash, DOWN_FOR)
        best = method.tracker.best()
        assert best is not None
        results[crash] = (
            [master.trial_hparams[r] for r in master.created_order],
            json.loads((checkpoint / BEST_CONFIG_FILE).read_text()),
            [line["request_id"] for line in trial_lines(checkpoint)],
            len(master.checkpoints),
        )
        # Each row's time is its own, on the wall clock, across the restart: a trial that ran
        # on while the search runner restarted is counted from its start (the cost line adds
        # them up), and no row is shifted by the time before the restart.
        times = [(line["start"], line["end"]) for line in trial_lines(checkpoint)]
        assert all(began < start < end <= time.time() for start, end in times), times
        # A trial that ended while the search runner was down ended then, not at its restart:
        # each was timed to the restart, the downtime in every such row and in the cost.
        assert all(end - start < DOWN_FOR for start, end in times), times
        assert all(REPORTED_AT_KEY not in line["metrics"] for line in trial_lines(checkpoint))
    uninterrupted, restarted = results[None], results[9]
    assert restarted[0] == uninterrupted[0]  # the same trials, none created twice
    assert restarted[1] == uninterrupted[1]  # the same best config
    assert restarted[2] == uninterrupted[2]  # trials.jsonl carried across the restart
    assert restarted[3] > 1


def test_run_full_experiment_submits_the_users_experiment_with_the_best_overrides(
    cluster: FakeMaster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    workdir, runner_id = submitted_context(
        cluster, tmp_path, "--max-trials", "6", "--run-full-experiment"
    )
    method = run(core_context(monkeypatch, tmp_path / "ckpt", runner_id, None), workdir, runner_id)
    best = method.tracker.best()
    assert best is not None
    full = cluster.experiments[-1]
    assert full.config["searcher"]["name"] == "single"  # the user's own searcher
    assert full.config["name"] == "core-api-mlp"
    hparams = full.config["hyperparameters"]
    assert (
        "_use_dsat_mode" not in hparams and "autotuning" not in hparams["overwrite_deepspeed_args"]
    )
    assert hparams["overwrite_deepspeed_args"]["train_micro_batch_size_per_gpu"] == best.mbs
    assert "train.py" in full.files
    # A restart after the end does not submit it twice.
    experiments = len(cluster.experiments)
    latest = cluster.checkpoints[-1]
    run(core_context(monkeypatch, tmp_path / "ckpt", runner_id, latest), workdir, runner_id)
    assert len(cluster.experiments) == experiments


def test_a_runner_restarted_right_after_creating_the_full_experiment_creates_no_second(
    cluster: FakeMaster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: Any
) -> None:
    """The checkpoint after the creation failed (storage down a moment): the only record of
    the full experiment was lost, and the restarted runner created a second one, in silence."""
    workdir, runner_id = submitted_context(
        cluster, tmp_path, "--max-trials", "6", "--run-full-experiment"
    )
    cluster.checkpoint_fails_from = 3  # the search runner's, the trials', the full one
    with pytest.raises(Exception, match="storage unavailable"):
        run(core_context(monkeypatch, tmp_path / "ckpt", runner_id, None), workdir, runner_id)
    (full,) = cluster.experiments[2:]
    latest = cluster.checkpoints[-1]
    with caplog.at_level(logging.INFO):
        run(core_context(monkeypatch, tmp_path / "ckpt", runner_id, latest), workdir, runner_id)
    assert cluster.experiments[2:] == [full]
    assert f"the full experiment {full.id} with the best config was created before" in caplog.text
    assert f"dsat-full-run-of-{runner_id}" in full.config["labels"]


def test_a_search_whose_trials_a_user_kills_starts_no_full_experiment(
    cluster: FakeMaster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The search runner went on to create the full experiment with the best trial so far, and
    wrote no summary of what had run."""
    workdir, runner_id = submitted_context(
        cluster, tmp_path, "--max-trials", "12", "--run-full-experiment"
    )
    cluster.cancel_after_trials = 4
    method = run(core_context(monkeypatch, tmp_path / "ckpt", runner_id, None), workdir, runner_id)
    assert cluster.final_state is bindings.experimentv1State.CANCELED
    assert [e.config["searcher"]["name"] for e in cluster.experiments[1:]] == ["custom"]
    assert not method.finished
    summary = workdir / "dsat-results" / SUMMARY_FILE
    assert summary.is_file() and "| global" in summary.read_text()
    # ... and the checkpoint, which is what a user downloads, has it too, saying why it ended.
    said = (tmp_path / "ckpt" / cluster.checkpoints[-1] / SUMMARY_FILE).read_text()
    assert said.startswith(summary.read_text().split("\n")[0])
    experiment = cluster.experiments[1].id
    assert f"search stopped: the trials' experiment {experiment} was stopped from outside" in said


def test_a_trial_a_user_stops_ends_the_search_unconfirmed_with_no_full_experiment(
    cluster: FakeMaster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The search ended (as the reference's does), then went on to create the full experiment
    with an unconfirmed best, and counted the stopped trial as its configuration's error."""
    workdir, runner_id = submitted_context(
        cluster, tmp_path, "--max-trials", "12", "--run-full-experiment"
    )
    cluster.stopped_trial = 5
    method = run(core_context(monkeypatch, tmp_path / "ckpt", runner_id, None), workdir, runner_id)
    assert [e.config["searcher"]["name"] for e in cluster.experiments[1:]] == ["custom"]
    checkpoint = tmp_path / "ckpt" / cluster.checkpoints[-1]
    rows = trial_lines(checkpoint)
    (stopped,) = [line for line in rows if "USER_CANCELED" in (line["error"] or "")]
    assert stopped["cause"] == "machine"  # not its configuration's
    said = (checkpoint / SUMMARY_FILE).read_text()
    assert (
        "search stopped: a trial was stopped from outside the search (trial exited early: " in said
    )
    assert "unconfirmed" in said and method.tracker.confirmed_id is None


def test_the_search_runner_imports_only_what_a_task_image_has() -> None:
    """A zero-slot search runner container has determined, numpy and pyyaml, not DeepSpeed,
    torch or rich: the cluster entrypoint must not import them."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    blocked = ("deepspeed", "torch", "rich", "transformers")
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # importing it now raises ImportError\n"
        "import dsat.runners.determined.search_runner as entry\n"
        "print(entry.main.__name__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "main"


def test_the_entrypoint_refuses_to_run_off_cluster(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    result = subprocess.run(
        [sys.executable, "-m", "dsat.runners.determined.search_runner"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=120,
    )
    assert result.returncode == 2
    assert "runs inside a Determined trial" in result.stderr


def test_a_search_where_every_trial_fails_shuts_the_experiment_down_as_failed(
    cluster: FakeMaster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    scripted = ScriptedTrials()

    def everything_runs_out_of_memory(hparams: dict[str, Any]) -> dict[str, Any]:
        if hparams["overwrite_deepspeed_args"]["autotuning"].get("model_info", {}).get("profile"):
            return scripted(hparams)  # the model profile works
        raise MemoryError("CUDA out of memory")

    cluster.outcome = everything_runs_out_of_memory
    workdir, runner_id = submitted_context(cluster, tmp_path, "--max-trials", "8")
    method = run(core_context(monkeypatch, tmp_path / "ckpt", runner_id, None), workdir, runner_id)
    assert method.search_failed and method.tracker.best() is None
    assert cluster.final_state is not None and cluster.final_state.name == "ERROR"
    checkpoint = tmp_path / "ckpt" / cluster.checkpoints[-1]
    assert not (checkpoint / BEST_CONFIG_FILE).exists()
    assert {line["status"] for line in trial_lines(checkpoint)[1:]} == {"oom"}


def test_a_failed_model_profile_on_the_cluster_says_why_in_the_summary(
    cluster: FakeMaster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The reason the search ended was in the search runner's log alone: the checkpoint's
    summary had an empty table, "global batch: free" and the cost."""

    def the_profile_fails(hparams: dict[str, Any]) -> dict[str, Any]:
        raise KeyError("labels")

    cluster.outcome = the_profile_fails
    workdir, runner_id = submitted_context(cluster, tmp_path, "--max-trials", "8")
    method = run(core_context(monkeypatch, tmp_path / "ckpt", runner_id, None), workdir, runner_id)
    assert method.model_profile_failed()
    summary = (tmp_path / "ckpt" / cluster.checkpoints[-1] / SUMMARY_FILE).read_text()
    assert "handed over: nothing: the model-profile trial failed (micro-batch 1): " in summary
    assert "KeyError: 'labels'" in summary


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_a_script_error_in_every_trial_on_the_cluster_is_said_and_ends_the_search_early(
    cluster: FakeMaster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str
) -> None:
    """Determined says only 'errored' of a failed trial: every row's error was empty, and a
    script's bug in every trial ran the whole --max-trials on the cluster where the local runner
    stops after five alike. Raised inside dsat_reporting_context, the trial tells why; outside
    it, the row says where to look, and the search cannot tell the failures alike."""
    scripted = ScriptedTrials()

    def every_search_trial_fails(hparams: dict[str, Any]) -> dict[str, Any]:
        if hparams["overwrite_deepspeed_args"]["autotuning"].get("model_info", {}).get("profile"):
            return scripted(hparams)
        if where == "outside":
            raise FailedOutsideReporting("ImportError: no module named 'wandb'")
        raise KeyError("labels")

    cluster.outcome = every_search_trial_fails
    workdir, runner_id = submitted_context(
        cluster, tmp_path, "--max-trials", "12", "--max-concurrent-trials", "2"
    )
    method = run(core_context(monkeypatch, tmp_path / "ckpt", runner_id, None), workdir, runner_id)
    checkpoint = tmp_path / "ckpt" / cluster.checkpoints[-1]
    failed = [line for line in trial_lines(checkpoint)[1:] if line["status"] == "error"]
    assert failed and all(line["status"] == "error" for line in trial_lines(checkpoint)[1:])
    if where == "inside":
        assert all(line["error"] == "KeyError: 'labels'" for line in failed)
        assert {line["cause"] for line in failed} == {"unknown"}
        assert len(failed) < 10 and "failed alike" in (method.shutdown_reason or "")
    else:
        assert all(line["error"] == UNREPORTED_ERROR for line in failed)
        assert len(failed) == 12  # the search trials and the baseline: nothing says alike
    assert "KeyError" in (checkpoint / SUMMARY_FILE).read_text() or where == "outside"


def test_an_out_of_memory_trial_on_the_cluster_is_an_oom_and_lowers_the_ceiling(
    cluster: FakeMaster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Micro-batches above STAGE_CEILING raise an out-of-memory error in the scripted trials; the
    # trial reports it through dsat_reporting_context's path before the error ends it. The binary
    # search follows each outcome within its lineage, so the next trial shows the lowered ceiling.
    workdir, runner_id = submitted_context(
        cluster,
        tmp_path,
        "--max-trials",
        "8",
        "--max-concurrent-trials",
        "1",
        "--zero-stages",
        "1",
        method="binary",
    )
    method = run(core_context(monkeypatch, tmp_path / "ckpt", runner_id, None), workdir, runner_id)
    lines = trial_lines(tmp_path / "ckpt" / cluster.checkpoints[-1])
    searched = [line for line in lines if line["kind"] == "search"]  # not the user's baseline
    crashed = searched.pop(ERRORING_TRIAL - 1)  # one at a time: the trials finish in order
    assert crashed["status"] == "error"  # a crash stays an error, whatever its size
    over = [line for line in searched if line["mbs"] > STAGE_CEILING[line["zero_stage"]]]
    assert over and all(line["status"] == "oom" for line in over)
    assert all(line["error"].startswith("MemoryError: CUDA out of memory") for line in over)
    records = method.tracker.records
    followed = 0
    for oom in (r for r in records if r.status.value == "oom"):
        for child in (r for r in records if r.parent_id == oom.request_id):
            assert child.search_range is not None and child.search_range.hi < oom.mbs
            assert child.mbs < oom.mbs
            followed += 1
    assert followed >= 1  # the search went on below the size that ran out of memory
    best = method.tracker.best()
    assert best is not None and best.mbs <= STAGE_CEILING[1]


def test_a_gpu_failing_in_a_trial_on_the_cluster_is_the_machines_and_the_trial_runs_again(
    cluster: FakeMaster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The trial raised the ECC error inside dsat_reporting_context, which left it to
    Determined's 'errored': the search took the micro-batch for too large, capped its lineage
    below it and handed over a slower one; the configuration never ran again."""
    scripted = ScriptedTrials()
    failed_gpu: list[int] = []

    def second_search_trial_on_a_failing_gpu(hparams: dict[str, Any]) -> dict[str, Any]:
        overwrites = hparams["overwrite_deepspeed_args"]
        if "zero_optimization" in overwrites and not failed_gpu:
            if overwrites["autotuning"].get("model_info", {}).get("profile"):
                return scripted(hparams)
            if scripted.search_trials == 1:
                failed_gpu.append(overwrites["train_micro_batch_size_per_gpu"])
                raise RuntimeError("CUDA error: uncorrectable ECC error encountered")
        return scripted(hparams)

    cluster.outcome = second_search_trial_on_a_failing_gpu
    flags = ["--max-trials", "8", "--max-concurrent-trials", "1", "--zero-stages", "1"]
    workdir, runner_id = submitted_context(cluster, tmp_path, *flags, method="binary")
    method = run(core_context(monkeypatch, tmp_path / "ckpt", runner_id, None), workdir, runner_id)
    searched = [
        line
        for line in trial_lines(tmp_path / "ckpt" / cluster.checkpoints[-1])
        if line["kind"] == "search"
    ]
    failed, *again = [line for line in searched if line["mbs"] == failed_gpu[0]]
    assert (failed["status"], failed["cause"]) == ("error", "machine")
    assert failed["error"].startswith("the trial's GPU is failing, busy or not visible: ")
    # Run again, next in its lineage: the machine's fault says nothing of the configuration.
    assert [line["overwrites"] for line in again[:1]] == [failed["overwrites"]]
    assert again[0]["status"] == "completed"
    best = method.tracker.best()
    assert best is not None and best.mbs >= failed["mbs"]


@pytest.mark.parametrize("whose", ["trials", "full"])
def test_an_experiment_the_master_refuses_is_one_line_not_a_restart_that_fails_again(
    cluster: FakeMaster,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    whose: str,
) -> None:
    """A refusal (a resource pool the trials' config names that the cluster lacks) was a
    traceback, and Determined restarted the search runner to fail the same way each time."""
    flags = ["--max-trials", "8"] + (["--run-full-experiment"] if whose == "full" else [])
    workdir, runner_id = submitted_context(cluster, tmp_path, *flags)
    refusal = "resources.resource_pool: resource pool a100 does not exist"
    cluster.refuse_create = (400, refusal)
    # The search runner's experiment is there; the full run's comes after the trials' one.
    cluster.refuse_from = 2 if whose == "full" else 1
    monkeypatch.setattr(logging.getLogger("dsat"), "propagate", True)  # the CLI's turned off
    with caplog.at_level(logging.ERROR):
        method = run(
            core_context(monkeypatch, tmp_path / "ckpt", runner_id, None), workdir, runner_id
        )
    # One line (a parametrized run can leave the capture handler on twice: one message counts).
    errors = sorted({r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR})
    assert len(errors) == 1, errors
    experiment = "the trials' experiment" if whose == "trials" else "the full experiment"
    assert f"refused {experiment}: {refusal};" in errors[0]
    if whose == "trials":
        assert "deepspeed.yaml" in errors[0] and len(method.tracker) == 0
    else:
        assert method.tracker.best() is not None and BEST_CONFIG_FILE in errors[0]


def test_a_master_failing_for_now_restarts_the_search_runner(
    cluster: FakeMaster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A 5xx may pass: the search runner fails, and Determined restarts it."""
    workdir, runner_id = submitted_context(cluster, tmp_path, "--max-trials", "8")
    cluster.refuse_create = (503, "the master is restarting")
    with pytest.raises(Exception, match="restarting"):
        run(core_context(monkeypatch, tmp_path / "ckpt", runner_id, None), workdir, runner_id)
