"""Loading `MODULE_OR_FILE:FUNCTION` specs for --simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsat.errors import DsatError
from dsat.experiment.function_path import load_callable


def test_module_function() -> None:
    assert load_callable("json:dumps") is json.dumps


def test_file_function(tmp_path: Path) -> None:
    (tmp_path / "perf.py").write_text(
        "def model(ds_config, slots):\n    return {'throughput': slots}\n"
    )
    function = load_callable(f"{tmp_path / 'perf.py'}:model")
    assert function({}, 4) == {"throughput": 4}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "expected MODULE_OR_FILE:FUNCTION"),
        (":f", "expected MODULE_OR_FILE:FUNCTION"),
        ("json:", "expected MODULE_OR_FILE:FUNCTION"),
        ("no_such_module_abc:f", "cannot import no_such_module_abc"),
        ("json:no_such_function", "has no attribute no_such_function"),
        ("json.decoder:NaN", "is not callable"),
        ("missing/file.py:f", "not found"),
    ],
)
def test_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(DsatError, match=message) as info:
        load_callable(spec, "--simulator")
    assert str(info.value).startswith(f"--simulator {spec}")


def test_module_that_raises_on_import(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    with pytest.raises(DsatError, match=r"\(RuntimeError: boom\)$"):
        load_callable(f"{tmp_path / 'broken.py'}:f")


def test_a_files_path_is_made_absolute_a_modules_name_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search started with ``--simulator intr.py:perf`` saved it as typed, and a resume from
    another directory could not find the file (nor be given it again: "differs")."""
    from dsat.experiment.function_path import with_absolute_file
    from dsat.experiment.settings import SearchSettings

    monkeypatch.chdir(tmp_path)
    assert with_absolute_file("intr.py:perf") == f"{tmp_path}/intr.py:perf"
    assert with_absolute_file("sims/intr.py:perf") == f"{tmp_path}/sims/intr.py:perf"
    named = "dsat.runners.simulated.performance_models:gpt2_large"
    assert with_absolute_file(named) == named and with_absolute_file("nocolon") == "nocolon"
    settings = SearchSettings(
        method="binary", config_path="x.yaml", model_dir=".", simulator="a.py:f"
    )
    assert settings.with_absolute_paths().simulator == f"{tmp_path}/a.py:f"
