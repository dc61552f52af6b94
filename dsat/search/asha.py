"""ASHA (Li et al., arXiv:1810.05934) where the resource is binary-search trials in a lineage.

Rung r lets a lineage run `min_binary_search_trials * divisor**(s + r)` trials in total (s is
`--asha-early-stopping`). A lineage finishes a rung when it has used that many trials, or when its
binary search is used up. The top 1/divisor of the lineages that finished a rung, ranked by their
best result within it, may go on to the next rung; the highest rungs are served first.
"""

from __future__ import annotations

from dsat.search.binary import range_after
from dsat.search.method import DsatSearchMethod
from dsat.trial import TrialRecord


class AshaSearch(DsatSearchMethod):
    name = "asha"

    def trials_for_rung(self, rung: int) -> int:
        s = self.settings
        return int(s.min_binary_search_trials * s.divisor ** (s.asha_early_stopping + rung))

    def search_used_up(self, latest: TrialRecord) -> bool:
        return latest.status.finished and self.used_up(
            range_after(latest, self.tracker.too_large(latest))
        )

    def completed_rung(self, lineage_id: str, rung: int) -> bool:
        latest = self.tracker.latest_in_lineage(lineage_id)
        if latest.rung > rung:
            return True
        if self.tracker.finished_in_lineage(lineage_id) >= self.trials_for_rung(rung):
            return True
        return latest.rung == rung and self.search_used_up(latest)

    def next_in_lineage(self, lineage_id: str, rung: int) -> TrialRecord | None:
        latest = self.tracker.latest_in_lineage(lineage_id)
        if not latest.status.finished:
            return None
        remaining = range_after(latest, self.tracker.too_large(latest))
        return self.continue_lineage(latest, remaining, remaining.midpoint, rung=rung)

    def best_value_in_rung(self, lineage_id: str, rung: int) -> float | None:
        records = [r for r in self.tracker.lineage(lineage_id) if r.rung <= rung]
        best = self.tracker.best_of(records)
        return None if best is None else self.tracker.metric_value(best)

    def promotable(self, rung: int) -> list[str]:
        """Lineages in the top 1/divisor of ``rung`` that can still go up, best first."""
        finished = [lid for lid in self.tracker.lineage_ids() if self.completed_rung(lid, rung)]
        top_count = len(finished) // self.settings.divisor
        scored = [(self.best_value_in_rung(lid, rung), lid) for lid in finished]
        ranked = [
            lid
            for value, lid in sorted(
                ((v, lid) for v, lid in scored if v is not None),
                key=lambda item: item[0],
                reverse=not self.settings.metric.smaller_is_better,
            )
        ]
        top = ranked[:top_count]
        return [
            lid
            for lid in top
            if self.tracker.latest_in_lineage(lid).rung == rung
            and not self.search_used_up(self.tracker.latest_in_lineage(lid))
        ]

    def next_trial(self, last: TrialRecord) -> list[TrialRecord]:
        if not self.completed_rung(last.lineage_id, last.rung):
            child = self.next_in_lineage(last.lineage_id, last.rung)
            if child is not None:
                return [child]
        for rung in reversed(range(self.settings.max_rungs - 1)):
            for lineage_id in self.promotable(rung):
                child = self.next_in_lineage(lineage_id, rung + 1)
                if child is not None:
                    return [child]
        fresh = self.new_lineage()
        return [fresh] if fresh is not None else []

    def after_success(self, record: TrialRecord) -> list[TrialRecord]:
        return self.next_trial(record)

    def after_failure(self, record: TrialRecord) -> list[TrialRecord]:
        return self.next_trial(record)

    def choose_next(self) -> str | None:
        """Highest rung first; among those the longest lineage, so promotions finish sooner."""
        queue = self.tracker.queue
        if not queue:
            return None

        def priority(request_id: str) -> tuple[int, int, int]:
            record = self.tracker.get(request_id)
            return (
                record.rung,
                self.tracker.finished_in_lineage(record.lineage_id),
                -queue.index(request_id),
            )

        return max(queue, key=priority)
