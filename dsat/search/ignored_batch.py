"""A training script that feeds every trial a batch size of its own (a DataLoader built with
``batch_size=16``, not the trial's micro-batch): every trial then runs the same work, and a
larger micro-batch reads as proportionally faster, since samples/s counts the micro-batch.

The trial side reports the shape of its training forwards' first input where every one had the
same (``INPUT_SHAPE``). Completed trials of three micro-batches fed the same shape, whose leading
dimension is one of theirs (so that dimension is the batch), show it for sure: the search stops,
failed, as no trial measured its configuration. Two micro-batches fed one shape that holds
neither may also be a first input that is no batch at all (a buffer of positions): a note.
"""

from __future__ import annotations

from collections.abc import Iterable

from dsat.constants import INPUT_SHAPE
from dsat.trial import TrialKind, TrialRecord, TrialStatus

FIX = (
    "build the DataLoader from the trial's micro-batch (engine.train_micro_batch_size_per_gpu(); "
    "docs/porting-core-api.md)"
)


def _alike(
    records: Iterable[TrialRecord],
) -> list[tuple[TrialRecord, list[TrialRecord], list[int]]]:
    """Completed, measured trials of different micro-batches fed one input shape: for each
    shape, the trial whose micro-batch leads it (else the smallest), the others, the shape."""
    by_shape: dict[tuple[int, ...], list[TrialRecord]] = {}
    for record in records:
        shape = record.metrics.get(INPUT_SHAPE)
        if (
            record.status is TrialStatus.COMPLETED
            and record.kind is not TrialKind.MODEL_PROFILE
            and isinstance(shape, list)
            and shape
            and all(isinstance(n, int) for n in shape)
        ):
            by_shape.setdefault(tuple(shape), []).append(record)
    groups = []
    for shape, fed in by_shape.items():
        sizes = {r.mbs: r for r in fed}
        if len(sizes) > 1:
            first, *others = sorted(sizes.values(), key=lambda r: (r.mbs != shape[0], r.mbs))
            groups.append((first, others, list(shape)))
    return groups


# Trials of this many micro-batches fed one shape, led by one of theirs, before the search stops:
# one coincidence (a first input that is no batch, as long as one trial's micro-batch) is not
# enough.
SIZES_TO_STOP = 3


def script_batch_ignored(records: Iterable[TrialRecord]) -> str | None:
    """Why the search must stop where trials show the script ignores the micro-batch (the
    shape's leading dimension is one trial's micro-batch, and trials of SIZES_TO_STOP - 1 other
    micro-batches ran it too); None otherwise."""
    for own, others, shape in _alike(records):
        if own.mbs == shape[0] and len(others) + 1 >= SIZES_TO_STOP:
            return (
                f"the training script feeds every trial batches of {shape[0]} whatever its "
                f"micro-batch: {others[0].name} ran the same inputs as {own.name} (shape "
                f"{shape}), so no trial measured its configuration; {FIX}"
            )
    return None


def same_inputs_line(records: Iterable[TrialRecord]) -> str:
    """A summary note where trials of different micro-batches were fed one input shape that
    holds neither: perhaps a batch size of the script's own; empty otherwise."""
    for own, others, shape in _alike(records):
        other = next((o for o in others if o.mbs not in shape), None)
        if own.mbs not in shape and other is not None:
            return (
                f"same inputs: {own.name} and {other.name} were fed inputs of one shape "
                f"{shape} at different micro-batches; if the script sets a batch size of its "
                f"own, their figures measure the same batch: {FIX}"
            )
    return ""
