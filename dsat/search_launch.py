"""From parsed settings to a running search: check everything, pick the runner, start it.

All checks that can fail on a user mistake run here, before a single trial starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import re
import shlex
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsat.constants import (
    CHECKPOINTING_HPARAM,
    ENV_RAY_ADDRESS,
    GRAD_ACCUM_STEPS,
    MICRO_BATCH_SIZE,
    OVERWRITE_KEY,
    RESULTS_ROOT,
    SETTINGS_FILE,
    STATE_FILE,
    TRAIN_BATCH_SIZE,
)
from dsat.errors import DsatError
from dsat.experiment.batch_size import batch_value, fixed_global_batch
from dsat.experiment.config import (
    HF_BATCH_FLAGS,
    Experiment,
    autotuning_enabled_note,
    check_entrypoint_launcher,
    check_entrypoint_script,
    check_hf_args_file,
    deep_merge,
    entrypoint_batch_flags,
    entrypoint_flag,
    entrypoint_words,
    full_run_length_note,
    load_experiment,
    load_yaml_mapping,
    searcher_length,
    validate_with_deepspeed,
)
from dsat.experiment.config_keys import unknown_key_notes
from dsat.experiment.settings import SearchSettings
from dsat.paths import shown
from dsat.process_limits import address_space_limit
from dsat.results.cost import search_cost
from dsat.results.directory import (
    FULL_RUN_DIR,
    HANDED_OVER_PREFIX,
    SUMMARY_FILE,
    TRIALS_FILE,
    best_ds_config,
    full_experiment_hparams,
    read_trial_rows,
)
from dsat.results.directory_lock import (
    LOCK_FILE,
    DirectoryInUse,
    refuse_if_in_use,
    results_directory_lock,
)
from dsat.results.report import write_report
from dsat.results.resume import (
    not_a_results_dir,
    python_command,
    read_saved_state,
    readable_state,
    refuse_changed_experiment,
    refuse_lost_rows,
    refuse_more_trials_when_finished,
    resume_command,
    saved_settings,
)
from dsat.results.writable import (
    COPIES_AT_START,
    RESULTS_FLOOR_BYTES,
    check_results_dir,
    files_bytes,
    tree_files,
    write_failure,
)
from dsat.runners import RunnerKind, resolve_runner
from dsat.runners.determined.submit import DeterminedSetup
from dsat.runners.local.entrypoint import check_program, strip_determined_launcher
from dsat.runners.local.full_run import FullExperimentFailed
from dsat.runners.local.runner import copy_ignore
from dsat.runners.local.setup import OPS_LOG, LocalSetup
from dsat.runners.ray.setup import RaySetup
from dsat.runners.simulated.setup import SimulatedSetup
from dsat.runners.trial_runner import EndedSearchRunner, RunnerSetup, RunnerStopped, TrialRunner
from dsat.search.baseline import (
    against_yours_said,
    baseline_run,
    describe,
    described_with_knobs,
    speedup_over_yours,
    times,
    yours_clearly_faster,
    yours_handed_over,
)
from dsat.search.ending import BUDGET_USED_UP
from dsat.search.fit_ladder import OFFLOADED, offload_level
from dsat.search.method import DsatSearchMethod
from dsat.search.trial_builder import SearchSpec
from dsat.search_run import best_config_path, resumes_without_trials, run_search, stops_held
from dsat.training.hf_args import HF_DS_FLAG, checkpointing_flags, switch_on
from dsat.training.step_clock import measured_window
from dsat.trial import TrialKind, TrialRecord, TrialStatus


class SearchFailed(Exception):
    """The search ran but found no working configuration (not a user mistake: exit status 1)."""


class SearchStopped(Exception):
    """The search cannot go on for a cause outside it: a results file could not be written (a
    full disk, a quota, a read-only file system), or the runner lost what trials need
    (``RunnerStopped``). Every trial was stopped, every one recorded before is kept (exit status
    1, as for a search that did not reach its end; not 2, the command was right, nor 130,
    nothing interrupted it)."""

    def __init__(self, why: str, remedy: str, method: str, results_dir: Path) -> None:
        what = f"stopped: {why}; every trial was stopped"
        recorded = recorded_trials(results_dir)
        if not (results_dir / STATE_FILE).is_file():
            message = f"{what} before any was recorded; {remedy}, then start the search again"
        elif not recorded:
            message = f"{what}; {remedy}, then resume with: {resume_command(method, results_dir)}"
        else:
            message = (
                f"{what}, and the {recorded} trial(s) recorded before are kept in "
                f"{shown(results_dir)}; {remedy}, then resume with: "
                f"{resume_command(method, results_dir)}"
            )
        super().__init__(message)


def spent(method: DsatSearchMethod, results_dir: Path) -> str:
    """What the recorded trials cost, for the last line (", 0.0424 CPU slot-hours"); empty when
    trials.jsonl cannot be read."""
    try:
        rows = read_trial_rows(results_dir / TRIALS_FILE)
    except (OSError, ValueError):
        return ""
    return f", {search_cost(rows, method.tracker.slots_per_trial).hours_text()}"


def recorded_trials(results_dir: Path) -> int:
    """The rows of ``results_dir``'s trials.jsonl (each written whole, atomically)."""
    try:
        return len(read_trial_rows(results_dir / TRIALS_FILE))
    except (OSError, ValueError):
        return 0


class SearchInterrupted(Exception):
    """Ctrl-C or SIGTERM: every trial was stopped and the state is saved for --resume (or
    ``said``: what else was stopped, and what to do)."""

    def __init__(self, method: str, results_dir: Path, said: str | None = None) -> None:
        if said is None and not (results_dir / STATE_FILE).is_file():
            said = (
                "interrupted before the first trial began; nothing was kept: run the same "
                "command again"
            )
        super().__init__(
            said
            or f"interrupted; every trial was stopped. Resume with: {resume_command(method, results_dir)}"
        )
        self.results_dir = results_dir


class FullRunInterrupted(Exception):
    """Ctrl-C or SIGTERM in the full run: it was stopped; the search's results stand."""

    def __init__(self, method: str, results_dir: Path) -> None:
        again = f"{resume_command(method, results_dir)} --run-full-experiment"
        super().__init__(
            f"interrupted; the full run was stopped, and the search's results are kept in "
            f"{shown(results_dir)} (best_ds_config.json). To train again: move "
            f"{shown(results_dir / FULL_RUN_DIR)} away if it is there, then {again}"
        )


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """A checked search, ready for its runner."""

    settings: SearchSettings
    experiment: Experiment
    runner: RunnerKind
    runner_reason: str
    results_dir: Path
    setup: RunnerSetup | DeterminedSetup
    notes: tuple[str, ...] = ()  # said before the search starts, each a line


def default_results_dir(experiment_name: str, now: datetime.datetime) -> Path:
    safe_name = re.sub(r"[^A-Za-z0-9._-]+", "-", experiment_name).strip("-.") or "experiment"
    stamp = now.astimezone(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path.cwd() / RESULTS_ROOT / f"{safe_name}-{stamp}"


RUNNER_SETUPS: dict[RunnerKind, type[LocalSetup | RaySetup | SimulatedSetup | DeterminedSetup]] = {
    RunnerKind.LOCAL: LocalSetup,
    RunnerKind.RAY: RaySetup,
    RunnerKind.SIMULATED: SimulatedSetup,
    RunnerKind.DETERMINED: DeterminedSetup,
}


def plan_search(
    settings: SearchSettings, environ: Mapping[str, str], now: datetime.datetime | None = None
) -> LaunchPlan:
    # First: a search running there is all there is to say (not its settings' faults, nor
    # "continue it with --resume", which its lock then refused).
    for flag, named in (("--resume", settings.resume), ("--results-dir", settings.results_dir)):
        if named is not None and Path(named).is_dir():
            refuse_if_in_use(Path(named), flag)
    if settings.resume is not None:
        for path, what in ((settings.config_path, "config"), (settings.model_dir, "MODEL_DIR")):
            if not Path(path).exists():
                raise DsatError(
                    f"--resume {shown(Path(settings.resume))}: the search's {what} {path} is not "
                    f"there any more; if the project moved, pass its new CONFIG_PATH and "
                    f"MODEL_DIR with --resume"
                )
    experiment = load_experiment(
        settings.config_path, settings.model_dir, settings.include, settings.global_batch
    )
    slots = experiment.slots_per_trial
    if settings.max_slots is not None and settings.max_slots < slots:
        raise DsatError(
            f"--max-slots {settings.max_slots} is less than resources.slots_per_trial {slots} in "
            f"{settings.config_path}; no trial could start"
        )
    validate_with_deepspeed(experiment.ds_config, slots, str(experiment.ds_config_path))
    if settings.search_runner_config is not None:
        load_yaml_mapping(Path(settings.search_runner_config), "--search-runner-config")
    runner, reason = resolve_runner(settings.runner, environ, settings.ray_address)
    if settings.resume is not None and settings.runner != "auto":
        reason = f"as the search ran ({SETTINGS_FILE})"
    elif settings.resume is None:
        # Saved as resolved: a resume from a shell without RAY_ADDRESS or DET_MASTER must not
        # carry the search on on this machine instead, nor on another cluster.
        address = settings.ray_address
        if runner is RunnerKind.RAY and address is None:
            address = environ.get(ENV_RAY_ADDRESS) or None
        settings = dataclasses.replace(settings, runner=runner.value, ray_address=address)
    if settings.simulator is not None and runner is not RunnerKind.SIMULATED:
        raise DsatError(
            f"--simulator only applies to --runner simulated (the runner is {runner.value})"
        )
    if settings.ray_address is not None and runner is not RunnerKind.RAY:
        raise DsatError(
            f"--ray-address only applies to --runner ray (the runner is {runner.value})"
        )
    # Accepted and ignored, these would leave the user trusting what does not happen there
    # (Determined's setup says its own words of the local runner's).
    only_for = [
        ("--search-runner-config", settings.search_runner_config is not None, "determined"),
        (
            "--max-search-runner-restarts",
            settings.max_search_runner_restarts is not None,
            "determined",
        ),
    ]
    if runner in (RunnerKind.RAY, RunnerKind.SIMULATED):
        only_for += [
            ("--fresh-processes", settings.fresh_processes, "local"),
            (
                "--trial-host" if settings.trial_host else "--no-trial-host",
                settings.trial_host is not None,
                "local",
            ),
        ]
    for flag, given, kind in only_for:
        if given and runner.value != kind:
            raise DsatError(
                f"{flag} only applies to --runner {kind} (the runner is {runner.value}); drop it"
            )
    notes = unknown_key_notes(experiment.config, str(settings.config_path))
    resources = experiment.config.get("resources")
    if (
        runner is not RunnerKind.DETERMINED
        and isinstance(resources, dict)
        and resources.get("max_slots") is not None
    ):  # Determined's cap on the slots an experiment holds, which only its cluster applies
        notes.append(
            f"dsat: note: {settings.config_path}: resources.max_slots is applied only on a "
            f"Determined cluster; the {runner.value} runner ignores it: cap the slots with "
            "--max-slots"
        )
    if settings.metric.smaller_is_better and settings.method != "guided":
        notes.append(
            f"dsat: note: --metric {settings.metric.value} is least at small micro-batches, and "
            f"{settings.method}'s binary searches climb the micro-batch after every trial that "
            "runs, as the reference's do: `guided` starts each stage at micro-batch 1"
        )
    kept = offload_level(experiment.ds_config.get("zero_optimization"))
    if settings.offload and kept:
        notes.append(
            f"dsat: note: {experiment.ds_config_path} keeps the {OFFLOADED[kept]}: every trial "
            "keeps as much of it as its ZeRO stage can (--offload adds offload to what the search "
            "tries, it never removes yours); to compare with less, remove it from your config"
        )
    if settings.run_full_experiment and runner is not RunnerKind.DETERMINED:
        length = full_run_length_note(experiment.config, str(settings.config_path))
        if length is not None:
            notes.append(length)
    enabled = autotuning_enabled_note(experiment.ds_config, str(experiment.ds_config_path))
    if enabled is not None:
        notes.append(f"dsat: note: {enabled}")
    if runner is not RunnerKind.SIMULATED:
        check_entrypoint_script(experiment)
        command = entrypoint_command(experiment)
        check_entrypoint_launcher(experiment, command)
        if runner is RunnerKind.LOCAL:  # a cluster's nodes have their own PATH, unseen from here
            check_program(
                command, experiment.model_dir, experiment.includes, str(experiment.config_path)
            )
        check_hf_args_file(experiment, command)
        check_hf_processes_on_cpu(experiment, runner, environ)
        check_entrypoint_steps(experiment, settings)
        for hf_note in (
            check_hf_global_batch(experiment, settings),
            hf_periodic_work_note(experiment, settings),
            hf_strict_json_note(experiment),
            checkpointing_switch_note(experiment),
        ):
            if hf_note is not None:
                notes.append(hf_note)
    if runner is RunnerKind.LOCAL:
        notes.extend(address_space_note(address_space_limit()))
    if runner is RunnerKind.LOCAL and settings.offload_nvme is not None:
        check_local_directory(settings.offload_nvme, "--offload-nvme")
    setup = RUNNER_SETUPS[runner].prepare(settings, experiment, environ)
    if settings.resume is not None:
        results_dir = Path(settings.resume)
        if not results_dir.is_dir():
            raise DsatError(f"--resume {results_dir}: {not_a_results_dir(results_dir)}")
        state = read_saved_state(results_dir, settings.method)
        refuse_changed_experiment(results_dir, search_spec(experiment), state)
        refuse_more_trials_when_finished(results_dir, state, settings.max_trials)
        refuse_lost_rows(results_dir, state)
    elif settings.results_dir is not None:
        results_dir = Path(settings.results_dir)
        if (results_dir / STATE_FILE).is_file():
            raise DsatError(held_search_said(results_dir, settings.method))
        refuse_others_files(results_dir)
    else:
        results_dir = default_results_dir(
            experiment.name, now or datetime.datetime.now(datetime.timezone.utc)
        )
        if results_dir.exists():  # a search that began in the same second
            results_dir = next_free_name(results_dir)
    # What every trial's copy of MODEL_DIR holds (the simulator copies nothing), walked once.
    copied = (
        []
        if runner is RunnerKind.SIMULATED
        else list(
            tree_files([experiment.model_dir, *experiment.includes], copy_ignore(results_dir))
        )
    )
    refuse_unreadable_files(copied)
    earlier = results_dir / FULL_RUN_DIR
    if settings.run_full_experiment and earlier.exists() and not earlier.is_dir():
        raise DsatError(  # found only once the run had trained: its files could not come back
            f"--run-full-experiment: {shown(earlier)} is not a directory, and the full run "
            "writes there; move it away, then run the same command again"
        )
    if settings.run_full_experiment and earlier.is_dir() and any(earlier.iterdir()):
        raise DsatError(  # a new full run starts from a fresh copy of MODEL_DIR there
            f"--run-full-experiment: {shown(earlier)} holds an earlier full run (what it wrote, "
            "checkpoints among them); move it away, then run the same command again"
        )
    if runner is not RunnerKind.DETERMINED:  # Determined's search keeps its results on the cluster
        named_by = (
            "--resume" if settings.resume else "--results-dir" if settings.results_dir else ""
        )
        check_results_dir(results_dir, named_by, room_needed(copied, setup))
    return LaunchPlan(settings, experiment, runner, reason, results_dir, setup, tuple(notes))


def entrypoint_command(experiment: Experiment) -> list[str]:
    """The command a trial runs, Determined's launch layer dropped; none where the entrypoint
    does not parse (the runner says so itself)."""
    return strip_determined_launcher(entrypoint_words(experiment.config.get("entrypoint")))


def search_spec(experiment: Experiment) -> SearchSpec:
    return SearchSpec(
        experiment.hparams,
        experiment.ds_config,
        experiment.slots_per_trial,
        experiment.config.get("entrypoint"),
    )


def check_local_directory(path: str, flag: str) -> None:
    """A directory this machine's trials write to: there, a directory, writable. (A cluster's
    nodes have their own disks, which dsat cannot see from here.)"""
    where = Path(path).expanduser()
    if not where.is_dir():
        what = "is not a directory" if where.exists() else "does not exist"
        raise DsatError(f"{flag} {path} {what}; give a directory on a fast local disk")
    if not os.access(where, os.W_OK | os.X_OK):
        raise DsatError(f"{flag} {path} is not writable; give a directory you can write to")


def room_needed(copied: list[Path], setup: RunnerSetup | DeterminedSetup) -> int:
    """The free bytes a search needs where its results go before it starts (``writable``):
    ``copied``, the files of a trial's copy of MODEL_DIR, are copied there per trial."""
    if not isinstance(setup, LocalSetup):  # the others copy no model dir into the results
        return RESULTS_FLOOR_BYTES
    return RESULTS_FLOOR_BYTES + COPIES_AT_START * files_bytes(copied)


# HF's TrainingArguments flag for the optimizer steps a run trains (-1: by epochs).
MAX_STEPS_FLAGS = ("--max_steps", "--max-steps")


def check_hf_processes_on_cpu(
    experiment: Experiment, runner: RunnerKind, environ: Mapping[str, str]
) -> None:
    """One line where an HF Trainer script's trials would run several processes on CPUs: the
    Trainer counts one process there whatever torchrun starts, and every trial, the model
    profile first, failed its batch check against the config dsat wrote ("ds
    train_batch_size=2 vs hf train_batch_size (calculated)=1")."""
    if experiment.slots_per_trial < 2 or runner is RunnerKind.DETERMINED:  # a cluster's own
        return
    if entrypoint_flag(experiment.config.get("entrypoint"), (HF_DS_FLAG,)) is None:
        return
    on_cpu = environ.get("DS_ACCELERATOR") == "cpu"
    if not on_cpu and runner is RunnerKind.LOCAL:
        from dsat.runners.local.slots import visible_gpus

        on_cpu = not visible_gpus(dict(environ))
    if on_cpu:
        raise DsatError(
            f"{experiment.config_path}: resources.slots_per_trial {experiment.slots_per_trial} "
            "for an HF Trainer script on CPUs: the Trainer counts one process there, whatever "
            "torchrun starts, and refuses every trial's batch; set slots_per_trial: 1"
        )


def check_entrypoint_steps(experiment: Experiment, settings: SearchSettings) -> None:
    """One line where the entrypoint's ``--max_steps`` (HF's Trainer) stops training before a
    trial's measured steps end: every trial failed with "training ended after N optimizer steps"."""
    given = entrypoint_flag(experiment.config.get("entrypoint"), MAX_STEPS_FLAGS)
    needed = measured_window(settings.start_profile_step, settings.end_profile_step)[1] + 1
    if given is not None and given.isdigit() and 0 < int(given) < needed:
        raise DsatError(
            f"{experiment.config_path}: the entrypoint passes --max_steps {given}, but a trial "
            f"measures up to optimizer step {needed} (dsat's window, which --start-profile-step "
            "and --end-profile-step move); "
            f"give --max_steps {needed} or more"
        )


# HF's TrainingArguments flags for work it does every N optimizer steps, in either spelling:
# (what it does, its strategy flags, the flag of its N, the strategies that do it by steps).
HF_PERIODIC_WORK = (
    ("evaluates", ("--eval_strategy", "--evaluation_strategy", "--eval-strategy",
                   "--evaluation-strategy"), ("--eval_steps", "--eval-steps"), ("steps",)),
    ("saves a checkpoint", ("--save_strategy", "--save-strategy"),
     ("--save_steps", "--save-steps"), ("steps", None)),  # HF saves by steps unless told not to
)  # fmt: skip


def checkpointing_switch_note(experiment: Experiment) -> str | None:
    """A note where the entrypoint turns activation checkpointing on itself while the
    hyperparameter says it is off: the fit ladder's checkpointing rung, which sets the
    hyperparameter, then changes nothing, and every trial checkpoints."""
    if experiment.hparams.get(CHECKPOINTING_HPARAM) is not False:
        return None
    words = entrypoint_words(experiment.config.get("entrypoint"))
    if not switch_on(words, f"--{CHECKPOINTING_HPARAM}"):
        return None
    return (
        f"dsat: note: {shown(experiment.config_path)}: hyperparameters.{CHECKPOINTING_HPARAM} is "
        f"false but the entrypoint passes --{CHECKPOINTING_HPARAM}: every trial checkpoints, and "
        "dsat's step of turning it on where the model does not fit changes nothing; drop the "
        "flag to let dsat turn it on only where needed, or the hyperparameter"
    )


def hf_strict_json_note(experiment: Experiment) -> str | None:
    """A note where an HF Trainer entrypoint's DeepSpeed JSON has comments or trailing commas:
    DeepSpeed reads them (hjson) and so does dsat, but HF's Trainer reads the file with Python's
    json and fails, so the user's own run fails where every trial (passed a merged, plain JSON)
    and the hand-over work."""
    if entrypoint_flag(experiment.config.get("entrypoint"), (HF_DS_FLAG,)) is None:
        return None
    try:
        json.loads(experiment.ds_config_path.read_text())
    except json.JSONDecodeError as err:
        return (
            f"dsat: note: {shown(experiment.ds_config_path)} is not plain JSON ({err.msg}: line "
            f"{err.lineno}, column {err.colno}): DeepSpeed and dsat read it, HF's Trainer does "
            "not, so your own run with it fails; the trials and best_ds_config.json are plain "
            "JSON"
        )
    except (OSError, UnicodeDecodeError):  # read once already: said there
        return None
    return None


def hf_periodic_work_note(experiment: Experiment, settings: SearchSettings) -> str | None:
    """A note where an HF Trainer entrypoint evaluates or saves every N steps, N within the
    steps a trial measures: that time counted in every trial's step times (eval every step read
    the FLOPS 100x low, and a noise of it "2.81x your config"), and each trial kept a checkpoint
    a step in its copy."""
    entrypoint = experiment.config.get("entrypoint")
    if entrypoint_flag(entrypoint, (HF_DS_FLAG,)) is None:
        return None
    needed = measured_window(settings.start_profile_step, settings.end_profile_step)[1] + 1
    found: list[str] = []
    for does, strategy_flags, steps_flags, by_steps in HF_PERIODIC_WORK:
        strategy = entrypoint_flag(entrypoint, strategy_flags)
        every = entrypoint_flag(entrypoint, steps_flags)
        if strategy in by_steps and every is not None and every.isdigit():
            if 0 < int(every) <= needed:
                found.append(f"{does} every {every} step(s) ({steps_flags[0]} {every})")
    if not found:
        return None
    return (
        f"dsat: note: {shown(experiment.config_path)}: the entrypoint {' and '.join(found)}, "
        f"within the {needed} optimizer steps a trial measures: that time counts in every "
        "trial's step times, and each trial keeps what it saves in its copy; give them more "
        "steps than that, or turn them off for the search (--eval_strategy no, --save_strategy no)"
    )


# What HF's TrainingArguments take when neither the flag nor the config gives the number.
HF_BATCH_DEFAULTS = {MICRO_BATCH_SIZE: 8, GRAD_ACCUM_STEPS: 1}


def check_hf_global_batch(experiment: Experiment, settings: SearchSettings) -> str | None:
    """One line where the DeepSpeed config's numeric ``train_batch_size`` is not what an HF
    Trainer entrypoint's batch flags make of it (its micro-batch x accumulation x slots, each
    from the config where it is a number, as ``get_hf_args_with_overwrites`` passes it, else
    from the flag): HF refuses that run ("mismatch TrainingArguments values"), so the user's
    own config, the baseline, is not what they run. Where a number is in neither, the script
    may set it in code, so HF's default is only a likely refusal: a note, returned, not an
    error. ``--global-batch`` replaces the batch on purpose."""
    entrypoint = experiment.config.get("entrypoint")
    if entrypoint_flag(entrypoint, (HF_DS_FLAG,)) is None:
        return None
    merged = deep_merge(experiment.ds_config, experiment.hparams.get(OVERWRITE_KEY) or {})
    source = str(experiment.ds_config_path)
    flags = entrypoint_batch_flags(entrypoint)
    for flag, key in HF_BATCH_FLAGS.items():
        # A number in both that differ: HF refuses the run, and the run of the user's config
        # (the baseline) measured the JSON's, which they never trained with.
        number, passed = batch_value(merged, key, source), flags.get(key)
        if number is not None and passed is not None and number != passed:
            raise DsatError(
                f"{shown(experiment.ds_config_path)}: {key} {number} is not the entrypoint's "
                f'{flag} {passed}, and HF refuses that run ("mismatch TrainingArguments '
                f'values"): make them agree, or set {key} to "auto"'
            )
    # A number in the JSON and no flag: HF's default, unless the script sets it in code.
    defaults = [
        f"{key} {number} against {flag}'s default {HF_BATCH_DEFAULTS[key]}"
        for flag, key in HF_BATCH_FLAGS.items()
        if (number := batch_value(merged, key, source)) is not None
        and key not in flags
        and number != HF_BATCH_DEFAULTS[key]
    ]
    if defaults and settings.global_batch is None:
        return (
            f"dsat: note: {shown(experiment.ds_config_path)}: {' and '.join(defaults)}, which "
            'your entrypoint does not pass: HF refuses that run ("mismatch TrainingArguments '
            'values") unless your script sets it in code; the trials and the run of your config '
            "pass the JSON's numbers themselves: pass the flag in your entrypoint, or set the key "
            'to "auto"'
        )
    batch = fixed_global_batch(merged, source)
    if settings.global_batch is not None or batch is None:
        return None
    given: dict[str, int] = {}
    unset: list[str] = []  # the flags whose number HF's default supplies
    for flag, key in HF_BATCH_FLAGS.items():
        number = batch_value(merged, key, source)
        if number is None:
            number = flags.get(key)
        if number is None:
            number = HF_BATCH_DEFAULTS[key]
            unset.append(f"{flag} (HF's default {number})")
        given[key] = number
    slots = experiment.slots_per_trial
    made = math.prod(given.values()) * slots
    if made == batch:
        return None
    micro, accumulation = given.values()
    makes = f"micro-batch {micro} x accumulation {accumulation} x {slots} slot(s) = {made}"
    if unset:
        return (
            f"dsat: note: {shown(experiment.ds_config_path)}: train_batch_size {batch} is not "
            f"what your HF Trainer run makes of it if your script leaves "
            f"{' and '.join(unset)} as they are ({makes}), and HF refuses that run; the "
            "trials and the run of your config set both numbers themselves"
        )
    raise DsatError(
        f"{shown(experiment.ds_config_path)}: train_batch_size {batch} is not what your "
        f"HF Trainer run makes of it, {makes} (--per_device_train_batch_size, "
        "--gradient_accumulation_steps, or the config's numbers), and HF refuses that run: "
        'make them agree, set train_batch_size to "auto", or pass --global-batch N'
    )


def held_search_said(results_dir: Path, method: str) -> str:
    """Why ``--results-dir`` cannot take a new search, with the search it holds as it is: the
    command that continues it named this command's method (``asha --resume`` of a guided
    search, refused in turn), and offered to continue a search that had ended."""
    with contextlib.suppress(DsatError):
        method = saved_settings(results_dir).method
    state = readable_state(results_dir)
    if state is not None and state.get("shutdown_reason") is not None:
        return (
            f"--results-dir {shown(results_dir)} already holds a search, which has ended (its "
            f"results stay there; `{resume_command(method, results_dir)}` shows them again); "
            "choose another directory"
        )
    return (
        f"--results-dir {shown(results_dir)} already holds a search; continue it with "
        f"`{resume_command(method, results_dir)}` or choose another directory"
    )


def refuse_unreadable_files(copied: list[Path]) -> None:
    """One line where a file every trial's copy of MODEL_DIR (and the includes) holds cannot be
    read: the first trial's copy failed on it, and was blamed on the results directory."""
    for path in copied:
        if not os.access(path, os.R_OK):
            raise DsatError(
                f"{shown(path)} cannot be read, and every trial runs in a copy of MODEL_DIR "
                "(and --include); make it readable by the user running dsat, or move it out"
            )
        special = special_file_kind(path)
        if special:  # a named pipe's upload to Determined waited for a writer for ever
            raise DsatError(
                f"{shown(path)} is {special}, not a file a copy of MODEL_DIR (and --include) "
                "can hold, and every trial runs in one; move it out"
            )


def special_file_kind(path: Path) -> str:
    """What ``path`` is where it is no regular file ("" where it is one, or a broken link)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return ""
    kinds = {
        stat.S_ISFIFO: "a named pipe",
        stat.S_ISSOCK: "a socket",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
    }
    return next((kind for test, kind in kinds.items() if test(mode)), "")


def refuse_others_files(results_dir: Path) -> None:
    """One line where ``--results-dir`` names a directory holding files a new search would write
    over or mix with: a project's folder (or MODEL_DIR itself, which a search would copy into
    itself), or an earlier search whose state is gone (its trials.jsonl would take the new
    search's rows beside its own, and best_ds_config.json would be replaced). What a search
    stopped before its first trial leaves (its settings.json, empty folders, the log of its
    DeepSpeed op build, which a kill -9 during the build leaves) is taken."""
    try:
        entries = [p for p in results_dir.iterdir() if p.name != LOCK_FILE]
    except OSError:  # not there yet, or not a directory: check_results_dir says which
        return
    # An empty folder holds nothing to lose (a search's logs/ made before its first trial).
    holding = sorted(p.name for p in entries if not (empty_folder(p) or only_ops_log(p)))
    if not holding:
        return
    ours = SETTINGS_FILE in holding and holds_dsat_settings(results_dir)
    if holding == [SETTINGS_FILE] and ours:
        return  # a search stopped before its first trial began
    if ours:
        raise DsatError(
            f"--results-dir {shown(results_dir)} holds an earlier search's files but not its "
            f"saved state ({STATE_FILE}), so that search cannot be resumed, and a new one would "
            "mix its trials with them: choose a new or empty directory"
        )
    names = ", ".join(holding[:3]) + (", ..." if len(holding) > 3 else "")
    raise DsatError(
        f"--results-dir {shown(results_dir)} already holds files that are not a dsat "
        f"search's ({names}); a search would write over them: choose a new or empty directory"
    )


def only_ops_log(path: Path) -> bool:
    """A search's ``logs/`` holding nothing but its DeepSpeed op build's log."""
    if path.name != "logs" or path.is_symlink() or not path.is_dir():
        return False
    return all(child.name == OPS_LOG and child.is_file() for child in path.iterdir())


def empty_folder(path: Path) -> bool:
    """A folder with no file anywhere inside it (a link is not followed: it counts as a file)."""
    if path.is_symlink() or not path.is_dir():
        return False
    return all(not p.is_file() and not p.is_symlink() for p in path.rglob("*"))


def holds_dsat_settings(results_dir: Path) -> bool:
    """Whether the settings.json in ``results_dir`` is a search's, as a resume reads it, not a
    file that shares its name (an editor's settings)."""
    try:
        saved_settings(results_dir)
    except (DsatError, OSError, ValueError):
        return False
    return True


def launch(settings: SearchSettings, environ: Mapping[str, str]) -> None:
    plan = plan_search(settings, environ)
    print(f"dsat: runner {plan.runner.value} ({plan.runner_reason})")
    if isinstance(plan.setup, DeterminedSetup):  # the search itself runs on the cluster
        print_experiment(plan, "results in the search runner's checkpoints")
        plan.setup.submit()
        return
    print_experiment(plan, f"results in {shown(plan.results_dir)}")
    flag = "--resume" if settings.resume else "--results-dir"
    # A directory dsat named itself that another search took first (one started in the same
    # second, with the same name): the search goes to the next name instead.
    chosen = settings.resume is None and settings.results_dir is None
    while True:
        try:
            with results_directory_lock(plan.results_dir, flag):
                if settings.resume is None and (plan.results_dir / STATE_FILE).is_file():
                    raise DirectoryInUse(  # another search began there since the plan was made
                        f"{flag} {shown(plan.results_dir)} already holds a search; choose another "
                        "directory"
                    )
                search_here(plan, ended_search_runner(plan) or open_runner(plan))
            return
        except DirectoryInUse:
            if not chosen:
                raise
            taken = plan.results_dir
            plan = dataclasses.replace(plan, results_dir=next_free_name(taken))
            print(
                f"dsat: {shown(taken)} was taken by a search started at the same time; results "
                f"in {shown(plan.results_dir)}"
            )


def next_free_name(path: Path) -> Path:
    """``path`` with the first suffix -2, -3, ... that names nothing yet."""
    number = 2
    while (path.parent / f"{path.name}-{number}").exists():
        number += 1
    return path.parent / f"{path.name}-{number}"


def address_space_note(limit: int | None) -> list[str]:
    """A line on the shell's address-space limit, which every local trial inherits: past it a
    trial cannot allocate at any configuration, which would read as a model too large."""
    if limit is None:
        return []
    return [
        f"dsat: note: this shell limits a process's address space to {limit / 2**30:.3g} GiB "
        "(`ulimit -v`), and every trial inherits it: a trial that needs more fails to allocate "
        "whatever its configuration (torch alone maps over 1 GiB; CUDA wants no limit); run "
        "`ulimit -v unlimited` first unless the limit is meant"
    ]


def print_experiment(plan: LaunchPlan, where_results_go: str) -> None:
    experiment = plan.experiment
    print(
        f"dsat: experiment {experiment.name!r}: DeepSpeed config "
        f"{shown(experiment.ds_config_path)}, {experiment.slots_per_trial} slot(s) per trial, "
        f"{where_results_go}"
    )
    if experiment.replaced_batch is not None:
        print(
            f"dsat: --global-batch {plan.settings.global_batch} replaces your batch "
            f"({experiment.replaced_batch}): every trial, "
            f"your config's own run (the baseline) and the hand-over train at "
            f"{plan.settings.global_batch}"
        )
    for note in plan.notes:
        print(note)


def ended_search_runner(plan: LaunchPlan) -> TrialRunner | None:
    """Where a resume runs no trial (the search had ended, and no full run is asked): a runner
    that opens nothing. A plain --resume of a Ray search needed its cluster up to write the
    report again; a local one built DeepSpeed's ops and waited for slots."""
    settings = plan.settings
    if settings.resume is None or settings.run_full_experiment:
        return None
    if plan.runner is RunnerKind.SIMULATED:  # nothing to open
        return None
    if not resumes_without_trials(settings, search_spec(plan.experiment), plan.results_dir):
        return None
    return EndedSearchRunner()


def moved_project(settings: SearchSettings, results_dir: Path) -> bool:
    """Whether a resume names another CONFIG_PATH or MODEL_DIR than the search saved."""
    try:
        saved = saved_settings(results_dir)
    except DsatError:
        return False
    return any(
        Path(getattr(saved, key)).resolve() != Path(getattr(settings, key)).resolve()
        for key in ("config_path", "model_dir")
    )


def open_runner(plan: LaunchPlan) -> TrialRunner:
    """The runner, ready for trials. Ctrl-C while it gets ready (DeepSpeed's ops building, slots
    another search holds) said only "interrupted", and a new search's directory was left
    holding the build's log, which a second try refused as files that are not a search's."""
    assert not isinstance(plan.setup, DeterminedSetup)  # its search runs on the cluster
    try:
        return plan.setup.open(plan.results_dir)
    except KeyboardInterrupt:
        settings = plan.settings
        if settings.resume is not None:
            again = resume_command(settings.method, plan.results_dir)
            if moved_project(settings, plan.results_dir):
                # Saved once a trial starts: the command without them resumed the old copy.
                again += " " + shlex.join(
                    shown(Path(p)) for p in (settings.config_path, settings.model_dir)
                )
            what = "interrupted before the search went on (no trial had started)"
            if settings.run_full_experiment:
                again += " --run-full-experiment"  # without it, that command trains nothing
                if resumes_without_trials(settings, search_spec(plan.experiment), plan.results_dir):
                    what = (
                        "interrupted before the full run started; the search had ended and is kept"
                    )
            raise SearchInterrupted(
                settings.method, plan.results_dir, f"{what}; resume with: {again}"
            ) from None
        logs = plan.results_dir / "logs"
        with contextlib.suppress(OSError):
            (logs / OPS_LOG).unlink()
            logs.rmdir()  # the lock's end then removes the directory it made
        raise SearchInterrupted(
            settings.method,
            plan.results_dir,
            "interrupted before the first trial (while the runner got ready); nothing was "
            "kept: run the same command again",
        ) from None


def search_here(plan: LaunchPlan, runner: TrialRunner) -> None:
    """The search on this machine with ``runner``, then its report and the full run if asked."""
    settings = plan.settings
    experiment = plan.experiment
    if runner.takes_real_time:
        print(f"dsat: if stopped, resume with: {resume_command(settings.method, plan.results_dir)}")
    spec = search_spec(experiment)
    closed = False
    try:
        method = run_search(settings, spec, runner, plan.results_dir)
    except KeyboardInterrupt:
        # A second Ctrl-C while the trials stop (a Ray node takes seconds) stops the waiting,
        # not the message: what is left of the trials dies with dsat (their guards, Ray).
        with contextlib.suppress(KeyboardInterrupt):
            runner.stop_all()
        # A third, in the runner's close, ended dsat with a bare "interrupted" and no resume
        # line: what is left to do is short, and is done with every stop signal ignored.
        with stops_held(replay=False):
            interrupted = SearchInterrupted(settings.method, plan.results_dir)
            closed = True
            runner.close()
        raise interrupted from None
    except OSError as err:  # wherever the search was writing: the results files, a trial's copy
        failure = write_failure(err, plan.results_dir)
        if failure is None:
            raise
        runner.stop_all()
        why = f"cannot write {shown(failure.path)} ({failure.reason})"
        raise SearchStopped(why, failure.remedy(), settings.method, plan.results_dir) from None
    except RunnerStopped as err:
        raise SearchStopped(err.why, err.remedy, settings.method, plan.results_dir) from None
    finally:
        if not closed:
            runner.close()
    trains = plan.runner is not RunnerKind.SIMULATED
    try:
        report_end(method, plan.results_dir, settings.run_full_experiment, trains)
    except SearchFailed as err:
        if settings.resume is None:
            raise
        # Resumed after the fix its reason asked for, it said the same and ran nothing.
        again = shlex.join(
            [python_command(), "-m", "dsat", settings.method]
            + [shown(Path(p)) for p in (settings.config_path, settings.model_dir)]
        )
        raise SearchFailed(
            f"{err}; a failed search stays failed when resumed: once that is fixed, start a new "
            f"one: {again}"
        ) from None
    except KeyboardInterrupt:
        again = resume_command(settings.method, plan.results_dir)
        raise SearchInterrupted(
            settings.method,
            plan.results_dir,
            "interrupted while the report was written; the search had ended and is kept: "
            f"{again} writes the report and shows the hand-over again",
        ) from None
    if settings.run_full_experiment:
        best = method.tracker.best()
        assert best is not None  # report_end raised SearchFailed otherwise
        if yours_clearly_faster(method):
            print(
                "dsat: note: your own config measured faster than the hand-over, by more than "
                "the noise; the full run trains with the hand-over, as asked"
            )
        hparams = full_run_hparams(method, best, plan.results_dir)
        try:
            runner.run_full_experiment(
                hparams,
                searcher_length(plan.experiment.config, full_run_batch(hparams, best, method)),
            )
        except KeyboardInterrupt:
            raise FullRunInterrupted(settings.method, plan.results_dir) from None
        except FullExperimentFailed as err:  # the training failed: how to train again, as Ctrl-C's
            again = f"{resume_command(settings.method, plan.results_dir)} --run-full-experiment"
            earlier = plan.results_dir / FULL_RUN_DIR
            move = f"move {shown(earlier)} away, then " if earlier.exists() else ""
            raise FullExperimentFailed(
                f"{err}; to train again once it is fixed: {move}{again}"
            ) from None
        except OSError as err:
            failure = write_failure(err, plan.results_dir)
            if failure is None:
                raise
            raise FullExperimentFailed(
                f"full experiment not run: cannot write {shown(failure.path)} ({failure.reason}); "
                "the search's results are kept"
            ) from None
        except RunnerStopped as err:
            again = f"{resume_command(settings.method, plan.results_dir)} --run-full-experiment"
            raise FullExperimentFailed(
                f"full experiment not run: {err.why}; the search's results are kept: {err.remedy}, "
                f"then {again}"
            ) from None


def batch_in_file(path: Path, best: TrialRecord) -> tuple[int, int]:
    """The micro-batch and accumulation best_ds_config.json holds now (the hand-over's where it
    is gone, unreadable or leaves them out): the HF flags the last lines give must agree with
    the file they name, which the user may have edited, or HF refuses the run."""
    found = [best.mbs, best.gas]
    with contextlib.suppress(OSError, ValueError):
        on_disk = json.loads(path.read_text())
        if isinstance(on_disk, dict):
            for i, key in enumerate((MICRO_BATCH_SIZE, GRAD_ACCUM_STEPS)):
                value = on_disk.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    found[i] = value
    return found[0], found[1]


def full_run_batch(hparams: Mapping[str, Any], best: TrialRecord, method: DsatSearchMethod) -> int:
    """The global batch the full run trains with: best_ds_config.json's, as it is now."""
    overwrites = hparams.get(OVERWRITE_KEY)
    given = overwrites.get(TRAIN_BATCH_SIZE) if isinstance(overwrites, Mapping) else None
    if isinstance(given, int) and given > 0:
        return given
    return best.mbs * best.gas * method.spec.slots_per_trial


def full_run_hparams(
    method: DsatSearchMethod, best: TrialRecord, results_dir: Path
) -> dict[str, Any]:
    """The hand-over's hyperparameters for the full run, with best_ds_config.json as it is now:
    the last lines tell the user to train "with it", so their edit of it counts (and is said)."""
    hparams = full_experiment_hparams(best)
    path = best_config_path(results_dir)
    try:
        on_disk = json.loads(path.read_text())
    except FileNotFoundError:
        return hparams
    except (OSError, ValueError) as err:
        raise DsatError(
            f"{shown(path)}: cannot read it as JSON ({err}); fix it, or delete it to train with "
            "the handed-over config"
        ) from None
    if not isinstance(on_disk, dict):
        raise DsatError(f"{shown(path)}: not a JSON object; fix it, or delete it")
    if on_disk != best_ds_config(best, method.spec.ds_config):
        # DeepSpeed's own check first, as of the user's config at launch: an edit it rejects
        # ended the full run in DeepSpeed's traceback.
        try:
            validate_with_deepspeed(on_disk, method.spec.slots_per_trial, str(shown(path)))
        except DsatError as err:
            raise DsatError(f"{err}; or delete it to train with the handed-over config") from None
        print(f"dsat: the full run trains with {shown(path)} as it is now (edited since written)")
        hparams[OVERWRITE_KEY] = on_disk
    return hparams


def report_end(
    method: DsatSearchMethod, results_dir: Path, full_run: bool = False, trains: bool = True
) -> None:
    """Print the summary; a search with no successful trial is an error for the caller."""
    summary = results_dir / SUMMARY_FILE
    if summary.is_file():
        text = summary.read_text()
        if method.search_failed:  # why is the last line on screen (SearchFailed): said once
            nothing = f"{HANDED_OVER_PREFIX} nothing: "
            text = "".join(x for x in text.splitlines(True) if not x.startswith(nothing))
        print(text, end="")
    # A failed search's reason is its last line, once (SearchFailed).
    ended = "" if method.search_failed else f"; search ended: {method.shutdown_reason}"
    if not method.search_failed and method.shutdown_reason is None:  # never meant to happen
        ended = "; the search stopped without a reason to end (dsat's bug: please report it)"
    count = len(method.tracker.finished)
    print(f"dsat: {count} trial{'' if count == 1 else 's'}{spent(method, results_dir)}{ended}")
    try:
        png, page = write_report(results_dir)
        print(f"dsat: report: {shown(png)}, {shown(page)}")
    except DsatError as err:  # matplotlib is optional: the search itself is done
        print(f"dsat: no report drawn: {err}")
    except OSError as err:  # as is the report, when the disk is full by now
        print(f"dsat: no report drawn: cannot write it ({err.strerror or err})")
    if method.search_failed:
        raise SearchFailed(f"{method.failure_reason()}{all_out_of_memory_fix(method)}")
    for line in closing_lines(method, results_dir, full_run, trains):
        print(line)


def all_out_of_memory_fix(method: DsatSearchMethod) -> str:
    """What to do where every search trial ran out of memory: the reference's methods start
    their binary searches at --search-range-factor times the memory model's estimate, and a
    large factor spent the whole budget above what fits, with no word of the flag."""
    tracker = method.tracker
    searched = [r for r in tracker.finished if r.kind is TrialKind.SEARCH]
    if not searched or any(r.status is not TrialStatus.OOM for r in searched):
        return ""
    stages = method.settings.zero_stages
    factor = method.settings.search_range_factor
    fixes = []
    if method.name != "guided" and factor > 1:
        fixes.append(f"lower --search-range-factor ({factor:g} here)")
    yours = baseline_run(method)
    if (
        yours is not None
        and yours.status is TrialStatus.COMPLETED
        and yours.zero_stage not in stages
    ):
        listed = " ".join(str(s) for s in sorted({*stages, yours.zero_stage}))
        fixes.append(
            f"search the stage your config ran at ({describe(yours)}): --zero-stages {listed}"
        )
    elif max(stages) < 3:
        fixes.append("add higher stages to --zero-stages")
    if (method.shutdown_reason or "").startswith(BUDGET_USED_UP):  # not the space
        fixes.append("raise --max-trials")
    fixes.append("give each trial more GPUs (resources.slots_per_trial)")
    return "; " + ", or ".join(fixes)


def closing_lines(
    method: DsatSearchMethod, results_dir: Path, full_run: bool, trains: bool = True
) -> list[str]:
    """The last lines a user reads: what was found (and how much faster than their own config,
    where that ran), the file to train with, and what to do next (a full run where the runner
    ``trains``: the simulated one cannot)."""
    best = method.tracker.best()
    assert best is not None  # a search that found nothing failed above
    found = described_with_knobs(best)
    # The fit ladder's switch is a hyperparameter, which best_ds_config.json cannot carry: a
    # user training with the lines below alone ran without it, as the profile that ran out of
    # memory did.
    checkpointing = (
        best.hparams.get(CHECKPOINTING_HPARAM) is True
        and method.spec.hparams.get(CHECKPOINTING_HPARAM) is not True
    )
    if checkpointing:
        found += ", with activation checkpointing"
    speedup = speedup_over_yours(method)
    if speedup is not None and yours_handed_over(method):
        found += ": your own config; nothing faster that this search could hand over ran"
    elif speedup is not None:
        metric = method.tracker.metric
        # A time metric's speed-up as the summary says it: "1.71x your config's latency" of a
        # latency that fell read as slower.
        found += (
            f": {times(speedup)} as fast as your config by {metric.value}"
            if metric.smaller_is_better
            else f": {times(speedup)} your config's {metric.value}"
        )
        said = against_yours_said(method)
        if said:
            found += f"; {said}"
    path = shown(best_config_path(results_dir))
    if entrypoint_flag(method.spec.entrypoint, (HF_DS_FLAG,)) is not None:
        # HF's Trainer checks its batch flags against the JSON and refuses a mismatch.
        micro, accumulation = batch_in_file(best_config_path(results_dir), best)
        use = (
            f"train with {HF_DS_FLAG} {shlex.quote(path)} --per_device_train_batch_size "
            f"{micro} --gradient_accumulation_steps {accumulation}"
            + "".join(
                f" {flag} true"
                for flag in (
                    checkpointing_flags(entrypoint_words(method.spec.entrypoint))
                    if checkpointing
                    else []
                )
            )
            + " (HF refuses flags that differ from it)"
        )
    else:
        use = f"pass it as your DeepSpeed config (deepspeed.initialize(..., config={path!r}))"
        if checkpointing:
            use += (
                f" with activation checkpointing on (hyperparameter {CHECKPOINTING_HPARAM}: true), "
                "which it needs to fit"
            )
    if full_run:
        nxt = "the full training run with it starts now"
    elif yours_clearly_faster(method) and (yours := baseline_run(method)) is not None:
        # It recommended the file that measured slower, right after "keep it". Said as its run
        # measured it: with --global-batch replacing the user's batch, that run was not the
        # config they train with.
        nxt = (
            f"keep training with your own config's settings as its run measured them "
            f"({described_with_knobs(yours)}), which measured faster; the file above holds "
            "the best this search could hand over, should a longer search not beat yours either"
        )
    elif not trains:
        nxt = use
    else:
        nxt = (
            f"{use}, or have dsat train with it: "
            f"{resume_command(method.settings.method, results_dir)} --run-full-experiment"
        )
        earlier = results_dir / FULL_RUN_DIR
        if earlier.is_dir() and any(earlier.iterdir()):  # that command refuses it otherwise
            nxt += f" (move {shown(earlier)} away first: it holds the last full run)"
    return [
        f"dsat: found {found}",
        f"dsat: best DeepSpeed config: {path}",
        f"dsat: next: {nxt}",
    ]
