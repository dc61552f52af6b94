"""Random ZeRO configurations, each with an approximate binary search over its micro-batch.

Micro-batches are drawn from a binomial around the middle of the lineage's range (covering more
than the midpoint alone). Once a stage has a best trial, new configurations of that stage start at
its micro-batch and stop at the smallest one that ran out of memory there: unlike the reference,
which starts above the best and so spends most late trials on certain OOMs. Lineages stop early
on domain knowledge: a failure at the smallest micro-batch, `--trials-per-random-config` trials,
or a failed lineage whose ceiling is below what a same-stage trial already ran. Stage 3 only
saves memory, so once stage 1 or 2 works it is searched only above the largest micro-batch they
ran, and only while they hit a memory limit below its reach (the reference drops it outright).
"""

from __future__ import annotations

from typing import Any

from dsat.memory import Offload
from dsat.search.method import MAX_DRAWS, DsatSearchMethod
from dsat.trial import SearchRange, TrialKind, TrialRecord
from dsat.zero_space import needs_no_less_memory

# ZeRO-3 partitions the parameters too: it saves memory and adds communication, nothing else.
MEMORY_ONLY_STAGE = 3
LOWER_STAGES = {1, 2}


class RandomSearch(DsatSearchMethod):
    name = "random"

    def untried_stage(self) -> int | None:
        """Each stage of ``--zero-stages`` gets one configuration before any gets a second;
        stage 3 only where its first trial would run (should_stop_lineage): not once stages 1
        and 2 ran above all it could hold (its range is empty: drawn, it crashed the search, and
        every resume of it), nor once they ran without a memory limit (drawn again after each
        drop, it stalled the search with nothing running and no reason to end)."""
        untried = [
            stage
            for stage in sorted(set(self.zero_stages) - self.tracker.tried_stages())
            if stage != MEMORY_ONLY_STAGE or self.stage_three_worth_a_first_try()
        ]
        return int(untried[int(self.rng.integers(len(untried)))]) if untried else None

    def stage_three_worth_a_first_try(self) -> bool:
        if LOWER_STAGES & self.tracker.successful_stages and not self.stage_three_reaches_further():
            return False
        return any(map(self.stage_three_has_room, self.offload_space(MEMORY_ONLY_STAGE)))

    def stage_three_has_room(self, section: dict[str, Any]) -> bool:
        """Whether stage 3, keeping off the GPU what ``section`` does, leaves a micro-batch above
        the largest stages 1 and 2 ran."""
        return not self.initial_range(MEMORY_ONLY_STAGE, self.offload_of(section)).empty

    def draw_zero_config(self, stage: int) -> dict[str, Any]:
        """As every method draws one, but at stage 3 only among the offload choices that leave
        it room above stages 1 and 2."""
        for _ in range(MAX_DRAWS):
            section = super().draw_zero_config(stage)
            if stage != MEMORY_ONLY_STAGE or self.stage_three_has_room(section):
                break
        return section

    def draw_micro_batch(self, search_range: SearchRange) -> int:
        return search_range.lo + int(self.rng.binomial(search_range.hi - search_range.lo, 0.5))

    def first_micro_batch(self, search_range: SearchRange) -> int:
        return self.draw_micro_batch(search_range)

    def choose_stage(self) -> int:
        preferred = LOWER_STAGES & self.tracker.successful_stages & set(self.zero_stages)
        if preferred and self.stage_three_worth_a_new_configuration():
            preferred.add(MEMORY_ONLY_STAGE)
        stages = sorted(preferred) or self.live_stages()
        return int(stages[int(self.rng.integers(len(stages)))])

    def fitted(self, record: TrialRecord) -> bool:
        """A search trial that completed and left the memory margin: one that ran over it is as
        good as out of memory (``too_large``), here as everywhere else."""
        tracker = self.tracker
        return tracker.metric_value(record) is not None and not tracker.too_large(record)

    def lower_stage_reach(self) -> int | None:
        """The largest micro-batch stage 1 or 2 completed within the margin; None while neither
        has."""
        sizes = [
            r.mbs for r in self.tracker.records if r.zero_stage in LOWER_STAGES and self.fitted(r)
        ]
        return max(sizes) if sizes else None

    def stage_three_reaches_further(self) -> bool:
        """Whether stage 3 may still buy what it exists for, a larger micro-batch: stages 1 and 2
        ran into a memory limit (an OOM, or a run over the margin) and stage 3 has room above
        what they completed. The reference drops stage 3 as soon as stage 1 or 2 works, which
        loses every model whose best configuration is ZeRO-3 at a micro-batch the lower stages
        cannot hold."""
        stages = self.zero_stages
        if MEMORY_ONLY_STAGE not in stages:
            return False
        limited = any(
            r.zero_stage in LOWER_STAGES and self.tracker.too_large(r)
            for r in self.tracker.records
            if r.kind is TrialKind.SEARCH
        )
        return limited and not self.initial_range(MEMORY_ONLY_STAGE).empty

    def stage_three_worth_a_new_configuration(self) -> bool:
        """Stage 3 has room above stages 1-2 and has not yet lost there: until one of its trials
        ran above what they completed, or while its best beats theirs. A configuration of stage
        3 that is slower where it first runs above them may still win higher up, so its lineage
        goes on (``should_stop_lineage``); only new ones are no longer drawn."""
        if not self.stage_three_reaches_further():
            return False
        reach = self.lower_stage_reach()
        tried_above = any(
            r.zero_stage == MEMORY_ONLY_STAGE
            and self.tracker.metric_value(r) is not None
            and (reach is None or r.mbs > reach)
            for r in self.tracker.records
        )
        if not tried_above:
            return True
        ours = self.tracker.best(MEMORY_ONLY_STAGE)
        theirs = self.tracker.best_of(
            [r for r in self.tracker.records if r.zero_stage in LOWER_STAGES]
        )
        better = self.settings.metric.is_better
        if ours is None or theirs is None:
            return ours is not None
        return better(
            self.tracker.metric_value(ours) or 0.0, self.tracker.metric_value(theirs) or 0.0
        )

    def initial_range(self, stage: int, offload: Offload | None = None) -> SearchRange:
        """Below the memory model's estimate until the stage has a best trial; then from that trial's
        micro-batch (other knobs may be faster there) up to the smallest micro-batch that ran
        out of memory in this stage, or, with none yet, twice as high."""
        return self.above_lower_stages(stage, self._stage_range(stage, offload))

    def above_lower_stages(self, stage: int, search_range: SearchRange) -> SearchRange:
        """Stage 3's part of ``search_range``: above the largest micro-batch stage 1 or 2 ran,
        below which stage 3 only adds communication. Other stages' ranges as they are."""
        reach = self.lower_stage_reach()
        if stage != MEMORY_ONLY_STAGE or reach is None:
            return search_range
        return SearchRange(max(search_range.lo, reach + 1), search_range.hi)

    def _stage_range(self, stage: int, offload: Offload | None = None) -> SearchRange:
        best = self.tracker.best(stage)
        if best is None or best.search_range is None:
            # One sample of activations short of the memory model's estimate (the reference's own
            # estimate): the profile under-reports activations, and every draw above the real
            # cliff costs a whole trial here, where a binary search would halve the range.
            ceiling = self.micro_batch_ceiling(stage, offload=offload)
            return SearchRange(1, max(ceiling - 1, 1))
        lo = best.mbs
        failed_above = [
            r.mbs
            for r in self.tracker.records
            if r.zero_stage == stage and self.tracker.too_large(r) and r.mbs > lo
        ]
        if failed_above:
            return SearchRange(lo, min(failed_above))
        largest_success = max(
            (r.mbs for r in self.tracker.records if r.zero_stage == stage and self.fitted(r)),
            default=lo,
        )
        return SearchRange(lo, max(largest_success, best.search_range.hi, 2 * lo))

    def should_stop_lineage(self, record: TrialRecord) -> bool:
        tracker = self.tracker
        search_range = record.search_range
        if search_range is None:
            return True
        if tracker.too_large(record) and record.mbs <= search_range.lo:
            return True
        if tracker.finished_in_lineage(record.lineage_id) >= self.settings.trials_per_random_config:
            return True
        if record.zero_stage == MEMORY_ONLY_STAGE and LOWER_STAGES & tracker.successful_stages:
            reach = self.lower_stage_reach()
            if not self.stage_three_reaches_further() or (
                reach is not None and search_range.hi <= reach
            ):
                return True
        if tracker.error_in_history(record):
            return any(
                r.mbs >= search_range.hi
                for r in tracker.records
                if r.zero_stage == record.zero_stage and self.fitted(r)
            )
        return False

    def _continue(self, record: TrialRecord, remaining: SearchRange) -> list[TrialRecord]:
        remaining = self.above_lower_stages(record.zero_stage, remaining)
        child = None
        if not self.should_stop_lineage(record) and not remaining.empty:
            child = self.continue_lineage(record, remaining, self.draw_micro_batch(remaining))
        if child is None:
            child = self.new_lineage()
        return [child] if child is not None else []

    def after_success(self, record: TrialRecord) -> list[TrialRecord]:
        assert record.search_range is not None
        remaining = SearchRange(record.mbs + 1, record.search_range.hi)
        if self.used_up(remaining):  # the memory model was too cautious: look higher
            remaining = SearchRange(remaining.lo, self.room_above(record, 2 * remaining.lo))
        return self._continue(record, remaining)

    def room_above(self, record: TrialRecord, ceiling: int) -> int:
        """The largest micro-batch up to ``ceiling`` not already too large for a configuration
        that needs no more memory than ``record``'s (zero_space.needs_no_less_memory): the
        doubling stops below it rather than run a certain OOM."""
        known = [
            r.mbs - 1
            for r in self.tracker.records
            if r.kind is TrialKind.SEARCH
            and r.mbs > record.mbs
            and self.tracker.too_large(r)
            and needs_no_less_memory(record.zero_section, r.zero_section)
        ]
        return min([ceiling, *known])

    def after_failure(self, record: TrialRecord) -> list[TrialRecord]:
        assert record.search_range is not None
        return self._continue(record, SearchRange(record.search_range.lo, record.mbs - 1))

    def worth_running(self, record: TrialRecord) -> bool:
        """A queued search trial whose lineage should stop is dropped when its turn comes. A run
        of the confirmation round is no lineage's next step: it always runs (dropped, its leader,
        often one whose lineage had used up --trials-per-random-config, could not win the round,
        and a new search trial ran in its place)."""
        if record.kind is not TrialKind.SEARCH or self.ending.confirming(self):
            return True  # the round's runs, and its memory check (a search trial of no lineage)
        return not self.should_stop_lineage(record)

    def replacement(self, dropped: TrialRecord) -> list[TrialRecord]:
        fresh = self.new_lineage()
        return [fresh] if fresh is not None else []

    def early_stopping_triggered(self) -> bool:
        patience = self.settings.early_stopping
        return patience is not None and self.tracker.trials_since_best >= patience
