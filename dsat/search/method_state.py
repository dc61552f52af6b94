"""A search method's whole state as JSON (no pickle): saved after every event, so a search
resumes where it stopped and proposes the trials the uninterrupted one would have."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsat.atomic_file import write_json_atomic
from dsat.constants import STATE_FILE
from dsat.trial import TrialKind

if TYPE_CHECKING:
    from dsat.search.method import DsatSearchMethod
    from dsat.search.trial_builder import SearchSpec

STATE_VERSION = 1


def state_json(method: DsatSearchMethod) -> dict[str, Any]:
    return {
        "version": STATE_VERSION,
        "method": method.name,
        # What the trials are ranked by: `dsat report` reads it where no settings.json is (a
        # Determined search runner's checkpoint keeps none).
        "metric": method.settings.metric.value,
        "tracker": method.tracker.to_json(),
        "rng": method.rng.bit_generator.state,
        "next_index": method.next_index,
        "confirmation_candidates": method.ending.confirmation_candidates,
        "search_end_reason": method.ending.search_end_reason,
        "extra_rounds": method.ending.extra_rounds,
        # Why it ended and why the hand-over won: a finished search resumed (for a full run)
        # rewrites its summary, which said so.
        "shutdown_reason": method.ending.shutdown_reason,
        "handover_reason": method.ending.handover_reason,
        "unsafe_memory": method.ending.unsafe_memory,  # why nothing was handed over
        "finished": method.finished,  # it ended: by its own rules, or a user's stop
        "stopped_from_outside": method.ending.stopped_from_outside,
        # The trials the confirmation round added on top of --max-trials (which a resume may
        # raise): its runs and its memory check.
        "added_trials": method.tracker.max_trials - method.settings.max_trials,
        "experiment": experiment_fingerprint(method.spec),
        # An outcome the stop rules have not yet been run for: on Determined the outcome and
        # the next suggestion are two events, each saved, and a search runner restarted between
        # them (loaded without a resume) never ran them: after the last trial's, it waited for
        # ever.
        "outcome_pending": method.outcome_pending,
    }


def experiment_fingerprint(spec: SearchSpec) -> dict[str, Any]:
    """What the search's trials were made from, to tell a resume of an edited experiment: the
    slots per trial, and digests of the DeepSpeed config, the hyperparameters and the
    entrypoint."""

    def digest(value: Any) -> str:
        text = json.dumps(value, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    return {
        "slots_per_trial": spec.slots_per_trial,
        "ds_config": digest(spec.ds_config),
        "hyperparameters": digest(spec.hparams),
        "entrypoint": digest(spec.entrypoint),
    }


# How each part of the fingerprint is named to the user.
FINGERPRINT_NAMES = {
    "slots_per_trial": "resources.slots_per_trial",
    "ds_config": "the DeepSpeed config",
    "hyperparameters": "the hyperparameters",
    "entrypoint": "the entrypoint",
}


def experiment_changes(spec: SearchSpec, state: dict[str, Any]) -> list[str]:
    """What of the experiment differs from when the saved search began (none for a state from
    before the fingerprint was kept)."""
    saved = state.get("experiment")
    if not isinstance(saved, dict):
        return []
    now = experiment_fingerprint(spec)
    changes = []
    for key, name in FINGERPRINT_NAMES.items():
        if key in saved and saved[key] != now[key]:
            detail = f" ({saved[key]} -> {now[key]})" if key == "slots_per_trial" else ""
            changes.append(name + detail)
    return changes


def load_state_json(method: DsatSearchMethod, state: dict[str, Any]) -> None:
    if state.get("version") != STATE_VERSION or state.get("method") != method.name:
        raise ValueError(
            f"search state is for {state.get('method')!r} v{state.get('version')}, "
            f"not {method.name!r} v{STATE_VERSION}"
        )
    method.tracker.load_json(state["tracker"])
    method.rng.bit_generator.state = state["rng"]
    method.next_index = int(state["next_index"])
    last = max((r.index for r in method.tracker.records), default=-1)
    if method.next_index <= last:  # the next trial would take an index a trial has
        raise ValueError(f"next_index {method.next_index} is not past the last trial's {last}")
    method.ending.confirmation_candidates = list(state.get("confirmation_candidates", []))
    method.ending.search_end_reason = str(state.get("search_end_reason", ""))
    method.ending.extra_rounds = int(state.get("extra_rounds", 0))
    shutdown_reason = state.get("shutdown_reason")
    method.ending.shutdown_reason = None if shutdown_reason is None else str(shutdown_reason)
    method.ending.handover_reason = str(state.get("handover_reason", ""))
    method.ending.unsafe_memory = bool(state.get("unsafe_memory", False))
    method.ending.stopped_from_outside = bool(state.get("stopped_from_outside", False))
    if state.get("finished") is True:
        method.ended()
    # Older states did not say: running the rules once more is what a resume does anyway.
    method.outcome_pending = bool(state.get("outcome_pending", True))
    # The trials the round added on top of --max-trials (older states: its runs alone).
    confirm_runs = sum(1 for r in method.tracker.records if r.kind is TrialKind.CONFIRM)
    added = int(state.get("added_trials", confirm_runs))
    method.tracker.max_trials = method.settings.max_trials + added


# The runs the machine failed of the trials still running, by request id, as trials.jsonl's rows
# keep them: a trial runs again on a resume, and the runs before count (their attempts, their
# cost) as they would have without the stop. Kept beside the method's own state.
MACHINE_FAILED_STATE_KEY = "machine_failed"
# Likewise the runs a stop (Ctrl-C, a lost Ray node) cut short: they held their slots.
INTERRUPTED_STATE_KEY = "interrupted"


def save_state(
    method: DsatSearchMethod,
    directory: Path,
    machine_failed: Mapping[str, list[dict[str, Any]]] | None = None,
    interrupted: Mapping[str, list[dict[str, Any]]] | None = None,
) -> None:
    """The state into ``directory``'s state file, atomically (a crash leaves the last one)."""
    state = state_json(method)
    for key, runs in (
        (MACHINE_FAILED_STATE_KEY, machine_failed),
        (INTERRUPTED_STATE_KEY, interrupted),
    ):
        if runs:
            state[key] = {k: list(v) for k, v in runs.items()}
    write_json_atomic(Path(directory) / STATE_FILE, state)


def load_state(method: DsatSearchMethod, directory: Path) -> None:
    load_state_json(method, json.loads((Path(directory) / STATE_FILE).read_text()))
