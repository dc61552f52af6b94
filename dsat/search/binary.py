"""Binary search over the micro-batch of randomly generated ZeRO configurations.

Each lineage halves its range [lo, hi] around the midpoint: a success raises the floor, an OOM or
error lowers the ceiling, and so does a success that leaves less than --memory-margin of the
device free (it could not be handed over). When a range is used up, a fresh random
configuration takes its place.
"""

from __future__ import annotations

from dsat.search.method import DsatSearchMethod
from dsat.trial import SearchRange, TrialRecord


def range_after(record: TrialRecord, too_large: bool) -> SearchRange:
    """The range left once ``record`` finished: above it after a success, below it when it was
    ``too_large`` (it failed, or left less than --memory-margin free: TrialTracker.too_large)."""
    assert record.search_range is not None
    if too_large:
        return SearchRange(record.search_range.lo, record.mbs - 1)
    return SearchRange(record.mbs + 1, record.search_range.hi)


class BinarySearch(DsatSearchMethod):
    name = "binary"

    def _next(self, record: TrialRecord) -> list[TrialRecord]:
        remaining = range_after(record, self.tracker.too_large(record))
        child = self.continue_lineage(record, remaining, remaining.midpoint)
        if child is None:
            child = self.new_lineage()
        return [child] if child is not None else []

    def after_success(self, record: TrialRecord) -> list[TrialRecord]:
        return self._next(record)

    def after_failure(self, record: TrialRecord) -> list[TrialRecord]:
        return self._next(record)
