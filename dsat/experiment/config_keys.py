"""The keys of a Determined experiment config, to tell a misspelt one from one dsat ignores.

Determined's master refuses a key its schema does not have; dsat reads only a few (``name``,
``entrypoint``, ``hyperparameters``, ``resources.slots_per_trial``) and ignores the rest, so a
``resource:`` for ``resources:`` searched with 1 slot per trial and said nothing. A near miss of a
key dsat reads, where that key is absent, is the user's mistake (one line); any other unknown key
is said in a note, and the search goes on (a key of another Determined version is not refused).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from dsat.errors import DsatError

# Determined's experiment config (schemas/expconf/v0/experiment.json), over its recent versions.
EXPERIMENT_KEYS = frozenset(
    {
        "bind_mounts",
        "checkpoint_policy",
        "checkpoint_storage",
        "data",
        "data_layer",
        "debug",
        "description",
        "entrypoint",
        "environment",
        "hyperparameters",
        "integrations",
        "internal",
        "labels",
        "log_policies",
        "max_restarts",
        "min_checkpoint_period",
        "min_validation_period",
        "name",
        "optimizations",
        "pbs",
        "perform_initial_validation",
        "preemption_timeout",
        "profiling",
        "project",
        "records_per_epoch",
        "reproducibility",
        "resources",
        "retention_policy",
        "scheduling_unit",
        "searcher",
        "security",
        "slurm",
        "tensorboard_storage",
        "workspace",
    }
)
# Its ``resources`` section (schemas/expconf/v0/resources.json).
RESOURCES_KEYS = frozenset(
    {
        "agent_label",
        "devices",
        "is_single_node",
        "max_slots",
        "native_parallel",
        "priority",
        "resource_pool",
        "shm_size",
        "slots",
        "slots_per_trial",
        "weight",
    }
)
# What dsat reads of them: a misspelling of one of these changes the search.
READ_KEYS = frozenset({"name", "entrypoint", "hyperparameters", "resources"})
READ_RESOURCES_KEYS = frozenset({"slots_per_trial"})


def refuse_misspelt_keys(config: Mapping[str, Any], source: str) -> None:
    """``DsatError`` for a key that looks like a misspelt key dsat reads, that key being absent."""
    for section, prefix, key, near in _unknown_keys(config):
        if near in READ_KEYS | READ_RESOURCES_KEYS and near not in section:
            raise DsatError(
                f"{source}: {prefix}{key} is not a key of the experiment config; did you mean "
                f"{prefix}{near}? (dsat reads that one; as written, this is ignored)"
            )


def unknown_key_notes(config: Mapping[str, Any], source: str) -> list[str]:
    """A note for each key of ``config`` that Determined's schema does not have."""
    return [
        f"dsat: note: {source}: {prefix}{key} is not a key of Determined's experiment config; "
        "dsat ignores it" + (f" (did you mean {prefix}{near}?)" if near else "")
        for _, prefix, key, near in _unknown_keys(config)
    ]


def _unknown_keys(
    config: Mapping[str, Any],
) -> list[tuple[Mapping[str, Any], str, str, str | None]]:
    """Each unknown key: its section, the section's prefix, the key, and the known key nearest
    to it (None when none is near)."""
    sections: list[tuple[Mapping[str, Any], frozenset[str], str]] = [(config, EXPERIMENT_KEYS, "")]
    resources = config.get("resources")
    if isinstance(resources, Mapping):
        sections.append((resources, RESOURCES_KEYS, "resources."))
    found = []
    for section, known, prefix in sections:
        for key in section:
            if isinstance(key, str) and key not in known:
                near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
                found.append((section, prefix, key, near[0] if near else None))
    return found
