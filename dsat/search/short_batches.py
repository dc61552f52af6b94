"""Trials whose measured steps were fed short batches, said in the summary.

A data loader that keeps an epoch's last, partial batch, with fewer samples than a trial's steps
need, feeds some measured steps fewer rows than micro-batch x accumulation. The trial side counts
the rows it ran (``full_batch_share`` in its metrics, samples/s scaled by it), so the figure is
true; the user is told why it is lower than the configuration would train at.
"""

from __future__ import annotations

from collections.abc import Iterable

from dsat.constants import FULL_BATCH_SHARE
from dsat.trial import TrialRecord, TrialStatus


def short_batches_line(records: Iterable[TrialRecord]) -> str:
    """One line naming the trials fed short batches, and the fix; empty where none was."""
    short = [
        r for r in records if r.status is TrialStatus.COMPLETED and FULL_BATCH_SHARE in r.metrics
    ]
    if not short:
        return ""
    least = min(float(r.metrics[FULL_BATCH_SHARE]) for r in short)
    names = ", ".join(r.name for r in short[:3]) + (", ..." if len(short) > 3 else "")
    return (
        f"short batches: {len(short)} trial(s) ({names}) ran out of data inside their measured "
        f"steps, down to {least:.0%} of a full batch a step; their samples/s counts the samples "
        "they ran. Give a trial more samples than micro-batch x accumulation x its steps, or "
        "drop the last batch (a DataLoader's drop_last=True; HF Trainer: "
        "--dataloader_drop_last true)"
    )
