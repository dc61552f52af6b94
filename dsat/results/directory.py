"""The results directory: what a user keeps from a search, written atomically as trials finish.

trials.jsonl           one JSON object per finished trial
best_ds_config.json    the best trial's full DeepSpeed config, ready for deepspeed.initialize
best_ds_metrics.json   its metrics
dsat_search_state.json the search method's state, for --resume
summary.txt            the per-stage table, at the end, and what the search cost
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsat.atomic_file import write_json_atomic, write_text_atomic
from dsat.constants import AUTOTUNING_KEY, DSAT_MODE_KEY, OVERWRITE_KEY, RUN_ALONE
from dsat.errors import DsatError
from dsat.experiment.metric import positive_number
from dsat.paths import logs_where_they_are, shown
from dsat.results.cost import INTERRUPTED_KEY, MACHINE_FAILED_KEY, search_cost
from dsat.results.utilization import Utilization
from dsat.search.confirmation import rounds_note
from dsat.search.tracker import TrialTracker
from dsat.trial import TrialKind, TrialOutcome, TrialRecord, TrialStatus
from dsat.trial_failure import first_line

if TYPE_CHECKING:
    from dsat.search.method import DsatSearchMethod

TRIALS_FILE = "trials.jsonl"
BEST_CONFIG_FILE = "best_ds_config.json"
BEST_METRICS_FILE = "best_ds_metrics.json"
SUMMARY_FILE = "summary.txt"
# A row's searched metric as the search ranks it (FLOPs counted once: TrialTracker.model_flops),
# where its ``metrics`` keep the trial's own figures.
VALUE_KEY = "value"
# Whether the search may hand the trial over: it completed, left the memory margin of what the
# OOMs show is usable, and no later run of it ran out of memory (the tracker's judgement, which
# a later OOM can change, so rewritten with every row).
SAFE_KEY = "may_hand_over"
# The summary's line that says why the handed-over configuration won.
HANDED_OVER_PREFIX = "handed over:"
# Where --run-full-experiment trains on this machine (the local runner's copy of MODEL_DIR).
FULL_RUN_DIR = "full-experiment"


def full_run_log(results_dir: Path) -> Path:
    """Where a full run's output goes, on every runner: the mark that one has run."""
    return results_dir / "logs" / f"{FULL_RUN_DIR}.log"


def trials_numbered(results_dir: Path) -> int:
    """The highest number a trial's log or directory in ``results_dir`` carries ("007-…"):
    a resumed search numbers on from it, so that a trial run again (the interrupted one) does
    not take its earlier run's name and overwrite its log."""
    numbers = [
        int(path.name.partition("-")[0])
        for folder in ("logs", "trials")
        if (results_dir / folder).is_dir()
        for path in (results_dir / folder).iterdir()
        if path.name.partition("-")[0].isdigit()
    ]
    return max(numbers, default=0)


_NUMBER = (int, float)
# What every reader of a row relies on, by type (as dsat has written them since its first rows);
# then what it writes now, checked where a row has it (older rows lack some).
ROW_KEYS: dict[str, tuple[type, ...]] = {
    "trial": (int,),
    "request_id": (str,),
    "kind": (str,),
    "status": (str,),
    "zero_stage": (int,),
    "mbs": (int,),
    "start": _NUMBER,
    "end": _NUMBER,
}
LATER_ROW_KEYS: dict[str, tuple[type, ...]] = {
    "gas": (int,),
    "name": (str,),
    "metrics": (dict,),
    "overwrites": (dict,),
    "slots": (int,),
    "slot_kind": (str,),
    VALUE_KEY: (*_NUMBER, type(None)),
    SAFE_KEY: (bool,),
    MACHINE_FAILED_KEY: (list,),
    INTERRUPTED_KEY: (list,),
}


ROW_STATUSES = {status.value for status in TrialStatus if status.finished}
ROW_KINDS = {kind.value for kind in TrialKind}
MOST_SECONDS = 1e12  # seconds of search, or since 1970 (the Determined runner's)


def read_trial_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a trials.jsonl. A damaged file raises a ValueError that names the line and
    what is wrong with it (the decoder's own for bytes that are not UTF-8), which each reader
    words for its user: one edited row made the report, or a resume, end in a traceback."""
    rows = []
    seen: dict[str, int] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"line {number} is not JSON ({err.msg}: column {err.colno})") from None
        wrong = _wrong_key(row)
        if wrong is not None:
            raise ValueError(f"line {number} is not a trial's row ({wrong})")
        # dsat writes one row a trial (a trial run again replaces its row): a second one, pasted
        # in, was counted twice in the cost and kept by a resume.
        if row["request_id"] in seen:
            raise ValueError(
                f"line {number} repeats trial {row['trial']}'s row (line {seen[row['request_id']]})"
            )
        seen[row["request_id"]] = number
        rows.append(row)
    return rows


def _wrong_key(row: Any) -> str | None:
    """What makes ``row`` other than a row dsat writes, if anything."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    for key, types in (*ROW_KEYS.items(), *LATER_ROW_KEYS.items()):
        if key not in row:
            if key in ROW_KEYS:
                return f"no {key!r}"
            continue
        value = row[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return f"{key!r} is {json.dumps(value)}"
    # Values of the right type that no search writes: an unknown status passed for no failure,
    # an unknown kind counted as one in the cost, a time of 1e300 changed the GPU-hours.
    for key, known in (("status", ROW_STATUSES), ("kind", ROW_KINDS)):
        if row[key] not in known:
            return f"{key!r} is {json.dumps(row[key])}, not one of {', '.join(sorted(known))}"
    for key, possible in (
        ("zero_stage", row["zero_stage"] in (0, 1, 2, 3)),
        ("mbs", row["mbs"] >= 1),
    ):
        if not possible:
            return f"{key!r} is {json.dumps(row[key])}"
    if not 0 <= row["start"] <= row["end"] < MOST_SECONDS:
        return f"'start' {json.dumps(row['start'])} and 'end' {json.dumps(row['end'])}"
    return None


@dataclasses.dataclass(frozen=True)
class TrialTiming:
    start: float
    end: float
    machine_failed: tuple[dict[str, Any], ...] = ()  # the earlier runs, as the row keeps them

    @classmethod
    def of(cls, outcome: TrialOutcome) -> TrialTiming:
        earlier = tuple(
            {
                "start": run.start,
                "end": run.end,
                "error": first_line(run.error),
                "log": run.log,
                **({RUN_ALONE: True} if run.metrics.get(RUN_ALONE) else {}),
            }
            for run in outcome.machine_failed
        )
        return cls(outcome.start, outcome.end, earlier)

    def shifted(self, offset: float) -> TrialTiming:
        """The same times ``offset`` seconds later (a resumed search's clock carries on)."""
        return TrialTiming(
            self.start + offset,
            self.end + offset,
            tuple(
                {**run, "start": run["start"] + offset, "end": run["end"] + offset}
                for run in self.machine_failed
            ),
        )


def trial_line(
    record: TrialRecord,
    timing: TrialTiming,
    slots: int,
    slot_kind: str,
    utilization: Utilization | None = None,
    flops: float | None = None,
) -> dict[str, Any]:
    """Its row in trials.jsonl; the slots it held, with its start and end, are its cost. Its
    metrics carry tokens/s and MFU where ``utilization`` can work them out (MFU from ``flops``,
    the model's FLOPs counted once, where given)."""
    metrics = record.metrics
    if utilization is not None and record.status is TrialStatus.COMPLETED:
        metrics = {**metrics, **utilization.derived(metrics, flops)}
    return {
        "trial": record.number,
        "request_id": record.request_id,
        "kind": record.kind.value,
        "status": record.status.value,
        "zero_stage": record.zero_stage,
        "mbs": record.mbs,
        "gas": record.gas,
        "name": record.name,
        "overwrites": record.hparams.get(OVERWRITE_KEY, {}),
        "metrics": metrics,
        "error": record.error,
        "cause": None if record.cause is None else record.cause.value,  # whom a failure blames
        "log": record.log,
        "start": timing.start,
        "end": timing.end,
        "slots": slots,
        "slot_kind": slot_kind,
        **({MACHINE_FAILED_KEY: list(timing.machine_failed)} if timing.machine_failed else {}),
    }


def best_ds_config(
    record: TrialRecord, user_config: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The hand-over as DeepSpeed reads it: the trial's config without the autotuning block
    dsat merged into it, and with the user's own block (``user_config``'s) as they wrote it."""
    config: dict[str, Any] = copy.deepcopy(record.ds_config)
    config.pop(AUTOTUNING_KEY, None)
    if user_config is not None and AUTOTUNING_KEY in user_config:
        config[AUTOTUNING_KEY] = copy.deepcopy(user_config[AUTOTUNING_KEY])
    return config


def without_tuning(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """Hyperparameters for a real training run: the overrides kept, dsat's autotuning block and
    the cluster's dsat-mode switch removed."""
    cleaned: dict[str, Any] = copy.deepcopy(dict(hparams))
    overwrites = cleaned.get(OVERWRITE_KEY)
    if isinstance(overwrites, dict):
        overwrites.pop(AUTOTUNING_KEY, None)
    cleaned.pop(DSAT_MODE_KEY, None)
    return cleaned


def full_experiment_hparams(record: TrialRecord) -> dict[str, Any]:
    """The best trial's hyperparameters for a real training run: its overrides, minus tuning."""
    return without_tuning(record.hparams)


class ResultsWriter:
    """Keeps the results directory current; every file is replaced atomically.

    ``slot_kind``: what the trials' slots are, "GPU" or "CPU", for the cost in the summary.
    ``continued_clock``: the runner's clock carries on across a resume (the wall clock of a
    Determined search runner, restarted while its trials run on), so rows are not shifted."""

    def __init__(
        self,
        directory: Path,
        slot_kind: str = "GPU",
        utilization: Utilization | None = None,
        continued_clock: bool = False,
        user_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.user_config = user_config  # the user's DeepSpeed config (best_ds_config)
        self.slot_kind = slot_kind
        self.utilization = utilization or Utilization()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lines: list[dict[str, Any]] = []
        self._rows_moved = False
        path = self.directory / TRIALS_FILE
        if path.is_file():  # a resumed search keeps what was written before
            try:
                read = read_trial_rows(path)
                self._lines = logs_where_they_are(read, self.directory)
                # The directory moved: the rows say so by the summary, whether or not a trial runs.
                self._rows_moved = self._lines != read
            except ValueError as err:
                raise DsatError(
                    f"{shown(path)}: {err}; put back the file as dsat wrote it to resume, or "
                    "start a new search"
                ) from None
        self._best_id: str | None = None
        # A search resumed after it handed over: best_ds_config.json is the user's now (edited,
        # say, for a full run) and is left as it is where it is there.
        self.keep_best_config = False
        # A resumed search's runner counts time from its own start: carry on from the last end,
        # so start/end stay seconds of search (the time it was stopped left out).
        self.continued_clock = continued_clock
        self._clock_offset = 0.0
        self.runs_again(())

    def runs_again(self, request_ids: Collection[str]) -> None:
        """Carry on from the last end of the rows a resume keeps: a kill -9 between a trial's
        row and the state that said it finished left a row the trial's new run replaces, and
        the clock carried on after it, a hole of that trial's time in the search's seconds."""
        if not self.continued_clock:
            ends = [
                float(line.get("end", 0.0))
                for line in self._lines
                if line.get("request_id") not in request_ids
            ]
            self._clock_offset = max(ends, default=0.0)

    def carry_on_after(self, end: float) -> None:
        """Start this runner's clock no earlier than ``end`` seconds of search: a run before the
        stop that has no row (the machine failed it, or the stop cut it short; its trial runs
        again) ended then."""
        if not self.continued_clock:
            self._clock_offset = max(self._clock_offset, end)

    @property
    def lines(self) -> list[dict[str, Any]]:
        """The rows of trials.jsonl so far."""
        return list(self._lines)

    @property
    def clock_offset(self) -> float:
        """Seconds this runner's clock starts after the search's (a resumed search's)."""
        return self._clock_offset

    def trial_finished(
        self,
        record: TrialRecord,
        timing: TrialTiming,
        tracker: TrialTracker,
        interrupted: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """Its row into trials.jsonl, the whole file replaced: a full disk leaves the rows
        before. A trial that ran again on a resume (the search stopped after its row was
        written, before the state was) replaces its row instead of adding a second one.
        ``interrupted``: its runs a stop of the search cut short, in seconds of search."""
        shifted = timing.shifted(self._clock_offset)
        lines = list(self._lines)
        earlier = [i for i, line in enumerate(lines) if line.get("request_id") == record.request_id]
        position = earlier[0] if earlier else len(lines)
        line = trial_line(
            record,
            shifted,
            tracker.slots_per_trial,
            self.slot_kind,
            self.utilization,
            tracker.model_flops(record),
        )
        if interrupted:
            line[INTERRUPTED_KEY] = [dict(run) for run in interrupted]
        if earlier:
            lines[position] = line
        else:
            lines.append(line)
        # What the search ranks each trial by, as it counts it now: a trial's FLOPs are counted
        # at the least a sample any trial gave so far, which a later trial can lower.
        for row in lines:
            request_id = row.get("request_id")
            if isinstance(request_id, str) and request_id in tracker:
                row_record = tracker.get(request_id)
                row[VALUE_KEY] = tracker.measured_value(row_record)
                if isinstance(row.get("metrics"), dict):
                    # MFU counts the FLOPs as the value does, which a later trial can lower.
                    flops = tracker.model_flops(row_record)
                    row["metrics"].update(self.utilization.derived(row_record.metrics, flops))
                row[SAFE_KEY] = (  # the profile and the user's own run are never handed over
                    row_record.kind in (TrialKind.SEARCH, TrialKind.CONFIRM)
                    and row_record.status is TrialStatus.COMPLETED
                    and tracker.may_hand_over(row_record)
                )
        self._write_rows(lines)
        self._write_best(tracker)

    def _write_rows(self, lines: list[dict[str, Any]]) -> None:
        text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines)
        write_text_atomic(self.directory / TRIALS_FILE, text)
        self._lines = lines
        self._rows_moved = False

    def _write_best(self, tracker: TrialTracker, again: bool = False) -> None:
        best = tracker.best()
        if best is not None and (again or best.request_id != self._best_id):
            config_path = self.directory / BEST_CONFIG_FILE
            if not (self.keep_best_config and config_path.is_file()):
                write_json_atomic(config_path, best_ds_config(best, self.user_config))
            derived = self.utilization.derived(best.metrics, tracker.model_flops(best))
            # With the value the search ranked it by, as its row has it: at ZeRO-3 DeepSpeed's
            # profiler counts a sample's FLOPs twice, and FLOPS_per_gpu alone read as double.
            value = {VALUE_KEY: tracker.measured_value(best)}
            metrics = {**best.metrics, **derived, **value}
            write_json_atomic(self.directory / BEST_METRICS_FILE, metrics)
            self._best_id = best.request_id

    def write_summary(self, method: DsatSearchMethod, first: Sequence[str] = ()) -> str:
        """The summary at the end, with why the handed-over configuration won (the search's
        own words), the lines ``first`` (a stop from outside) and the search's notes (what
        became of the global batch, the user's own configuration against the hand-over), its
        throughput and what the search cost, and the best config as the search finally
        decided it (the confirmation round decides after its last trial is recorded). A
        failed search hands nothing over: the best config written as trials ended (one later
        found over the memory limit, or fed the script's own batch) is removed, so no one
        trains with it."""
        tracker, why = method.tracker, method.ending.handover_reason
        notes = [*first, *method.summary_notes()]
        failed = method.search_failed
        if failed:
            for name in (BEST_CONFIG_FILE, BEST_METRICS_FILE):
                (self.directory / name).unlink(missing_ok=True)
        else:
            self._write_best(tracker, again=True)  # its MFU as the FLOPs are counted at the end
        if self._rows_moved:
            self._write_rows(self._lines)
        cost = search_cost(self._lines, tracker.slots_per_trial, self.slot_kind)
        reason = f"{HANDED_OVER_PREFIX} {why}\n" if why else ""
        best = None if failed else tracker.best()
        rate = "" if best is None else self._rate_line(tracker, best)
        text = (
            summary_table(tracker)
            + confirmation_table(tracker)
            + "\n"
            + reason
            + "".join(f"{line}\n" for line in (*notes, rate) if line)
            + cost.line()
            + "\n"
        )
        write_text_atomic(self.directory / SUMMARY_FILE, text)
        return text

    def _rate_line(self, tracker: TrialTracker, best: TrialRecord) -> str:
        """Tokens/s and MFU of the handed-over configuration: the mean of its runs, as the
        global row's figure is (its search trial alone read one lucky run)."""
        runs = [
            r
            for r in (best, *tracker.confirmation_runs(best.request_id))
            if r.status is TrialStatus.COMPLETED
        ]
        rates = [v for r in runs if (v := positive_number(r.metrics.get("throughput"))) is not None]
        flops = [v for r in runs if (v := tracker.model_flops(r)) is not None]
        metrics = dict(best.metrics)
        if rates:
            metrics["throughput"] = sum(rates) / len(rates)
        mean_flops = sum(flops) / len(flops) if flops else None
        return self.utilization.line(metrics, mean_flops, tracker.slots_per_trial, len(runs))


def summary_table(tracker: TrialTracker) -> str:
    """DeepSpeed's autotuner summary: one row per ZeRO stage tried, then a global row."""
    searched = [r for r in tracker.finished if r.kind is TrialKind.SEARCH]
    rows: list[tuple[str, str, str, str]] = []
    for stage in sorted({r.zero_stage for r in searched}):
        in_stage = [r for r in searched if r.zero_stage == stage]
        rows.append(_row(f"z{stage}", in_stage, tracker))
    # The global row names what is handed over: the best measured trial, unless the
    # confirmation round (or a method's own estimate, guided's) chose another; its value is the
    # mean of every run of it, so that it reads as what the configuration measured.
    rows.append(_row("global", searched, tracker, tracker.best()))
    if tracker.confirmed_id is not None:
        chosen = tracker.get(tracker.confirmed_id)
        mean = tracker.mean_of_runs(chosen)
        if mean is not None:
            rows[-1] = ("global", rows[-1][1], f"{mean:.6g}", f"{chosen.name} (handed over)")
    header = ("tuning_space", "num_experiments", "best_metric_val", "best_exp_name")
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(4)]
    align = ["<", ">", ">", "<"]

    def fmt(cells: tuple[str, ...]) -> str:
        return (
            "| "
            + " | ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, align, widths, strict=True))
            + " |"
        )

    rule = (
        "| "
        + " | ".join(
            (":" + "-" * (w - 1)) if a == "<" else ("-" * (w - 1) + ":")
            for a, w in zip(align, widths, strict=True)
        )
        + " |"
    )
    note = (
        f"best_metric_val: {tracker.metric.value}, in {tracker.metric.unit}, a stage's best "
        "trial within the memory margin"
    )
    if tracker.confirmed_id is not None:
        note += "; global: the mean of every run of the handed-over configuration"
    return "\n".join([fmt(header), rule, *(fmt(row) for row in rows), note]) + "\n"


def confirmation_table(tracker: TrialTracker) -> str:
    """The confirmation round beside the search's own figures; empty when there was none."""
    runs = [r for r in tracker.finished if r.kind is TrialKind.CONFIRM]
    if not runs:
        return ""
    lines = [
        "",
        f"confirmation round ({tracker.metric.value}, runs interleaved):",
        "| config | in the search | run again | memory used |",
        "| :----- | ------------: | --------: | ----------: |",
    ]
    parents = [tracker.get(i) for i in dict.fromkeys(r.parent_id for r in runs if r.parent_id)]
    for leader in parents:
        parent_id = leader.request_id
        values = [tracker.confirmed_value(r) for r in runs if r.parent_id == parent_id]
        again = " / ".join(f"{v:.6g}" if v is not None else "failed" for v in values)
        searched = tracker.metric_value(leader)
        fraction = leader.memory_fraction
        memory = f"{fraction:.1%}" if fraction else "-"
        chosen = " (handed over)" if leader.request_id == tracker.confirmed_id else ""
        lines.append(
            f"| {leader.name}{chosen} | {searched:.6g} | {again} | {memory} |"
            if searched is not None
            else f"| {leader.name}{chosen} | - | {again} | {memory} |"
        )
    why = rounds_note(tracker, parents)
    if why is not None:
        lines.append(why)
    return "\n".join(lines) + "\n"


def _row(
    space: str,
    records: list[TrialRecord],
    tracker: TrialTracker,
    chosen: TrialRecord | None = None,
) -> tuple[str, str, str, str]:
    best = chosen or tracker.best_of(records)
    value = tracker.metric_value(best) if best is not None else None
    return (
        space,
        str(len(records)),
        f"{value:.6g}" if value is not None else "-",
        best.name if best is not None else "-",
    )
