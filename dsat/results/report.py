"""A search's report: its trials drawn (report.png) and a self-contained page (report.html).

Everything comes from the results directory as any runner leaves it (``trials.jsonl``,
``settings.json``, ``best_ds_metrics.json``), so a finished, an interrupted and a resumed search
are reported alike. matplotlib is an optional extra (``dsat[report]``): a search never needs it.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import html
import io
import json
from pathlib import Path
from typing import Any

from dsat.atomic_file import write_bytes_atomic, write_text_atomic
from dsat.constants import AUTOTUNING_KEY, SETTINGS_FILE
from dsat.errors import DsatError
from dsat.experiment.metric import Metric
from dsat.experiment.settings import DEFAULT_METRIC
from dsat.paths import shown
from dsat.results.cost import COST_PREFIX, search_cost
from dsat.results.directory import (
    BEST_CONFIG_FILE,
    BEST_METRICS_FILE,
    HANDED_OVER_PREFIX,
    SAFE_KEY,
    SUMMARY_FILE,
    TRIALS_FILE,
    VALUE_KEY,
    read_trial_rows,
)
from dsat.results.resume import readable_state, refuse_lost_rows, saved_settings
from dsat.results.utilization import DERIVED_KEYS, MFU_KEY, TOKENS_KEY

REPORT_PNG = "report.png"
REPORT_HTML = "report.html"
INSTALL_HINT = "pip install matplotlib (or reinstall dsat from its clone with the extra: pip install -e '/path/to/dsat[report]')"
FAILED_MARKERS = {
    "oom": ("x", "out of memory"),
    "error": ("^", "error"),
    "timeout": ("v", "timeout"),
}


@dataclasses.dataclass(frozen=True)
class SearchResults:
    """What a report shows: the rows of trials.jsonl, the metric, and the handed-over trial."""

    rows: list[dict[str, Any]]
    metric: Metric
    picked: dict[str, Any] | None
    metric_unknown: str | None = None  # why the metric is the default, not the search's
    handed_over: bool = True  # False: the search has not ended, and picked is its best so far

    @property
    def picked_label(self) -> str:
        """How the picked trial is named: only a search that ended handed one over."""
        return "picked" if self.handed_over else "best so far"

    @property
    def search_rows(self) -> list[dict[str, Any]]:
        return [row for row in self.rows if row.get("kind") == "search"]

    @property
    def confirm_rows(self) -> list[dict[str, Any]]:
        return [row for row in self.rows if row.get("kind") == "confirm"]

    def value(self, row: dict[str, Any]) -> float | None:
        """The row's metric as the search ranked it; a search that wrote no such figure (before
        it counted a trial's FLOPs once) is drawn by the trial's own."""
        if row.get("status") != "completed":
            return None
        if VALUE_KEY in row:
            value = row[VALUE_KEY]
        else:
            metrics = row.get("metrics") or {}
            value = metrics.get(self.metric.file_key, metrics.get(self.metric.value))
        return None if value is None else float(value)

    def best_run(
        self, rows: list[dict[str, Any]], safe_only: bool = False
    ) -> tuple[float, dict[str, Any]] | None:
        """The best completed run among ``rows``, with its value; None if none completed.
        ``safe_only``: among those the search may hand over, as its summary ranks them (a row
        from before the search wrote that judgement counts)."""
        best: tuple[float, dict[str, Any]] | None = None
        for row in rows:
            if safe_only and row.get(SAFE_KEY) is False:
                continue
            value = self.value(row)
            if value is not None and (best is None or self.metric.is_better(value, best[0])):
                best = (value, row)
        return best

    def cost_line(self) -> str:
        """What the search cost: every recorded trial's slots x time (``results/cost.py``)."""
        return search_cost(self.rows).line()

    @property
    def stages(self) -> list[int]:
        return sorted({int(row["zero_stage"]) for row in self.search_rows})

    def best_so_far(self) -> list[tuple[int, float, float]]:
        """(trials finished, seconds since the first start, best value so far) per search trial,
        in the order they finished (a trial's number is its launch's, out of order when trials
        run at once)."""
        if not self.rows:
            return []
        origin = min(float(row.get("start", 0.0)) for row in self.rows)
        best: float | None = None
        points = []
        for finished, row in enumerate(self.rows, start=1):
            if row.get("kind") != "search":
                continue
            value = None if row.get(SAFE_KEY) is False else self.value(row)
            if value is not None and (best is None or self.metric.is_better(value, best)):
                best = value
            if best is not None:
                points.append((finished, float(row["end"]) - origin, best))
        return points


def refuse_lost_rows_here(results_dir: Path, state: dict[str, Any] | None) -> None:
    """Where the saved state names finished trials trials.jsonl has no row for (the file gone,
    emptied), one line saying so, not "no trial has finished yet". Without a state to read, the
    rows alone say what there is."""
    if state is not None and isinstance(state["tracker"].get("records"), list):
        refuse_lost_rows(results_dir, state, then="to report the search")


def load_results(results_dir: Path) -> SearchResults:
    """The results in ``results_dir``, or one line saying what is missing or damaged."""
    path = results_dir / TRIALS_FILE
    if not results_dir.is_dir():
        what = "not a directory" if results_dir.exists() else "no such directory"
        raise DsatError(f"{shown(results_dir)}: {what}; pass the results directory a search wrote")
    state = readable_state(results_dir)
    refuse_lost_rows_here(results_dir, state)
    if not path.is_file() and (results_dir / SETTINGS_FILE).is_file():
        # A search began there (interrupted in its first trial): not "pass a search's directory".
        raise DsatError(f"{shown(results_dir)}: no trial has finished yet; report it once one has")
    if not path.is_file():
        raise DsatError(
            f"{shown(results_dir)}: no {TRIALS_FILE} there; pass a directory a dsat search wrote"
        )
    try:
        rows = read_trial_rows(path)
    except ValueError as err:
        raise DsatError(f"{shown(path)}: {err}; put back the file as dsat wrote it") from None
    if not rows:
        raise DsatError(f"{shown(path)}: no trial has finished yet; report it once one has")
    metric, unknown = DEFAULT_METRIC, None
    saved = (state or {}).get("metric")
    try:
        metric = saved_settings(results_dir).metric
    except DsatError:
        if saved in {m.value for m in Metric}:  # a Determined checkpoint's state says it
            metric = Metric(saved)
        else:  # the default metric still makes a picture, said to be one
            unknown = (
                f"{shown(results_dir / SETTINGS_FILE)} is missing or damaged: the trials are "
                f"ranked by {DEFAULT_METRIC.value}, the default metric, which may not be the "
                "search's"
            )
    picked = picked_row(rows, results_dir / BEST_METRICS_FILE)
    # best_ds_metrics.json is written as a search goes: an interrupted one's report named its
    # best so far "picked". Without a state (a Determined checkpoint, one deleted), the summary
    # says whether it handed over: an interrupted search's (none yet) read as handed over.
    if state is None:
        handed_over = said_it_handed_over(results_dir / SUMMARY_FILE)
    else:
        handed_over = state["tracker"].get("confirmed_id") is not None
    return SearchResults(rows, metric, picked, unknown, handed_over)


def said_it_handed_over(summary: Path) -> bool:
    """Whether a search's summary has its "handed over:" line (one that handed nothing over
    says "handed over: nothing")."""
    try:
        lines = summary.read_text(errors="replace").splitlines()
    except OSError:
        return False
    prefix = f"{HANDED_OVER_PREFIX} "
    return any(
        line.startswith(prefix) and not line.startswith(f"{prefix}nothing") for line in lines
    )


def picked_row(rows: list[dict[str, Any]], best_metrics: Path) -> dict[str, Any] | None:
    """The trial whose metrics were handed over (best_ds_metrics.json), if any yet."""
    try:
        metrics = json.loads(best_metrics.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    # Compared by what the trial measured: the MFU derived beside it in either file counts its
    # FLOPs at the least a sample the search knew when that file was written, which can differ.
    matches = [row for row in rows if _measured(row.get("metrics")) == _measured(metrics)]
    # Two configurations can measure alike to the last digit (a simulated surface): the one
    # best_ds_config.json holds is the one handed over.
    try:
        config = json.loads((best_metrics.parent / BEST_CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        config = None
    held = [row for row in matches if _within(row.get("overwrites"), config)]
    return (held or matches)[-1] if matches else None


def _within(overwrites: Any, config: Any) -> bool:
    """Whether ``config`` holds every override of a trial (dsat's autotuning block aside)."""
    if not isinstance(overwrites, dict) or not isinstance(config, dict):
        return bool(overwrites == config)
    return all(
        key == AUTOTUNING_KEY or _within(value, config.get(key))
        for key, value in overwrites.items()
    )


def _measured(metrics: Any) -> Any:
    if not isinstance(metrics, dict):
        return metrics
    # best_ds_metrics.json's ranked value is its row's beside the metrics, not among them.
    ignored = {*DERIVED_KEYS, VALUE_KEY}
    return {key: value for key, value in metrics.items() if key not in ignored}


def stage_table(results: SearchResults) -> str:
    """The per-stage summary the terminal gets: trials, failures and the best of each stage."""
    lines = [
        f"| stage | trials | oom / error / timeout | over the memory margin | best "
        f"{results.metric.value} (within the margin) | config |",
        "| ---: | ---: | :---: | ---: | ---: | :--- |",
    ]
    for stage in results.stages:
        rows = [row for row in results.search_rows if row["zero_stage"] == stage]
        failed = "/".join(
            str(sum(row["status"] == status for row in rows)) for status in FAILED_MARKERS
        )
        found = results.best_run(rows, safe_only=True)
        best, name = (f"{found[0]:.4g}", str(found[1]["name"])) if found else ("-", "-")
        over = sum(row.get(SAFE_KEY) is False and row["status"] == "completed" for row in rows)
        lines.append(f"| {stage} | {len(rows)} | {failed} | {over} | {best} | {name} |")
    return "\n".join(lines)


def import_pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise DsatError(
            f"the report needs matplotlib, which is not installed: {INSTALL_HINT}"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(results: SearchResults) -> bytes:
    """The four panels as PNG bytes."""
    plt = import_pyplot()
    figure, axes = plt.subplots(2, 2, figsize=(13, 9))
    draw_throughput(axes[0][0], results)
    draw_memory(axes[0][1], results)
    draw_progress(axes[1][0], axes[1][1], results)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    plt.close(figure)
    return buffer.getvalue()


# Characters of a configuration's name on one line of a label: about 40% of a panel's width.
LABEL_LINE_CHARS = 26


def name_lines(name: str) -> list[str]:
    """A configuration's name broken between its settings (``z3_mb20_..._offload-opt-cpu``), so
    that its label stays inside the panel: one line of 80 characters ran off its side."""
    lines: list[str] = []
    for part in name.split("_"):
        if lines and len(lines[-1]) + 1 + len(part) <= LABEL_LINE_CHARS:
            lines[-1] += f"_{part}"
        else:
            lines.append(part)
    return lines


def draw_throughput(ax: Any, results: SearchResults) -> None:
    metric = results.metric.value
    floor = min((v for r in results.search_rows if (v := results.value(r)) is not None), default=0)
    for stage in results.stages:
        rows = [row for row in results.search_rows if row["zero_stage"] == stage]
        done = sorted((row["mbs"], v) for row in rows if (v := results.value(row)) is not None)
        # Every run a dot; the line joins each micro-batch's best (other knobs share an x).
        best = {
            mbs: found[0]
            for mbs in sorted({m for m, _ in done})
            if (found := results.best_run([r for r in rows if r["mbs"] == mbs]))
        }
        line = ax.plot(list(best), list(best.values()), "-", label=f"ZeRO-{stage}")
        color = line[0].get_color()
        ax.scatter([m for m, _ in done], [v for _, v in done], color=color, s=18)
        for status, (marker, _) in FAILED_MARKERS.items():
            failed = [row["mbs"] for row in rows if row["status"] == status]
            ax.scatter(failed, [floor] * len(failed), marker=marker, color=color, s=60)
    for marker, words in FAILED_MARKERS.values():
        ax.scatter([], [], marker=marker, color="grey", label=words)
    picked = results.picked
    if picked is not None and (value := results.value(picked)) is not None:
        ax.scatter([picked["mbs"]], [value], s=300, facecolors="none", edgecolors="red", lw=2)
        # Its label on the sides with room: a pick at the left edge had its name cut off, and
        # one at the top ran into the panel's title; a long name (offload's knobs) in lines.
        drawn = [int(row["mbs"]) for row in results.search_rows]
        left = picked["mbs"] <= (min(drawn) + max(drawn)) / 2
        values = [v for row in results.search_rows if (v := results.value(row)) is not None]
        below = value >= (min(values, default=value) + max(values, default=value)) / 2
        ax.annotate(
            "\n".join(name_lines(f"{results.picked_label}: {picked['name']}")),
            (picked["mbs"], value),
            color="red",
            xytext=(12 if left else -12, -14 if below else 12),
            textcoords="offset points",
            ha="left" if left else "right",
            va="top" if below else "baseline",
        )
        again = [
            v
            for r in results.confirm_rows
            if r["name"] == picked["name"]
            if (v := results.value(r)) is not None
        ]
        if again:
            spread = [value, *again]
            ax.vlines(
                picked["mbs"],
                min(spread),
                max(spread),
                color="red",
                lw=3,
                label="confirmation round spread",
            )
    ax.set_xlabel("micro-batch size per GPU")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} against micro-batch (failures drawn at the bottom)")
    ax.legend(fontsize=8)


def draw_memory(ax: Any, results: SearchResults) -> None:
    device = None
    drawn = False
    for stage in results.stages:
        points = []
        for row in results.search_rows:
            metrics = row.get("metrics") or {}
            if row["zero_stage"] == stage and metrics.get("memory_peak_bytes"):
                points.append((row["mbs"], metrics["memory_peak_bytes"] / 2**30))
                device = metrics.get("memory_total_bytes") or device
        if points:
            ax.scatter(*zip(*points, strict=True), label=f"ZeRO-{stage}", s=18)
            drawn = True
    ax.set_xlabel("micro-batch size per GPU")
    ax.set_ylabel("peak memory, GiB")
    ax.set_title("peak memory against the device's")
    if not drawn:  # the built-in surfaces measure none
        ax.text(
            0.5,
            0.5,
            "no search trial measured its peak memory",
            ha="center",
            transform=ax.transAxes,
        )
        return
    if device:  # a simulator of the user's may give the peaks alone
        ax.axhline(device / 2**30, color="black", ls="--", label="device memory")
    ax.legend(fontsize=8)


def draw_progress(by_trial: Any, by_time: Any, results: SearchResults) -> None:
    points = results.best_so_far()
    metric = results.metric.value
    by_trial.step([t for t, _, _ in points], [b for _, _, b in points], where="post")
    by_trial.set_xlabel("trials finished")
    by_time.step([s for _, s, _ in points], [b for _, _, b in points], where="post")
    by_time.set_xlabel("wall time, s")
    for ax in (by_trial, by_time):
        ax.set_ylabel(f"best {metric} so far")
        ax.set_title("the search's progress")


def page(results: SearchResults, results_dir: Path, png: bytes) -> str:
    """A self-contained HTML page: the picture inline, the summary with the cost, every trial."""
    try:
        text = (results_dir / SUMMARY_FILE).read_text(errors="replace")
    except OSError:  # none yet (an interrupted search), or not a file
        text = stage_table(results) + "\n"
    if not any(line.startswith(COST_PREFIX) for line in text.splitlines()):  # none written yet
        if not results.handed_over and results.picked is not None:
            # An interrupted search's: the terminal and the picture name it, the page did not.
            text += f"\n{results.picked_label}: {results.picked['name']}"
        text += "\n" + results.cost_line() + "\n"
    # Tokens/s and MFU where the search could work them out (results/utilization.py).
    shown_rates = [
        (key, title)
        for key, title in ((TOKENS_KEY, "tokens/s"), (MFU_KEY, "MFU"))
        if any(key in (row.get("metrics") or {}) for row in results.rows)
    ]
    rows = []
    for row in results.rows:
        value = results.value(row)
        metrics = row.get("metrics") or {}
        peak = metrics.get("memory_peak_bytes")
        cells = [
            row.get("trial"),
            row.get("kind"),
            row.get("name"),
            row.get("status"),
            "" if value is None else f"{value:.4g}",
            "" if not peak else f"{peak / 2**30:.2f}",
            f"{float(row.get('end', 0.0)) - float(row.get('start', 0.0)):.1f}",
        ]
        for key, _ in shown_rates:
            rate = metrics.get(key)
            cells.append("" if rate is None else f"{rate:.1%}" if key == MFU_KEY else f"{rate:.4g}")
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    rate_headers = "".join(f"<th>{title}</th>" for _, title in shown_rates)
    image = base64.b64encode(png).decode()
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>dsat report: {html.escape(results_dir.name)}</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:2px 8px;text-align:right}}
tr:nth-child(even){{background:#f4f4f4}}</style></head><body>
<h1>dsat report: {html.escape(results_dir.name)}</h1>
<img alt="the search drawn" src="data:image/png;base64,{image}">
<h2>Summary</h2><pre>{html.escape(text)}</pre>
<h2>Trials</h2><table><tr><th>trial</th><th>kind</th><th>config</th><th>status</th>
<th>{html.escape(results.metric.value)}</th><th>peak GiB</th><th>time, s</th>{rate_headers}</tr>
{"".join(rows)}
</table></body></html>
"""


def report_to_terminal(results_dir: Path) -> None:
    """`dsat report DIR`: the files written, then the per-stage table and their paths."""
    results = load_results(results_dir)
    if results.metric_unknown is not None:
        print(f"dsat: {results.metric_unknown}")
    print(stage_table(results))
    if results.picked is not None:
        print(f"{results.picked_label}: {results.picked['name']}")
    print(results.cost_line())
    try:
        png, page_path = write_report(results_dir, results)
    except OSError as err:  # the table above is the report's; the files are left as they were
        raise DsatError(
            f"cannot write {REPORT_PNG} and {REPORT_HTML} into {shown(results_dir)} "
            f"({err.strerror or err}); make it writable, or move away what stands in their "
            "place, and run it again (the table above is the report's)"
        ) from None
    print(f"dsat: report: {shown(png)}, {shown(page_path)}")


def write_report(results_dir: Path, results: SearchResults | None = None) -> tuple[Path, Path]:
    """Write report.png and report.html into ``results_dir`` (from ``results`` when already
    loaded from it); returns their paths."""
    if results is None:
        results = load_results(results_dir)
    png = draw(results)
    text = page(results, results_dir, png)
    png_path, html_path = results_dir / REPORT_PNG, results_dir / REPORT_HTML
    for path in (png_path, html_path):  # neither written where the other cannot be
        if path.exists() and not path.is_file():
            raise IsADirectoryError(errno.EISDIR, "not a file", str(path))
    write_bytes_atomic(png_path, png)
    write_text_atomic(html_path, text)
    return png_path, html_path
