"""The last lines a user reads: how to train with what was handed over, as their script takes it."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from dsat.cli import parse_settings
from dsat.constants import OVERWRITE_KEY, SETTINGS_FILE
from dsat.experiment.config import load_experiment
from dsat.paths import shown
from dsat.results.resume import resume_command
from dsat.runners import RunnerKind
from dsat.runners.local.full_run import FullExperimentFailed
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.runners.simulated.setup import SimulatedSetup
from dsat.runners.trial_runner import RunnerStopped, StoppedRun
from dsat.search.trial_builder import SearchSpec
from dsat.search_launch import (
    FullRunInterrupted,
    LaunchPlan,
    SearchInterrupted,
    SearchStopped,
    closing_lines,
    open_runner,
    plan_search,
    search_here,
    search_spec,
)
from dsat.search_run import run_search
from tests.search.helpers import cliff_function, search_settings

USER = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}}
SIMULATED = Path(__file__).resolve().parents[1] / "examples" / "simulated"


@pytest.mark.parametrize(
    ("entrypoint", "how"),
    [
        ("python3 train.py", "pass it as your DeepSpeed config (deepspeed.initialize(..., config="),
        (
            "python3 train.py --deepspeed ds.json --per_device_train_batch_size 4",
            "train with --deepspeed {path} --per_device_train_batch_size {mbs} "
            "--gradient_accumulation_steps {gas} (HF refuses flags that differ from it)",
        ),
        # DeepSpeed's own arguments (deepspeed.add_config_arguments): a bare --deepspeed switch.
        (
            "python3 train.py --deepspeed --deepspeed_config ds.json",
            "pass it as your DeepSpeed config (deepspeed.initialize(..., config=",
        ),
    ],
)
def test_the_next_step_is_said_as_the_users_script_takes_a_config(
    tmp_path: Path, entrypoint: str, how: str
) -> None:
    """An HF Trainer checks --per_device_train_batch_size and --gradient_accumulation_steps
    against the JSON and refuses a mismatch: passing the file alone, with the flags the user ran
    with, fails."""
    spec = SearchSpec({"deepspeed_config": "ds.json"}, USER, 1, entrypoint)
    settings = search_settings("guided", max_trials=8, zero_stages=(1,))
    method = run_search(settings, spec, SimulatedRunner(cliff_function(24), 1), tmp_path)
    best = method.tracker.best()
    assert best is not None
    path = tmp_path / "best_ds_config.json"
    expected = how.format(path=path, mbs=best.mbs, gas=best.gas)
    next_line = closing_lines(method, tmp_path, full_run=False)[2]
    assert next_line.startswith(f"dsat: next: {expected}"), next_line
    assert next_line.endswith("--run-full-experiment")
    assert (
        closing_lines(method, tmp_path, full_run=False, trains=False)[2]
        == (next_line.split(", or have dsat train with it")[0])
    )
    if "--per_device_train_batch_size" in how:
        # Edited by hand, then shown again (a plain --resume): the flags it gave contradicted
        # the file they named, the mismatch HF refuses.
        edited = {**json.loads(path.read_text()), "train_micro_batch_size_per_gpu": 2}
        path.write_text(json.dumps(edited))
        again = closing_lines(method, tmp_path, full_run=False)[2]
        assert f"--per_device_train_batch_size 2 --gradient_accumulation_steps {best.gas}" in again
    # After a full run, that command is refused until its directory is moved: said up front.
    (tmp_path / "full-experiment").mkdir()
    (tmp_path / "full-experiment" / "checkpoint").write_text("x")
    after = closing_lines(method, tmp_path, full_run=False)[2]
    assert after.endswith(
        f"(move {tmp_path / 'full-experiment'} away first: it holds the last full run)"
    )


def test_the_next_step_quotes_a_path_the_shell_would_split(tmp_path: Path) -> None:
    """Pasted as printed, `--deepspeed sp res/best_ds_config.json` passed the script three words."""
    entrypoint = "python3 train.py --deepspeed ds.json --per_device_train_batch_size 4"
    spec = SearchSpec({"deepspeed_config": "ds.json"}, USER, 1, entrypoint)
    settings = search_settings("guided", max_trials=8, zero_stages=(1,))
    results = tmp_path / "sp res ü"
    method = run_search(settings, spec, SimulatedRunner(cliff_function(24), 1), results)
    next_line = closing_lines(method, results, full_run=False)[2]
    quoted = shlex.quote(str(results / "best_ds_config.json"))
    assert f"--deepspeed {quoted} --per_device_train_batch_size" in next_line
    assert quoted.startswith("'")


class FullRunStoppedByCtrlC(SimulatedRunner):
    """A runner whose full run the user stops with Ctrl-C (a real one streams its output then)."""

    def run_full_experiment(self, hparams: dict[str, Any], length: int | None = None) -> None:
        raise KeyboardInterrupt


def test_ctrl_c_in_the_full_run_says_it_was_stopped_and_how_to_train_again(tmp_path: Path) -> None:
    """It printed "dsat: interrupted" alone, though the search had ended and its results stood."""
    experiment = load_experiment(SIMULATED / "gpt2_large.yaml", SIMULATED)
    settings = search_settings("binary", max_trials=20, run_full_experiment=True)
    runner = FullRunStoppedByCtrlC(cliff_function(24), experiment.slots_per_trial)
    setup = SimulatedSetup(cliff_function(24), experiment.slots_per_trial)
    plan = LaunchPlan(settings, experiment, RunnerKind.LOCAL, "test", tmp_path / "r", setup)
    with pytest.raises(FullRunInterrupted) as raised:
        search_here(plan, runner)
    assert str(raised.value) == (
        f"interrupted; the full run was stopped, and the search's results are kept in "
        f"{tmp_path / 'r'} (best_ds_config.json). To train again: move "
        f"{tmp_path / 'r' / 'full-experiment'} away if it is there, then "
        f"{resume_command('binary', tmp_path / 'r')} --run-full-experiment"
    )
    assert (tmp_path / "r" / "best_ds_config.json").is_file()


class TrainingFails(SimulatedRunner):
    """A runner whose full run's training exits non-zero, as the local and Ray runners say it
    (having written its files back into ``wrote``, where given)."""

    wrote: Path | None = None

    def run_full_experiment(self, hparams: dict[str, Any], length: int | None = None) -> None:
        if self.wrote is not None:
            self.wrote.mkdir(parents=True)
        raise FullExperimentFailed(
            "the full experiment with the best config exited with code 1; its log is x.log"
        )


@pytest.mark.parametrize("wrote", [True, False])
def test_a_full_run_that_fails_says_how_to_train_again(tmp_path: Path, wrote: bool) -> None:
    """Ctrl-C's line gave the command that trains again; a crashed run's did not. A run that
    left nothing in the results dir (its node lost on Ray) was told to move it away."""
    experiment = load_experiment(SIMULATED / "gpt2_large.yaml", SIMULATED)
    settings = search_settings("binary", max_trials=20, run_full_experiment=True)
    runner = TrainingFails(cliff_function(24), experiment.slots_per_trial)
    setup = SimulatedSetup(cliff_function(24), experiment.slots_per_trial)
    results = tmp_path / "r"
    runner.wrote = results / "full-experiment" if wrote else None
    plan = LaunchPlan(settings, experiment, RunnerKind.RAY, "test", results, setup)
    with pytest.raises(FullExperimentFailed) as raised:
        search_here(plan, runner)
    move = f"move {results / 'full-experiment'} away, then " if wrote else ""
    assert str(raised.value) == (
        "the full experiment with the best config exited with code 1; its log is x.log; to "
        f"train again once it is fixed: {move}"
        f"{resume_command('binary', results)} --run-full-experiment"
    )


class InterruptedOften(SimulatedRunner):
    """A search the user stops with Ctrl-C at its third trial, then presses Ctrl-C again and
    again while it stops: one more lands as the runner closes."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.started = 0

    def start(self, *args: Any, **kwargs: Any) -> None:
        self.started += 1
        if self.started == 3:
            raise KeyboardInterrupt
        super().start(*args, **kwargs)

    def stop_all(self) -> list[StoppedRun]:
        os.kill(os.getpid(), signal.SIGINT)  # the second: it cuts the waiting short
        time.sleep(0.1)
        return []

    def close(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        super().close()


def test_ctrl_c_pressed_again_and_again_while_the_search_stops_keeps_its_resume_line(
    tmp_path: Path,
) -> None:
    """A Ctrl-C that landed in the runner's close ended dsat with a bare "interrupted"."""
    experiment = load_experiment(SIMULATED / "gpt2_large.yaml", SIMULATED)
    settings = search_settings("binary", max_trials=20)
    runner = InterruptedOften(cliff_function(24), experiment.slots_per_trial)
    setup = SimulatedSetup(cliff_function(24), experiment.slots_per_trial)
    plan = LaunchPlan(settings, experiment, RunnerKind.LOCAL, "test", tmp_path / "r", setup)
    with pytest.raises(SearchInterrupted) as raised:
        search_here(plan, runner)
    assert f"Resume with: {resume_command('binary', tmp_path / 'r')}" in str(raised.value)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # as it was


class ResultsRemovedMidSearch(SimulatedRunner):
    """The user removes the results dir while the search runs (its third trial starts)."""

    def __init__(self, results: Path, *args: Any) -> None:
        super().__init__(*args)
        self.results, self.started = results, 0

    def start(self, *args: Any, **kwargs: Any) -> None:
        self.started += 1
        if self.started == 3:
            shutil.rmtree(self.results)
        super().start(*args, **kwargs)


def test_a_results_dir_removed_mid_search_can_still_be_resumed(tmp_path: Path) -> None:
    """The rest was written again as trials ended, but not settings.json: the resume command
    the last lines gave was refused ("no saved search there")."""
    from dsat.cli import main

    results = tmp_path / "r"
    settings = parse_settings([*SIMULATED_ARGV, "--results-dir", str(results)])
    experiment = load_experiment(SIMULATED / "gpt2_large.yaml", SIMULATED)
    runner = ResultsRemovedMidSearch(results, cliff_function(4096), experiment.slots_per_trial)
    run_search(settings, search_spec(experiment), runner, results)
    assert (results / SETTINGS_FILE).is_file()
    assert main(["asha", "--resume", str(results)]) == 0


class FullRunRecorded(SimulatedRunner):
    """A runner that keeps what its full run would train with."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.trained: list[dict[str, Any]] = []

    def run_full_experiment(self, hparams: dict[str, Any], length: int | None = None) -> None:
        self.trained.append(hparams)


def test_the_full_run_trains_with_best_ds_config_json_as_the_user_left_it(tmp_path: Path) -> None:
    """The last lines say "or have dsat train with it: ... --resume DIR --run-full-experiment":
    the resume put the handed-over config back over the user's edit, and trained without it."""
    experiment = load_experiment(SIMULATED / "gpt2_large.yaml", SIMULATED)
    results = tmp_path / "r"
    settings = search_settings("binary", max_trials=20)
    setup = SimulatedSetup(cliff_function(24), experiment.slots_per_trial)
    plan = LaunchPlan(settings, experiment, RunnerKind.LOCAL, "test", results, setup)
    search_here(plan, FullRunRecorded(cliff_function(24), experiment.slots_per_trial))
    path = results / "best_ds_config.json"
    handed_over = json.loads(path.read_text())
    edited = {**handed_over, "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}}
    path.write_text(json.dumps(edited))
    resumed = dataclasses.replace(settings, run_full_experiment=True, resume=str(results))
    runner = FullRunRecorded(cliff_function(24), experiment.slots_per_trial)
    search_here(dataclasses.replace(plan, settings=resumed), runner)
    assert json.loads(path.read_text()) == edited  # left as the user left it
    assert runner.trained[-1][OVERWRITE_KEY] == edited
    # Unedited (or deleted), it is the handed-over trial's own overrides, as before.
    path.unlink()
    search_here(dataclasses.replace(plan, settings=resumed), runner)
    assert json.loads(path.read_text()) == handed_over
    assert (
        runner.trained[-1][OVERWRITE_KEY]["train_micro_batch_size_per_gpu"]
        == (handed_over["train_micro_batch_size_per_gpu"])
    )
    assert (
        OVERWRITE_KEY in runner.trained[-1] and "optimizer" not in runner.trained[-1][OVERWRITE_KEY]
    )


SIMULATED_ARGV = [
    "asha",
    str(SIMULATED / "gpt2_large.yaml"),
    str(SIMULATED),
    "--runner",
    "simulated",
    "--simulator",
    "dsat.runners.simulated.performance_models:gpt2_large_16xv100",
    "--max-trials",
    "6",
]


def test_ctrl_c_while_the_runner_gets_ready_keeps_nothing_and_says_to_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C during DeepSpeed's op build said only "interrupted", and left the directory
    holding the build's log, which the same command then refused as not a search's files."""
    from dsat.cli import main
    from dsat.runners.local.setup import OPS_LOG

    opened = SimulatedSetup.open

    def building(self: SimulatedSetup, results_dir: Path) -> Any:
        (results_dir / "logs").mkdir()
        (results_dir / "logs" / OPS_LOG).write_text("building deepspeed_shm_comm\n")
        raise KeyboardInterrupt

    argv = [*SIMULATED_ARGV, "--results-dir", str(tmp_path / "r")]
    monkeypatch.setattr(SimulatedSetup, "open", building)
    assert main(argv) == 130
    assert capsys.readouterr().err.strip() == (
        "dsat: interrupted before the first trial (while the runner got ready); nothing was "
        "kept: run the same command again"
    )
    assert not (tmp_path / "r").exists()
    monkeypatch.setattr(SimulatedSetup, "open", opened)
    assert main(argv) == 0  # the same command again


def test_ctrl_c_before_the_full_run_of_an_ended_search_says_the_command_that_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While it waited for slots another search held, it said "no trial had started" and a
    command without --run-full-experiment: one that only writes the report again."""
    from dsat.cli import main

    results = tmp_path / "r"
    assert main([*SIMULATED_ARGV, "--results-dir", str(results)]) == 0

    def waiting(self: SimulatedSetup, results_dir: Path) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(SimulatedSetup, "open", waiting)
    # The simulator trains nothing, so the flag is refused before this point: it is set past it.
    plan = plan_search(parse_settings(["asha", "--resume", str(results)]), {})
    plan = dataclasses.replace(
        plan, settings=dataclasses.replace(plan.settings, run_full_experiment=True)
    )
    with pytest.raises(SearchInterrupted) as stopped:
        open_runner(plan)
    assert str(stopped.value) == (
        "interrupted before the full run started; the search had ended and is kept; "
        f"resume with: {resume_command('asha', results)} --run-full-experiment"
    )


def test_ctrl_c_before_a_moved_projects_resume_goes_on_names_its_new_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new CONFIG_PATH and MODEL_DIR are saved once a trial starts: the command it gave
    (without them) resumed the old copy of the project."""
    import shutil

    from dsat.cli import main

    results = tmp_path / "r"
    assert main([*SIMULATED_ARGV, "--results-dir", str(results)]) == 0
    moved = tmp_path / "moved"
    shutil.copytree(SIMULATED, moved)

    def waiting(self: SimulatedSetup, results_dir: Path) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(SimulatedSetup, "open", waiting)
    config = moved / "gpt2_large.yaml"
    plan = plan_search(
        parse_settings(["asha", "--resume", str(results), str(config), str(moved)]), {}
    )
    with pytest.raises(SearchInterrupted) as stopped:
        open_runner(plan)
    assert str(stopped.value).endswith(
        f"resume with: {resume_command('asha', results)} {shown(config)} {shown(moved)}"
    )


def test_ctrl_c_while_the_report_is_written_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said only "interrupted": no hand-over, no report, and no word that --resume gives
    both."""
    import dsat.search_launch
    from dsat.cli import main

    reported = dsat.search_launch.report_end

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    results = tmp_path / "r"
    monkeypatch.setattr(dsat.search_launch, "report_end", interrupted)
    assert main([*SIMULATED_ARGV, "--results-dir", str(results)]) == 130
    again = resume_command("asha", results)
    assert capsys.readouterr().err.strip() == (
        "dsat: interrupted while the report was written; the search had ended and is kept: "
        f"{again} writes the report and shows the hand-over again"
    )
    monkeypatch.setattr(dsat.search_launch, "report_end", reported)
    assert main(["asha", "--resume", str(results)]) == 0
    assert "best DeepSpeed config" in capsys.readouterr().out
    assert (results / "report.html").is_file()


def test_ctrl_c_before_the_first_trial_began_offers_no_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stopped while the search worked out its plan, it said "Resume with: --resume DIR", and
    that resume answered that no search was saved there. The same command again is taken."""
    from dsat.cli import main
    from dsat.runners.driver import SearchDriver

    driven = SearchDriver.run

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    results = tmp_path / "r"
    monkeypatch.setattr(SearchDriver, "run", interrupted)
    argv = [*SIMULATED_ARGV, "--results-dir", str(results)]
    assert main(argv) == 130
    assert capsys.readouterr().err.strip() == (
        "dsat: interrupted before the first trial began; nothing was kept: run the same command "
        "again"
    )
    assert (results / SETTINGS_FILE).is_file()  # written as the search began
    monkeypatch.setattr(SearchDriver, "run", driven)
    assert main(argv) == 0


class ClusterShrinks(SimulatedRunner):
    """A runner whose cluster loses the nodes a trial needs after ``after`` trials."""

    def __init__(self, *args: Any, after: int) -> None:
        super().__init__(*args)
        self.after = after
        self.waited = 0

    def wait(self) -> Any:
        self.waited += 1
        if self.waited > self.after:
            raise RunnerStopped(
                "the Ray cluster can no longer place a trial (a node left)", "add nodes"
            )
        return super().wait()

    def run_full_experiment(self, hparams: dict[str, Any], length: int | None = None) -> None:
        raise RunnerStopped(
            "the Ray cluster can no longer place a trial (a node left)", "add nodes"
        )


@pytest.mark.parametrize("after", [0, 3])
def test_a_runner_that_cannot_go_on_stops_the_search_with_the_command_that_resumes_it(
    tmp_path: Path, after: int
) -> None:
    """It was a usage error (exit 2) saying "--resume DIR", no command to paste."""
    experiment = load_experiment(SIMULATED / "gpt2_large.yaml", SIMULATED)
    settings = search_settings("binary", max_trials=20)
    runner = ClusterShrinks(cliff_function(24), experiment.slots_per_trial, after=after)
    setup = SimulatedSetup(cliff_function(24), experiment.slots_per_trial)
    results = tmp_path / "r"
    plan = LaunchPlan(settings, experiment, RunnerKind.RAY, "test", results, setup)
    with pytest.raises(SearchStopped) as raised:
        search_here(plan, runner)
    said = str(raised.value)
    assert said.startswith(
        "stopped: the Ray cluster can no longer place a trial (a node left); every trial was "
        "stopped"
    )
    assert said.endswith(f"add nodes, then resume with: {resume_command('binary', results)}")
    assert (f"the {after} trial(s) recorded before are kept in {results}" in said) is (after > 0)


def test_a_full_run_the_runner_cannot_place_keeps_the_search_and_says_how_to_train(
    tmp_path: Path,
) -> None:
    experiment = load_experiment(SIMULATED / "gpt2_large.yaml", SIMULATED)
    settings = search_settings("binary", max_trials=20, run_full_experiment=True)
    runner = ClusterShrinks(cliff_function(24), experiment.slots_per_trial, after=10**6)
    setup = SimulatedSetup(cliff_function(24), experiment.slots_per_trial)
    plan = LaunchPlan(settings, experiment, RunnerKind.RAY, "test", tmp_path / "r", setup)
    with pytest.raises(FullExperimentFailed) as raised:
        search_here(plan, runner)
    assert str(raised.value) == (
        "full experiment not run: the Ray cluster can no longer place a trial (a node left); the "
        "search's results are kept: add nodes, then "
        f"{resume_command('binary', tmp_path / 'r')} --run-full-experiment"
    )
    assert (tmp_path / "r" / "best_ds_config.json").is_file()


def test_resources_max_slots_off_a_cluster_is_said_to_be_ignored(tmp_path: Path) -> None:
    """Determined's cap on an experiment's slots, from a YAML written for a cluster: the local
    runner ran every slot the machine had without a word."""
    from tests.conftest import write_experiment

    path = write_experiment(
        tmp_path / "m", config={"resources": {"slots_per_trial": 1, "max_slots": 4}}
    )
    model = "dsat.runners.simulated.performance_models:gpt2_large_16xv100"
    simulated = ["--runner", "simulated", "--simulator", model]
    plan = plan_search(parse_settings(["asha", str(path), str(path.parent), *simulated]), {})
    (note,) = [n for n in plan.notes if "max_slots" in n]
    assert "resources.max_slots is applied only on a Determined cluster" in note
    assert note.endswith("--max-slots")


@pytest.mark.parametrize("offload", [True, False])
def test_offload_asked_of_a_config_that_offloads_says_its_offload_stays(
    tmp_path: Path, offload: bool
) -> None:
    """--offload of a config that offloads the optimizer never tried without: the search's
    "offload nothing" was merged into the user's section, and nothing said so."""
    from tests.conftest import write_experiment

    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    path = write_experiment(
        tmp_path / "m", ds_config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
    )
    model = "dsat.runners.simulated.performance_models:gpt2_large_16xv100"
    argv = ["asha", str(path), str(path.parent), "--runner", "simulated", "--simulator", model]
    plan = plan_search(parse_settings([*argv, *(["--offload"] if offload else [])]), {})
    said = [n for n in plan.notes if "keeps the optimizer states on the CPU" in n]
    assert len(said) == offload
    if offload:
        assert said[0].endswith("to compare with less, remove it from your config")


@pytest.mark.parametrize(
    ("method", "metric", "said"),
    [("binary", "latency", True), ("guided", "latency", False), ("asha", "throughput", False)],
)
def test_a_time_metric_with_a_method_that_climbs_the_micro_batch_is_said_at_launch(
    method: str, metric: str, said: bool
) -> None:
    """binary and asha with --metric latency climbed to large micro-batches and handed over a
    config slower than the user's own, with no word of why."""
    model = "dsat.runners.simulated.performance_models:gpt2_large_16xv100"
    argv = [method, str(SIMULATED / "gpt2_large.yaml"), str(SIMULATED), "--metric", metric]
    plan = plan_search(parse_settings([*argv, "--runner", "simulated", "--simulator", model]), {})
    notes = [n for n in plan.notes if "is least at small micro-batches" in n]
    assert len(notes) == said
    if said:
        assert notes[0].endswith("`guided` starts each stage at micro-batch 1")


def test_an_edited_hand_over_deepspeed_rejects_is_one_line_before_the_full_run(
    tmp_path: Path,
) -> None:
    """best_ds_config.json edited to micro-batch 8 x accumulation 2 beside train_batch_size 24:
    the full run started and ended in DeepSpeed's traceback ("24 != 8 * 2 * 1")."""
    from dsat.errors import DsatError
    from dsat.search_launch import full_run_hparams
    from tests.results.test_directory import search

    method = search(tmp_path)
    best = method.tracker.best()
    assert best is not None
    path = tmp_path / "best_ds_config.json"
    edited = json.loads(path.read_text())
    edited["gradient_accumulation_steps"] = 2 * int(edited.get("gradient_accumulation_steps", 1))
    path.write_text(json.dumps(edited))
    with pytest.raises(DsatError) as err:
        full_run_hparams(method, best, tmp_path)
    said = str(err.value)
    assert "best_ds_config.json: train_batch_size " in said and " != " in said
    assert said.endswith("; or delete it to train with the handed-over config")


def test_an_hf_script_of_several_processes_on_cpus_is_one_line_before_any_trial(
    tmp_path: Path,
) -> None:
    """HF's Trainer counts one process on CPUs whatever torchrun starts: the model profile
    failed its batch check ("ds train_batch_size=2 vs hf ... (calculated)=1"), on the local
    runner and on Ray, and the search ended there, blaming the config dsat wrote."""
    from dsat.errors import DsatError
    from dsat.experiment.config import load_experiment
    from dsat.runners import RunnerKind
    from dsat.search_launch import check_hf_processes_on_cpu
    from tests.conftest import write_experiment

    hf = {"entrypoint": "python3 train.py --deepspeed ds_config.json"}
    two = write_experiment(tmp_path / "two", config={**hf, "resources": {"slots_per_trial": 2}})
    experiment = load_experiment(two, two.parent)
    for runner in (RunnerKind.LOCAL, RunnerKind.RAY):
        with pytest.raises(DsatError, match="for an HF Trainer script on CPUs: the Trainer "):
            check_hf_processes_on_cpu(experiment, runner, {"DS_ACCELERATOR": "cpu"})
    check_hf_processes_on_cpu(experiment, RunnerKind.DETERMINED, {"DS_ACCELERATOR": "cpu"})
    one = write_experiment(tmp_path / "one", config=hf)  # one process: fine
    check_hf_processes_on_cpu(
        load_experiment(one, one.parent), RunnerKind.RAY, {"DS_ACCELERATOR": "cpu"}
    )
