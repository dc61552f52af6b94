"""RunnerKind choice: explicit, or auto following DET_MASTER."""

from __future__ import annotations

from dsat.runners import RunnerKind, resolve_runner


def test_auto_without_det_master_is_local() -> None:
    assert resolve_runner("auto", {}) == (RunnerKind.LOCAL, "DET_MASTER is not set")
    assert resolve_runner("auto", {"DET_MASTER": ""})[0] is RunnerKind.LOCAL


def test_auto_with_det_master_is_determined() -> None:
    assert resolve_runner("auto", {"DET_MASTER": "http://m:8080"}) == (
        RunnerKind.DETERMINED,
        "DET_MASTER is set",
    )


def test_explicit_choice_wins() -> None:
    assert resolve_runner("local", {"DET_MASTER": "x"}) == (
        RunnerKind.LOCAL,
        "chosen with --runner",
    )
    assert resolve_runner("simulated", {})[0] is RunnerKind.SIMULATED
