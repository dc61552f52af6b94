"""A misspelt key dsat reads is one line; another key Determined does not have is a note."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from dsat.errors import DsatError
from dsat.experiment.config import load_experiment
from dsat.experiment.config_keys import (
    EXPERIMENT_KEYS,
    READ_KEYS,
    refuse_misspelt_keys,
    unknown_key_notes,
)
from tests.conftest import write_experiment


@pytest.mark.parametrize(
    ("config", "said"),
    [
        (
            {"resource": {"slots_per_trial": 16}},
            "resource is not a key of the experiment config; did you mean resources?",
        ),
        (
            {"resources": {"slot_per_trial": 16}},
            "resources.slot_per_trial is not a key of the "
            "experiment config; did you mean resources.slots_per_trial?",
        ),
        ({"entry_point": "python3 train.py"}, "did you mean entrypoint?"),
        ({"hyperparameter": {}}, "did you mean hyperparameters?"),
    ],
)
def test_a_misspelt_key_dsat_reads_is_one_line(
    tmp_path: Path, config: dict[str, Any], said: str
) -> None:
    """``resource:`` searched with 1 slot per trial instead of 16, and said nothing."""
    path = write_experiment(tmp_path / "m", config=config)
    written = yaml.safe_load(path.read_text())
    meant = said.rsplit("did you mean ", 1)[1].rstrip("?")
    if "." not in meant:  # the key as it should be written goes: only the misspelt one is left
        written.pop(meant)
    path.write_text(yaml.safe_dump(written))
    with pytest.raises(DsatError) as raised:
        load_experiment(path, path.parent)
    message = str(raised.value)
    assert message.startswith(f"{path}: ") and said in message and "\n" not in message


def test_a_near_miss_beside_the_key_itself_is_a_note_not_an_error() -> None:
    config = {"resources": {"slots_per_trial": 2, "slot_per_trial": 4}, "labels": ["x"]}
    refuse_misspelt_keys(config, "e.yaml")  # the key dsat reads is there
    assert unknown_key_notes(config, "e.yaml") == [
        "dsat: note: e.yaml: resources.slot_per_trial is not a key of Determined's experiment "
        "config; dsat ignores it (did you mean resources.slots_per_trial?)"
    ]


def test_keys_of_determined_dsat_does_not_read_pass_without_a_word() -> None:
    config = {key: None for key in EXPERIMENT_KEYS}
    config["resources"] = {"slots_per_trial": 1, "resource_pool": "a100", "max_slots": 8}
    refuse_misspelt_keys(config, "e.yaml")
    assert unknown_key_notes(config, "e.yaml") == []
    assert READ_KEYS <= EXPERIMENT_KEYS


def test_an_unknown_key_far_from_any_is_a_note_and_the_search_goes_on(tmp_path: Path) -> None:
    path = write_experiment(tmp_path / "m", config={"foo": "bar"})
    experiment = load_experiment(path, path.parent)
    assert unknown_key_notes(experiment.config, str(path)) == [
        f"dsat: note: {path}: foo is not a key of Determined's experiment config; dsat ignores it"
    ]
