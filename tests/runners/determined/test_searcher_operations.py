from __future__ import annotations

import uuid

import pytest
from determined import searcher

from dsat.runners.determined.searcher_operations import operations_from_text, operations_to_text


def test_every_operation_round_trips_through_json() -> None:
    request_id = uuid.uuid4()
    ops = [
        searcher.Create(request_id, {"lr": 0.1, "overwrite_deepspeed_args": {"a": [1, 2]}}, None),
        searcher.ValidateAfter(request_id, 6),
        searcher.Close(request_id),
        searcher.Progress(0.25),
        searcher.Shutdown(cancel=False, failure=True),
    ]
    text = operations_to_text(ops)
    back = operations_from_text(text)
    # What the master receives is the same for the original and the reloaded operations.
    assert [op._to_searcher_operation().to_json() for op in back] == [
        op._to_searcher_operation().to_json() for op in ops
    ]
    assert "pickle" not in text and text.lstrip().startswith("[")


def test_unknown_operations_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown searcher operation"):
        operations_from_text('[{"type": "explode"}]')
    with pytest.raises(ValueError, match="JSON list"):
        operations_from_text('{"type": "close"}')
