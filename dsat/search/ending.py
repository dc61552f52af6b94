"""How a search ends: the stop rules, then the confirmation round that decides what is handed over.

Kept apart from the methods' hooks: every method ends the same way, whatever it tried.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Collection
from typing import TYPE_CHECKING

from dsat.memory import ModelProfile, ModelProfileError
from dsat.search.baseline import measure_yours_again
from dsat.search.confirmation import (
    EXTRA_ROUNDS,
    QUIET_SPREAD,
    decide,
    leaders,
    next_round,
    search_trials,
)
from dsat.search.ignored_batch import script_batch_ignored
from dsat.trial import TrialKind, TrialRecord, TrialStatus
from dsat.trial_failure import (
    FROM_OUTSIDE,
    MACHINE_FAILURES_TO_STOP,
    OP_NOT_BUILT,
    SCRIPT_FAILURES_TO_STOP,
    STOP_REASON_CHARS,
    UNKNOWN_FAILURES_TO_STOP,
    WHO_ELSE,
    FailureCause,
    first_line,
    log_note,
)

if TYPE_CHECKING:
    from dsat.search.method import DsatSearchMethod

logger = logging.getLogger(__name__)


NVME_UNTRIED = "--offload-nvme PATH (NVMe offload was not tried), "


def rungs_left_out(zero_stages: Collection[int], nvme_path: str | None) -> str:
    """The fit ladder's rungs the flags left out, as the first advice where no rung fit: the
    advice to add --offload-nvme was refused without stage 3, and adding stage 3 was unsaid."""
    if 3 not in zero_stages:
        return "add 3 to --zero-stages (ZeRO-3 and its parameter offload were not tried), "
    return "" if nvme_path else NVME_UNTRIED


def profile_failure(
    profile: TrialRecord, tried: list[str] | None = None, untried: str = NVME_UNTRIED
) -> str:
    """Why the search cannot start, quoting the model-profile trial's own reason; "fix the
    config" only where the config is the cause. ``tried``: the fit ladder's rungs whose
    profiles ran out of memory, when there was more than the user's own config to try;
    ``untried``: the rungs the flags left out, as advice (``rungs_left_out``)."""
    reason, log = first_line(profile.error, STOP_REASON_CHARS), log_note(profile.log)
    if profile.status is TrialStatus.COMPLETED:  # it ran, and its report lacked what dsat needs
        try:
            ModelProfile.from_metrics(profile.metrics)
        except ModelProfileError as err:
            return (
                f"the {err}{log}: dsat sizes the search from them (DeepSpeed's profiler reports "
                "them through dsat.dsat_reporting_context)"
            )
    if profile.status is TrialStatus.OOM and tried and len(tried) > 1:
        return (
            f"the model does not fit at micro-batch 1 in any way dsat tried ({'; '.join(tried)}): "
            f"the last ran out of memory ({reason}){log}; {untried}give each trial more GPUs "
            "(resources.slots_per_trial), or a smaller model"
        )
    if profile.status is TrialStatus.OOM:
        return (
            f"the model-profile trial ran out of memory at micro-batch 1 ({reason}){log}: the "
            "model must fit at micro-batch 1 with the submitted DeepSpeed config; fix the config "
            "(a higher ZeRO stage, offload) and try again"
        )
    if profile.cause is FailureCause.CONFIG and "async_io" in reason:
        before = (
            f"the model ran out of memory in every other way dsat tried ({'; '.join(tried[:-1])})"
            ", and "
            if tried and len(tried) > 1
            else ""
        )
        return (
            f"{before}the model-profile trial with NVMe offload failed: {reason}{log}; NVMe "
            "offload needs DeepSpeed's async_io op, which this machine cannot load (`ds_report` "
            "says what it lacks: libaio, most often): install what it needs, or drop "
            "--offload-nvme"
        )
    if profile.cause is FailureCause.CONFIG and reason.startswith(OP_NOT_BUILT):
        return (
            f"the model-profile trial failed: {reason}{log}; the config is valid, this machine "
            "cannot build what it needs: fix the build (the log says why: a compiler, the CUDA "
            "toolkit), or give the optimizer's params \"torch_adam\": true (torch's Adam, no build)"
        )
    if profile.cause is FailureCause.CONFIG:
        return f"the model-profile trial failed: {reason}{log}; fix the DeepSpeed config"
    if profile.cause is FailureCause.SCRIPT:
        return (
            f"the model-profile trial failed: {reason}{log}; no configuration can pass until the "
            "training script is fixed"
        )
    if profile.cause is FailureCause.MACHINE:
        return f"the model-profile trial failed: {reason}{log}; the configuration is not to blame"
    if profile.status is TrialStatus.TIMEOUT:
        return f"the model-profile trial failed: {reason}{log} (--trial-timeout)"
    return (
        f"the model-profile trial failed (micro-batch 1): {reason}{log}; its log says whether "
        "the training script or the config is the cause"
    )


# A trial's directory as the local and Ray runners name it: NNN-<request id's first 8>.
TRIAL_DIRECTORY = re.compile(r"(?<=/)\d{3,}-[0-9a-f]{8}(?:-node\d+)?(?=/)")
NUMBER = re.compile(r"\d+")


def failure_key(record: TrialRecord) -> str:
    """A failed trial's reason as trials failing alike share it: each runs in its own directory,
    which its traceback may name, and counts its own steps (an epoch is fewer steps at a larger
    micro-batch)."""
    return NUMBER.sub("N", TRIAL_DIRECTORY.sub("<trial>", first_line(record.error)))


def repeated_script_failure(finished: list[TrialRecord]) -> str | None:
    """A stop reason when the last trials all failed for the training script with one reason,
    which no DeepSpeed configuration can cause (too few steps, no metrics reported)."""
    last = finished[-SCRIPT_FAILURES_TO_STOP:]
    if len(last) < SCRIPT_FAILURES_TO_STOP:
        return None
    reasons = {failure_key(r) for r in last if r.cause is FailureCause.SCRIPT}
    if len(reasons) != 1 or any(r.cause is not FailureCause.SCRIPT for r in last):
        return None
    reason = first_line(last[-1].error, STOP_REASON_CHARS)
    return (
        f"the last {len(last)} trials failed alike, whatever their configuration: "
        f"{reason}{log_note(last[-1].log)}; fix the training script and start again"
    )


def repeated_failure(finished: list[TrialRecord]) -> str | None:
    """A stop reason when the last trials failed alike for the script or the machine, or alike
    whatever their configuration before any succeeded; it says why they failed itself."""
    return (
        repeated_script_failure(finished)
        or repeated_machine_failure(finished)
        or repeated_unknown_failure(finished)
    )


def repeated_unknown_failure(finished: list[TrialRecord]) -> str | None:
    """A stop reason when nothing but the model profile has succeeded and the last trials all
    crashed with one reason of no known kind over several stages and micro-batches: a script's
    bug after the profile's steps (the same RuntimeError in every trial) ran the whole
    --max-trials budget, each trial a GPU's start-up for nothing. With one stage searched
    (--zero-stages 1), where the micro-batch alone may be why, twice as many crashes over as
    many micro-batches, from one to eight times the least."""
    configured = [r for r in finished if r.kind is not TrialKind.MODEL_PROFILE]
    if any(r.status is TrialStatus.COMPLETED for r in configured):
        return None
    for count in (UNKNOWN_FAILURES_TO_STOP, 2 * UNKNOWN_FAILURES_TO_STOP):
        last = finished[-count:]
        if len(last) < count or any(
            r.cause is not FailureCause.UNKNOWN or r.status is TrialStatus.TIMEOUT for r in last
        ):
            return None
        if len({failure_key(r) for r in last}) != 1 or len({r.name for r in last}) < 3:
            return None
        stages = sorted({r.zero_stage for r in last})
        batches = sorted({r.mbs for r in last})
        one_stage = count > UNKNOWN_FAILURES_TO_STOP
        wide = len(batches) >= UNKNOWN_FAILURES_TO_STOP and batches[-1] >= 8 * batches[0]
        if len(stages) >= 2 or (one_stage and wide):
            break
    else:
        return None
    sizes = f" {batches[0]}" if len(batches) == 1 else f"es {batches[0]} to {batches[-1]}"
    over = f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"
    reason = first_line(last[-1].error, STOP_REASON_CHARS)
    return (
        f"the last {len(last)} trials failed alike over ZeRO {over} at micro-batch{sizes}, and "
        f"none has succeeded: {reason}{log_note(last[-1].log)}; no "
        "configuration seems to be the cause: fix the training script (or the machine) and "
        "start again"
    )


# How the stop reason of a search whose budget ended it begins (advice that more trials would
# help is given only then).
BUDGET_USED_UP = "--max-trials used up"


def no_search_trial_succeeded(finished: list[TrialRecord]) -> str | None:
    """Where search trials ran and none completed: how many, and their most common reason
    with a log to read (None otherwise). "--max-trials used up" alone read as if trials had
    run and merely found nothing better."""
    searched = [r for r in finished if r.kind is TrialKind.SEARCH]
    if not searched or any(r.status is TrialStatus.COMPLETED for r in searched):
        return None
    reasons: dict[str, list[TrialRecord]] = {}
    for record in searched:  # alike where only a port, a step count or a directory differs
        reasons.setdefault(failure_key(record) or record.status.value, []).append(record)
    alike = max(reasons.values(), key=len)
    reason = first_line(alike[-1].error, STOP_REASON_CHARS) or alike[-1].status.value
    which = (
        "the one search trial did not succeed; it ended with"
        if len(searched) == 1
        else f"none of the {len(searched)} search trials succeeded; {len(alike)} ended with"
    )
    return f"{which}: {reason}{log_note(alike[-1].log)}"


def repeated_machine_failure(finished: list[TrialRecord]) -> str | None:
    """A stop reason when the machine failed the last trials on every attempt (a GPU gone, a
    disk full): each would take its attempts in turn and say nothing of its configuration."""
    last = finished[-MACHINE_FAILURES_TO_STOP:]
    if len(last) < MACHINE_FAILURES_TO_STOP or any(
        r.cause is not FailureCause.MACHINE for r in last
    ):
        return None
    error = first_line(last[-1].error, STOP_REASON_CHARS)
    why = error.rpartition("not its configuration: ")[2]  # the driver's
    remedy = "fix the machine"
    if FROM_OUTSIDE in why:
        remedy = f"find what stops them ({WHO_ELSE})"
    return (
        f"the machine failed the last {len(last)} trials on every attempt, not their "
        f"configurations: {why}{log_note(last[-1].log)}; {remedy} and start again"
    )


@dataclasses.dataclass
class SearchEnding:
    """Why the search stopped, and the confirmation round's progress (saved with the state)."""

    shutdown_reason: str | None = None
    confirmation_candidates: list[str] = dataclasses.field(default_factory=list)
    search_end_reason: str = ""
    unsafe_memory: bool = False  # every configuration that ran leaves too little memory
    extra_rounds: int = 0  # runs of leaders the estimate and the runs disagreed on
    handover_reason: str = ""  # why the handed-over configuration won, in plain words
    stopped_from_outside: bool = False  # a trial stopped by a user ended it (method.abandon)

    def stop_reason(self, method: DsatSearchMethod) -> str | None:
        """Why the search must stop now, whatever is still queued; None to go on."""
        if method.model_profile_failed():
            profile = method.tracker.model_profile
            assert profile is not None  # it failed
            climbed = len(method.tracker.model_profiles)
            untried = rungs_left_out(method.zero_stages, method.settings.offload_nvme)
            return profile_failure(profile, [r.name for r in method.fit_rungs[:climbed]], untried)
        repeated = repeated_failure(method.tracker.finished)
        if repeated is not None:
            return repeated
        if method.early_stopping_triggered():
            patience = method.settings.early_stopping
            return (
                f"early stopping (--early-stopping {patience}): no improvement in the last "
                f"{patience} trials"
            )
        if len(method.tracker.finished) >= method.tracker.max_trials:
            return f"{BUDGET_USED_UP} ({method.settings.max_trials})"
        return None

    def should_shutdown(self, method: DsatSearchMethod) -> bool:
        tracker = method.tracker
        if self.handed_over(method):
            return True  # a finished search resumed: as it was
        ignored = script_batch_ignored(tracker.finished)
        if ignored is not None:  # no trial measured its configuration: nothing to confirm
            for request_id in list(tracker.queue):
                tracker.discard(request_id)
            self.shutdown_reason = ignored
            return True
        if self.confirming(method):
            if tracker.running or tracker.queue:
                return False
            return self._end_confirmation(method)
        reason = self.stop_reason(method)
        if reason is None and not tracker.running:
            if not tracker.queue or tracker.num_started >= tracker.max_trials:
                reason = "no configuration left to try"
        unconfirmed = tracker.confirmed_id is None
        # Something ran (tracker.best() skips trials over the memory margin, so it cannot tell).
        if reason is not None and unconfirmed and tracker.successful_stages:
            for request_id in list(tracker.queue):  # the search is over: nothing more of it runs
                tracker.discard(request_id)
            if tracker.running:
                return False  # the confirmation round starts once the last search trial ends
            self.unsafe_memory = False  # worked out again: a resumed search may have run more
            if self._start_confirmation(method, reason):
                return False
            if self.unsafe_memory:
                reason = (
                    f"{reason}, but every configuration that ran leaves less than "
                    f"{method.settings.memory_margin:.0%} of the device's memory free "
                    "(--memory-margin); none is handed over"
                )
        if reason is not None:
            self.shutdown_reason = reason
        return reason is not None

    def handed_over(self, method: DsatSearchMethod) -> bool:
        """Whether the search has ended and handed its configuration over."""
        return self.shutdown_reason is not None and method.tracker.confirmed_id is not None

    def confirming(self, method: DsatSearchMethod) -> bool:
        return bool(self.confirmation_candidates) and method.tracker.confirmed_id is None

    def _start_confirmation(self, method: DsatSearchMethod, reason: str) -> bool:
        """Queue the runs of the confirmation round; False when there is nothing to confirm."""
        tracker, settings = method.tracker, method.settings
        candidates = leaders(tracker, settings.confirm_top, method.leader_score())
        runs = (
            next_round(tracker, candidates, search_trials(tracker))
            if settings.confirm_top > 1
            else []
        )
        if not runs:
            if candidates:
                tracker.confirmed_id = candidates[0].request_id
                # The summary's "handed over:" line was missing where no round ran.
                self.handover_reason = f"{candidates[0].name}: " + (
                    f"the best of the search (--confirm-top {settings.confirm_top}: no "
                    "confirmation round)"
                    if settings.confirm_top <= 1
                    else "the only configuration this search ran that may be handed over "
                    "(no other to compare it with in a confirmation round)"
                )
            else:
                self.unsafe_memory = True
            return False
        self.search_end_reason = reason
        self.confirmation_candidates = [c.request_id for c in candidates]
        check = self._memory_check(method, candidates[0])
        self._queue_runs(method, runs)
        tracker.max_trials += check is not None
        logger.info(
            "search ends: %s; confirmation round: one run each of the %d leading "
            "configurations (%s), interleaved, again where the runs differ",
            reason,
            len(candidates),
            ", ".join(c.name for c in candidates),
        )
        return True

    def _memory_check(self, method: DsatSearchMethod, leader: TrialRecord) -> TrialRecord | None:
        """Queue a run of the leader's configuration that shows where the OOMs begin, when that
        decides whether it may be handed over (usable_memory.memory_check)."""
        tracker = method.tracker
        found = method.memory_check()  # about ``leader``, the round's first
        if found is None:
            return None
        section, mbs = found
        check = method.register(method.make_trial(TrialKind.SEARCH, section, mbs))
        if check is None:
            return None
        tracker.enqueue([check.request_id])
        logger.info(
            "memory check: %s's configuration at micro-batch %d%s, to see where the OOMs begin "
            "(the margin applies to the memory a run can use, not the device's total)",
            leader.name,
            mbs,
            "" if section == leader.zero_section else " with other bucket sizes",
        )
        return check

    def _end_confirmation(self, method: DsatSearchMethod) -> bool:
        """Decide what the round showed; False when leaders run again first (the estimate and
        their runs disagree by more than the noise: measure again rather than overrule)."""
        tracker = method.tracker
        # What the round (and a memory check) showed: a leader that ran out of memory, or now
        # leaves too little of what the OOMs show is usable, is not handed over.
        candidates = [
            c
            for c in (tracker.get(i) for i in self.confirmation_candidates)
            if tracker.may_hand_over(c)
        ]
        if not self.extra_rounds:
            again = next_round(tracker, candidates, search_trials(tracker))
            if again:
                self._queue_runs(method, again)
                logger.info(
                    "confirmation round: the runs differ by more than %.0f%%; running the "
                    "leaders again",
                    100 * QUIET_SPREAD,
                )
                return False
        verdict = decide(
            tracker,
            candidates,
            method.leader_score(),
            measure_again=self.extra_rounds < EXTRA_ROUNDS,
        )
        if verdict.again:
            self.extra_rounds += 1
            self._queue_runs(method, list(verdict.again))
            logger.info(
                "confirmation round: %s leads by the estimate but %s measured faster in its "
                "runs, by more than the noise; running both again",
                verdict.again[0].name,
                verdict.again[1].name,
            )
            return False
        chosen, reason = verdict.chosen, verdict.reason
        if chosen is None:  # no leader ran again safely: the best of the search that may
            ranked = leaders(tracker, 1, method.leader_score())
            if not ranked:
                self.unsafe_memory = True
                self.shutdown_reason = (
                    f"{self.search_end_reason}, but no configuration that ran leaves "
                    f"{method.settings.memory_margin:.0%} of the usable memory free "
                    "(--memory-margin); none is handed over"
                )
                return True
            chosen = ranked[0]
            reason = "no leader ran again safely; the best of the search that may be handed over"
            logger.info("confirmation round: no leader ran again safely; keeping %s", chosen.name)
        again = measure_yours_again(method, chosen)
        if again:  # the verdict is the same when the round ends again: its runs are as they were
            tracker.enqueue([r.request_id for r in again])
            logger.info(
                "confirmation round: your config's run was unsteady and level with %s for that; "
                "running it again",
                chosen.name,
            )
            return False
        tracker.confirmed_id = chosen.request_id
        self.handover_reason = f"{chosen.name}: {reason}"
        self.shutdown_reason = f"{self.search_end_reason}; confirmed {chosen.name}"
        return True

    def _queue_runs(self, method: DsatSearchMethod, leaders_again: list[TrialRecord]) -> None:
        """Queue one more confirmation run of each of ``leaders_again``, on top of the trials."""
        tracker = method.tracker
        for candidate in leaders_again:
            index = method.next_index
            run = candidate.replace(
                request_id=method.builder.request_id(index),
                index=index,
                kind=TrialKind.CONFIRM,
                parent_id=candidate.request_id,
                status=TrialStatus.QUEUED,
                metrics={},
                error=None,
            )
            if method.register(run) is not None:
                tracker.enqueue([run.request_id])
                tracker.max_trials += 1

    def search_failed(self, method: DsatSearchMethod) -> bool:
        """A search with no successful trial (or no model profile, or only configurations that
        leave too little memory, or trials that all ran the script's own batch) has failed."""
        return (
            method.model_profile_failed()
            or method.tracker.best() is None
            or self.unsafe_memory
            or script_batch_ignored(method.tracker.finished) is not None
        )
