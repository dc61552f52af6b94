"""Backend choice: explicit, or auto following DET_MASTER."""

from __future__ import annotations

from dsat.runners import Backend, resolve_backend


def test_auto_without_det_master_is_local() -> None:
    assert resolve_backend("auto", {}) == (Backend.LOCAL, "DET_MASTER is not set")
    assert resolve_backend("auto", {"DET_MASTER": ""})[0] is Backend.LOCAL


def test_auto_with_det_master_is_determined() -> None:
    assert resolve_backend("auto", {"DET_MASTER": "http://m:8080"}) == (
        Backend.DETERMINED,
        "DET_MASTER is set",
    )


def test_explicit_choice_wins() -> None:
    assert resolve_backend("local", {"DET_MASTER": "x"}) == (Backend.LOCAL, "chosen with --backend")
    assert resolve_backend("simulated", {})[0] is Backend.SIMULATED
