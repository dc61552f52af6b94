"""RunnerKind choice: explicit, or auto following DET_MASTER, then RAY_ADDRESS."""

from __future__ import annotations

from dsat.runners import RunnerKind, resolve_runner


def test_auto_without_det_master_or_ray_address_is_local() -> None:
    assert resolve_runner("auto", {}) == (
        RunnerKind.LOCAL,
        "neither DET_MASTER nor RAY_ADDRESS is set",
    )
    assert resolve_runner("auto", {"DET_MASTER": "", "RAY_ADDRESS": ""})[0] is RunnerKind.LOCAL


def test_auto_with_ray_address_and_no_det_master_is_ray() -> None:
    assert resolve_runner("auto", {"RAY_ADDRESS": "10.0.0.1:6379"}) == (
        RunnerKind.RAY,
        "RAY_ADDRESS is set and DET_MASTER is not",
    )
    both = {"RAY_ADDRESS": "10.0.0.1:6379", "DET_MASTER": "http://m:8080"}
    assert resolve_runner("auto", both)[0] is RunnerKind.DETERMINED


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


def test_a_ray_address_given_picks_ray_before_any_variable() -> None:
    assert resolve_runner("auto", {"DET_MASTER": "http://m:8080"}, "10.0.0.1:6379") == (
        RunnerKind.RAY,
        "--ray-address is given",
    )
