"""Carrying on an interrupted search: the settings it ran with, its saved state, and the command
that resumes it.

A resumed search runs with the settings saved in its results directory, whatever defaults the
command line would bring; a flag given again with another value is refused, except the few that
change how much runs rather than what the search decides (``ADJUSTABLE_ON_RESUME``).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsat.atomic_file import write_text_atomic
from dsat.constants import SETTINGS_FILE, STATE_FILE
from dsat.errors import DsatError
from dsat.experiment.settings import SearchSettings
from dsat.paths import absolute, shown
from dsat.results.directory import TRIALS_FILE, full_run_log, read_trial_rows
from dsat.search.method_state import STATE_VERSION, experiment_changes
from dsat.search.trial_builder import SearchSpec
from dsat.trial import TrialRecord, TrialStatus

# Settings a resumed search may change: how many trials, how many at once, how long each may run,
# how trial processes start, where the Ray cluster is, and whether a full run follows. Everything
# else decides which trials the search proposes.
ADJUSTABLE_ON_RESUME = (
    # Where the project is now (it moved, or another node mounts it elsewhere): what it holds
    # must be what the search began with, which the state's fingerprint of it checks.
    "config_path",
    "model_dir",
    "max_trials",
    "max_slots",
    "max_concurrent_trials",
    "trial_timeout",
    "fresh_processes",
    "trial_host",
    "ray_address",
    "run_full_experiment",
)
FINISHED = {status.value for status in TrialStatus if status.finished}
PATH_KEYS = ("config_path", "model_dir", "results_dir", "search_runner_config")


def stored_settings(settings: SearchSettings, results_dir: Path) -> SearchSettings:
    """What ``settings.json`` keeps: the settings the search runs with, naming its directory."""
    return dataclasses.replace(settings, results_dir=str(results_dir), resume=None)


def write_settings(settings: SearchSettings, results_dir: Path) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    stored = stored_settings(settings, results_dir)
    write_text_atomic(results_dir / SETTINGS_FILE, stored.to_json() + "\n")


def not_a_results_dir(path: Path) -> str:
    """Why ``path`` (not a directory) cannot be resumed, in words."""
    if path.exists():
        return "a file, not a results directory; pass the directory a search wrote"
    return "no such results directory"


def report_still_draws(results_dir: Path) -> str:
    """Where a search cannot be resumed but its trials were kept, that they can still be seen."""
    if not (results_dir / TRIALS_FILE).is_file():
        return ""
    return f"; `dsat report {shown(results_dir)}` still draws its trials"


def saved_settings(results_dir: Path) -> SearchSettings:
    """The settings an interrupted search ran with, or one line naming what is wrong."""
    path = results_dir / SETTINGS_FILE
    if not path.is_file():
        raise DsatError(
            f"--resume {shown(results_dir)}: no saved search there ({SETTINGS_FILE} is missing)"
            f"{report_still_draws(results_dir)}"
        )
    try:
        return SearchSettings.from_json(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError) as err:
        raise DsatError(
            f"{shown(path)}: damaged search settings ({err}); this search cannot be resumed, "
            "start a new one"
        ) from None
    except DsatError as err:
        if "unknown keys" in str(err):  # a setting this dsat does not have
            raise DsatError(
                f"{shown(path)}: {err} (written by a newer dsat, or edited); resume it with the "
                "dsat that began it, or start a new search"
            ) from None
        raise DsatError(
            f"{shown(path)}: damaged search settings ({err}); start a new search"
        ) from None


def _normalised(key: str, value: Any) -> Any:
    if key in PATH_KEYS and value is not None:
        return absolute(value)
    if key == "include":
        return tuple(absolute(p) for p in value)
    if key == "zero_stages":
        return tuple(sorted(set(value)))
    return value


def resumed_settings(
    method: str, given: Mapping[str, Any], resume_dir: str, flag_names: Mapping[str, str]
) -> SearchSettings:
    """The saved settings of the search in ``resume_dir``, with the values ``given`` again on the
    command line applied where that is safe; any other change is one line naming the flag."""
    results_dir = Path(absolute(resume_dir))
    if "results_dir" in given and absolute(given["results_dir"]) != str(results_dir):
        raise DsatError("--resume DIR already names the results directory; drop --results-dir")
    if not results_dir.is_dir():
        raise DsatError(f"--resume {resume_dir}: {not_a_results_dir(results_dir)}")
    saved = saved_settings(results_dir)
    if method != saved.method:
        raise DsatError(
            f"--resume {resume_dir}: that search ran `{saved.method}`, not `{method}`; resume it "
            f"with `{resume_command(saved.method, results_dir)}`"
        )
    moved = [key for key in ("config_path", "model_dir") if key in given]
    if len(moved) == 1:  # the other was paired silently with the saved one
        raise DsatError(
            f"--resume {resume_dir} with {flag_names.get(moved[0], moved[0])} alone: pass both "
            "CONFIG_PATH and MODEL_DIR where the project moved, or neither"
        )
    for key in moved:
        if not Path(given[key]).exists():
            raise DsatError(f"{flag_names.get(key, key)} {given[key]}: not found")
    changes: dict[str, Any] = {}
    for key, value in given.items():
        if key in ("method", "resume", "results_dir"):  # checked above, or not a setting
            continue
        flag = flag_names.get(key, key)
        now, before = _normalised(key, value), getattr(saved, key)
        if key == "metric":
            before = before.value
        if now == before:
            continue
        if key == "global_batch" and before is None:
            # Not "differs from the saved search's (not set)" of the very batch it kept.
            raise DsatError(
                f"{flag} {_display(value)}: the saved search ran without it (a batch it kept is "
                "your config's train_batch_size, and stays so); drop it"
            )
        if key not in ADJUSTABLE_ON_RESUME and not _moved_includes(key, now, before):
            differs = (
                f"{flag} differs from how the saved search ran"
                if isinstance(value, bool)  # a switch: its value says nothing to the user
                else f"{flag} {_display(value)} differs from the saved search's {_display(before)}"
            )
            raise DsatError(
                f"{differs} (its {SETTINGS_FILE}); a resumed search keeps its settings: "
                f"drop {flag}, or start a new search"
            )
        changes[key] = now
    if saved.run_full_experiment and "run_full_experiment" not in given:
        # Asked once, trained once: a plain resume after the full run does not train again.
        if full_run_log(results_dir).is_file():
            changes["run_full_experiment"] = False
    resumed = dataclasses.replace(saved, resume=str(results_dir), results_dir=None, **changes)
    return resumed.with_absolute_paths()


def _moved_includes(key: str, now: Any, before: Any) -> bool:
    """Whether ``--include`` names the same files, by name and order, in another place (the
    project moved with them, as CONFIG_PATH and MODEL_DIR may)."""
    return key == "include" and [Path(p).name for p in now] == [Path(p).name for p in before]


def _display(value: Any) -> str:
    if value is None:
        return "(not set)"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) or "(none)"
    return str(value)


def readable_state(results_dir: Path) -> dict[str, Any] | None:
    """The search state saved in ``results_dir`` as it is, with its tracker; None where there is
    none, or none to read (for what only describes a search: ``read_saved_state`` checks it)."""
    try:
        state = json.loads((results_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not isinstance(state.get("tracker"), dict):
        return None
    return state


def read_saved_state(results_dir: Path, method: str) -> dict[str, Any]:
    """The search state saved in ``results_dir``, checked to be readable and this method's."""
    path = results_dir / STATE_FILE
    if not path.is_file():
        raise DsatError(
            f"--resume {shown(results_dir)}: no saved search there ({STATE_FILE} is missing; "
            f"start a new search){report_still_draws(results_dir)}"
        )
    try:
        state: Any = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DsatError(
            f"{shown(path)}: damaged search state ({err}); this search cannot be resumed, start a "
            "new one"
        ) from None
    tracker = state.get("tracker") if isinstance(state, dict) else None
    if not isinstance(tracker, dict) or not isinstance(tracker.get("records"), list):
        raise DsatError(f"{shown(path)}: not a dsat search state; start a new search")
    version = state.get("version")
    if isinstance(version, int) and version > STATE_VERSION:
        raise DsatError(
            f"{shown(path)}: written by a newer dsat (state version {version}, this one reads "
            f"{STATE_VERSION}); resume it with that dsat"
        )
    if state.get("method") != method:
        raise DsatError(
            f"{shown(path)}: the saved search is {state.get('method')!r}, not {method!r} "
            f"(its {SETTINGS_FILE} and state disagree); start a new search"
        )
    return dict(state)


def refuse_changed_experiment(
    results_dir: Path, spec: SearchSpec, state: Mapping[str, Any]
) -> None:
    """Its trials would be ranked with others made from another experiment."""
    changed = experiment_changes(spec, dict(state))
    if changed:
        raise DsatError(
            f"--resume {shown(results_dir)}: the experiment changed since the search began "
            f"({', '.join(changed)}); put it back as it was, or start a new search"
        )


def refuse_more_trials_when_finished(
    results_dir: Path, state: Mapping[str, Any], max_trials: int
) -> None:
    """A search that has ended (handed over, in its confirmation round, or failed: its queue is
    gone) runs no more search trials: more --max-trials there would run nothing, so say so
    rather than take it. Fewer than it has run would leave no room for its confirmation round,
    and every later resume stuck there."""
    handed_over = state["tracker"].get("confirmed_id") is not None
    confirming = bool(state.get("confirmation_candidates"))
    ended = handed_over or confirming or state.get("shutdown_reason") is not None
    if max_trials == saved_settings(results_dir).max_trials:
        return
    statuses = [
        record.get("status") for record in state["tracker"]["records"] if isinstance(record, dict)
    ]
    started = sum(1 for status in statuses if status != "queued")
    added = state.get("added_trials", 0)  # the baseline run, on top of --max-trials
    counted = started - (added if isinstance(added, int) else 0)
    if not ended and max_trials < counted:
        # A trial the interruption stopped holds its place, and runs again from the start.
        again = statuses.count("running")
        first = f" (the {again} the interruption stopped run again first)" if again else ""
        raise DsatError(
            f"--max-trials {max_trials} is below the {counted} trials the search in "
            f"{shown(results_dir)} has started; give {counted} to start no new one{first}, or "
            "more to run more"
        )
    if ended:
        where = (
            "handed over its config"
            if handed_over
            else "is in its confirmation round"
            if confirming
            else f"handed over nothing ({state['shutdown_reason']})"
        )
        raise DsatError(
            f"--resume {shown(results_dir)}: that search has ended and {where}; --max-trials "
            f"changes only a search still searching: start a new search with --max-trials "
            f"{max_trials}"
        )


def trial_named(record: dict[str, Any]) -> str:
    """A saved trial as the terminal and trials.jsonl name it: ``trial 7 z2_mb16``."""
    try:
        trial = TrialRecord.from_json(record)
    except (KeyError, TypeError, ValueError):
        return str(record.get("request_id"))
    return f"trial {trial.number} {trial.name}"


def refuse_lost_rows(
    results_dir: Path, state: Mapping[str, Any], then: str = "to resume, or start a new search"
) -> None:
    """Every trial the saved search finished has its row in trials.jsonl, written before the
    state. Rows missing there were lost (the file removed, emptied or cut), and a resume would
    rewrite the summary's cost, and number the trials, from the rows left; so say so instead."""
    finished = {
        record.get("request_id")
        for record in state["tracker"]["records"]
        if isinstance(record, dict) and record.get("status") in FINISHED
    }
    path = results_dir / TRIALS_FILE
    if path.exists() and not path.is_file():
        raise DsatError(
            f"{shown(path)} is not a file: move it away and put back the file dsat wrote, or "
            "start a new search"
        )
    try:
        rows = read_trial_rows(path) if path.is_file() else []
    except OSError:
        return  # the results writer says what is wrong with it
    except ValueError as err:  # said here, before any slot is claimed or op built
        raise DsatError(
            f"{shown(path)}: {err}; put back the file as dsat wrote it {then}"
        ) from None
    missing = finished - {row["request_id"] for row in rows}
    if missing:
        names = [
            trial_named(record)
            for record in state["tracker"]["records"]
            if isinstance(record, dict) and record.get("request_id") in missing
        ]
        which = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise DsatError(
            f"{shown(path)}: {len(missing)} of the {len(finished)} trials the saved search "
            f"finished have no row there ({which}: the file was removed, emptied, cut or "
            f"edited); put it back as dsat wrote it {then}"
        )


def python_command() -> str:
    """How to start this interpreter again: ``python3`` when that is the one on PATH."""
    on_path = shutil.which("python3")
    if on_path is not None and Path(on_path).parent == Path(sys.executable).parent:
        return "python3"
    return shown(sys.executable)


def resume_command(method: str, results_dir: Path) -> str:
    """The complete command that resumes the search in ``results_dir``, as it can be pasted."""
    return shlex.join([python_command(), "-m", "dsat", method, "--resume", shown(results_dir)])
