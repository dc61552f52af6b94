"""Determined searcher operations as JSON, so a search runner's checkpoint holds no pickle.

Determined's own ``RemoteSearchRunner`` pickles the operations it last posted (a checkpoint
restored from storage could then run code); dsat writes them as plain JSON instead.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from determined import searcher


def operation_to_json(op: searcher.Operation) -> dict[str, Any]:
    if isinstance(op, searcher.Create):
        return {
            "type": "create",
            "request_id": str(op.request_id),
            "hparams": json.loads(op.hparams),
        }
    if isinstance(op, searcher.ValidateAfter):
        return {"type": "validate_after", "request_id": str(op.request_id), "length": op.length}
    if isinstance(op, searcher.Close):
        return {"type": "close", "request_id": str(op.request_id)}
    if isinstance(op, searcher.Progress):
        return {"type": "progress", "progress": op.progress}
    if isinstance(op, searcher.Shutdown):
        return {"type": "shutdown", "cancel": op.cancel, "failure": op.failure}
    raise TypeError(f"cannot store searcher operation {type(op).__name__}")


def operation_from_json(data: dict[str, Any]) -> searcher.Operation:
    kind = data.get("type")
    if kind == "create":
        return searcher.Create(uuid.UUID(data["request_id"]), data["hparams"], checkpoint=None)
    if kind == "validate_after":
        return searcher.ValidateAfter(uuid.UUID(data["request_id"]), int(data["length"]))
    if kind == "close":
        return searcher.Close(uuid.UUID(data["request_id"]))
    if kind == "progress":
        return searcher.Progress(float(data["progress"]))
    if kind == "shutdown":
        return searcher.Shutdown(cancel=bool(data["cancel"]), failure=bool(data["failure"]))
    raise ValueError(f"unknown searcher operation {kind!r}")


def operations_to_text(ops: Sequence[searcher.Operation]) -> str:
    return json.dumps([operation_to_json(op) for op in ops], indent=1, sort_keys=True) + "\n"


def operations_from_text(text: str) -> list[searcher.Operation]:
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("searcher operations must be a JSON list")
    return [operation_from_json(item) for item in data]
