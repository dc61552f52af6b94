"""`python3 -m dsat {guided,asha,binary,random} CONFIG_PATH MODEL_DIR [flags]`.

Flags and defaults follow determined.pytorch.dsat so its users can switch without surprises; every
flag is typed, and every user mistake ends as one ``dsat: error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import io
import logging
import math
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from dsat.closed_stdout import stdout_without_reader
from dsat.errors import USAGE_EXIT_CODE, DsatError
from dsat.experiment import settings as defaults
from dsat.experiment.metric import Metric
from dsat.experiment.settings import SearchSettings
from dsat.results.resume import resumed_settings
from dsat.runners import RunnerKind
from dsat.runners.local.trial_timeout import FLOOR_S, PROFILE_MULTIPLE, PROFILE_TRIAL_LIMIT_S
from dsat.training.step_clock import MEASURED_STEPS, WARMUP_STEPS

PROG = "dsat"


def positionals_first(method: str | None) -> str:
    """The fix where a flag that takes several values took CONFIG_PATH and MODEL_DIR too."""
    return (
        "put CONFIG_PATH and MODEL_DIR before the flags, e.g. "
        f"`python3 -m dsat {method or 'guided'} deepspeed.yaml . --include data`"
    )


class DsatArgumentParser(argparse.ArgumentParser):
    """argparse, but its usage errors become a one-line ``DsatError`` instead of usage + exit."""

    def error(self, message: str) -> None:  # type: ignore[override]
        parts = self.prog.split()
        method = parts[-1] if len(parts) > 1 else None
        if re.search(r"invalid \w+ value: '[^']*(\.ya?ml|/|\.)'$", message):
            message += f"; {positionals_first(method)}"  # `-z 1 2 deepspeed.yaml .`
        elif re.search(r"zero-stages: invalid int value: '\d+(,\s*\d+)+'$", message):
            message += "; separate the stages with spaces: --zero-stages 1 2"
        self._fail(message, method)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """As argparse's, but a flag the method does not take points to that method's help
        (argparse reports it from the top parser, whose help lists no method flags)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            method = getattr(parsed, "method", None)
            self._fail(
                f"unrecognized arguments: {' '.join(extras)}",
                method if isinstance(method, str) else None,
            )
        return parsed

    @staticmethod
    def _fail(message: str, subcommand: str | None) -> NoReturn:
        where = f"{subcommand} " if subcommand else ""
        raise DsatError(f"{message} (see `python3 -m dsat {where}--help`)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in its help, except a switch's: "--no-baseline ... (default: True)"
    reads as if the baseline were off; and except where there is none to show: "(default:
    None)" says nothing, and after a help that says in words what happens without the flag
    ("--trial-host ... the default") it contradicts it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 and isinstance(action.default, bool):
            return action.help
        if action.default is None or (action.help is not None and "(default:" in action.help):
            return action.help
        return super()._get_help_string(action)


def _typed(kind: Callable[[str], float], minimum: float, what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        # float() reads "nan" and "inf": a timeout of nan is never reached, a range factor of
        # inf overflows mid-search.
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = _typed(int, 1, "a positive integer")
non_negative_int = _typed(int, 0, "an integer of 0 or more")
positive_float = _typed(float, 1e-12, "a positive, finite number")
# It counts the model-profile trial: 1 was refused after 0 said "a positive integer".
trial_count = _typed(int, 2, "an integer of 2 or more (it counts the model-profile trial)")


def fraction(text: str) -> float:
    what = "a fraction of at least 0 and below 1"
    value = _typed(float, 0.0, what)(text)
    if value >= 1.0:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def absolute_path(text: str) -> str:
    """A path every trial reads alike: each runs in its own directory, on its own node."""
    path = os.path.expanduser(text)
    if not os.path.isabs(path):
        raise argparse.ArgumentTypeError(
            f"expected an absolute path (each trial runs in its own directory), got {text!r}"
        )
    return path


def _add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config_path",
        nargs="?",
        metavar="CONFIG_PATH",
        help="experiment config file (.yaml); may be left out with --resume",
    )
    parser.add_argument(
        "model_dir",
        nargs="?",
        metavar="MODEL_DIR",
        help="directory containing the model definition; may be left out with --resume",
    )
    parser.add_argument(
        "-i",
        "--include",
        nargs="+",
        default=[],
        metavar="PATH",
        help="additional files or folders to copy next to the model code for every trial",
    )
    parser.add_argument(
        "-mt",
        "--max-trials",
        type=trial_count,
        default=defaults.DEFAULT_MAX_TRIALS,
        help="maximum number of trials, including the model-profile trial (at least 2); the run "
        "of your own config (--no-baseline) and the confirmation round (--confirm-top) come on "
        "top",
    )
    parser.add_argument(
        "-ms",
        "--max-slots",
        type=positive_int,
        default=None,
        help="maximum number of slots (GPUs) in use at once",
    )
    parser.add_argument(
        "-mct",
        "--max-concurrent-trials",
        type=positive_int,
        default=defaults.DEFAULT_MAX_CONCURRENT_TRIALS,
        help="maximum number of trials at once",
    )
    parser.add_argument(
        "-m",
        "--metric",
        default=defaults.DEFAULT_METRIC.value,
        choices=Metric.names(),
        help="metric to optimise (forward, backward and latency: smaller is better)",
    )
    parser.add_argument(
        "--run-full-experiment",
        action="store_true",
        help="after the search, run the experiment once with the best configuration",
    )
    parser.add_argument(
        "-z",
        "--zero-stages",
        type=int,
        nargs="+",
        default=list(defaults.DEFAULT_ZERO_STAGES),
        choices=list(defaults.ALL_ZERO_STAGES),
        metavar="STAGE",
        help="ZeRO stages to search over, from 0 1 2 3",
    )
    parser.add_argument(
        "--start-profile-step",
        type=non_negative_int,
        default=defaults.DEFAULT_START_PROFILE_STEP,
        help="training step at which DeepSpeed starts profiling",
    )
    parser.add_argument(
        "--end-profile-step",
        type=positive_int,
        default=defaults.DEFAULT_END_PROFILE_STEP,
        help="training step at which DeepSpeed stops profiling and the trial ends; dsat's own "
        f"measurement needs a warm-up and a window: a trial runs up to {WARMUP_STEPS + MEASURED_STEPS} "
        "steps, fewer once its step time is steady (a longer window asked for here is measured "
        "whole)",
    )
    parser.add_argument(
        "-r",
        "--random-seed",
        type=non_negative_int,
        default=defaults.DEFAULT_RANDOM_SEED,
        help="seed of the search's random generator",
    )
    parser.add_argument(
        "--confirm-top",
        type=non_negative_int,
        default=defaults.DEFAULT_CONFIRM_TOP,
        metavar="N",
        help="after the search, run the N leading distinct configurations again, interleaved, "
        "and hand over the winner of that round (0 or 1: no confirmation round)",
    )
    parser.add_argument(
        "--global-batch",
        type=positive_int,
        default=None,
        metavar="N",
        help="keep the global batch (train_batch_size) at N in every trial and in the handed-over "
        "config: the micro-batch divides it, gradient accumulation makes up the rest (default: "
        'the config\'s numeric train_batch_size; with none or "auto" the batch is free)',
    )
    parser.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="do not run your own configuration once to compare the hand-over with (by default "
        "it runs after the model profile, on top of --max-trials)",
    )
    parser.add_argument(
        "--offload",
        action="store_true",
        help="also try configurations that keep the optimizer's states (ZeRO 1-3) or the "
        "parameters (ZeRO-3) on the CPU, even when the model fits without (they free memory "
        "for a larger micro-batch); a model that does not fit gets them anyway",
    )
    parser.add_argument(
        "--offload-nvme",
        type=absolute_path,
        default=None,
        metavar="PATH",
        help="where a model that fits no other way may offload to NVMe: the last rung dsat "
        "tries, after CPU offload (a fast local disk; it must exist on every node)",
    )
    parser.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens per sample, to report tokens/s (default: the hyperparameter seq_len, "
        "seq_length, sequence_length, max_seq_length or block_size, if any)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=positive_float,
        default=None,
        metavar="T",
        help="the GPU's peak TFLOPS at the trial's precision, to report MFU (default: from a "
        "table of common GPUs, by the trial's device)",
    )
    parser.add_argument(
        "--memory-margin",
        type=fraction,
        default=defaults.DEFAULT_MEMORY_MARGIN,
        metavar="F",
        help="never hand over a configuration whose peak memory leaves less than this fraction "
        "of the usable memory (what the OOMs show; the device's total until one does)",
    )
    parser.add_argument(
        "--search-runner-config",
        default=None,
        metavar="PATH",
        help="alternative config for the search-runner experiment (--runner determined)",
    )
    parser.add_argument(
        "--max-search-runner-restarts",
        type=non_negative_int,
        default=None,
        help="how often a crashed search runner is restarted (--runner determined; default: "
        f"{defaults.DEFAULT_MAX_SEARCH_RUNNER_RESTARTS}, or max_restarts in "
        "--search-runner-config)",
    )
    runners = ["auto", *(kind.value for kind in RunnerKind)]
    parser.add_argument(
        "--runner",
        default="auto",
        choices=runners,
        help="where trials run; auto = ray with --ray-address, else determined when DET_MASTER "
        "is set, else ray when RAY_ADDRESS is set, else local",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        metavar="HOST:PORT",
        help="the Ray cluster for --runner ray (default: RAY_ADDRESS; with neither, a Ray "
        "instance on this machine)",
    )
    # The flag's earlier name, still accepted.
    parser.add_argument("--backend", dest="runner", choices=runners, help=argparse.SUPPRESS)
    parser.add_argument(
        "--results-dir",
        default=None,
        metavar="DIR",
        help="where results go (default: dsat-results/<experiment name>-<UTC timestamp>)",
    )
    parser.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="resume the interrupted search in DIR with the settings it ran with; of the other "
        "flags only --max-trials, --max-slots, --max-concurrent-trials, --trial-timeout, "
        "--fresh-processes, --trial-host, --ray-address and --run-full-experiment may change",
    )
    parser.add_argument(
        "--trial-timeout",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="a trial running longer than this is stopped and counts as a timeout; if not given, "
        f"{PROFILE_TRIAL_LIMIT_S:g} s for the model-profile trial, then {PROFILE_MULTIPLE:g}x its "
        f"time, at least {FLOOR_S:g} s",
    )
    parser.add_argument(
        "--fresh-processes",
        action="store_true",
        help="local runner: start every trial in a new Python interpreter; by default a "
        "one-process trial runs in a worker per slot that has already imported the "
        "entrypoint's modules (--trial-host; with --no-trial-host it is forked from it) "
        "(docs/local-runner.md#warm-trials says what a script must not do then)",
    )
    parser.add_argument(
        "--trial-host",
        action="store_const",
        const=True,
        default=None,
        help="local runner: run a slot's one-process trials one after another in one process "
        "(its worker, which then forks nothing) that keeps its CUDA context and process group, "
        "putting back what each trial changed (docs/local-runner.md#trial-host); the default, "
        "measured faster than a fork on the CPU and than a fresh process on a GPU",
    )
    parser.add_argument(
        "--no-trial-host",
        dest="trial_host",
        action="store_const",
        const=False,
        help="local runner: fork each one-process trial from the slot's warm worker instead",
    )
    parser.add_argument(
        "--simulator",
        default=None,
        metavar="MODULE_OR_FILE:FUNCTION",
        help="performance function for --runner simulated",
    )


def _add_range_factor(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--search-range-factor",
        type=positive_float,
        default=defaults.DEFAULT_SEARCH_RANGE_FACTOR,
        help="scales the micro-batch range that the memory model suggests",
    )


def build_parser() -> argparse.ArgumentParser:
    formatter = HelpFormatter
    parser = DsatArgumentParser(
        prog=PROG,
        formatter_class=formatter,
        description="Find the fastest DeepSpeed configuration for your model and hardware.",
    )
    sub = parser.add_subparsers(
        dest="method",
        metavar="{" + ",".join([*defaults.SEARCH_METHODS, "report"]) + "}",
        required=True,
    )
    guided = sub.add_parser(
        "guided",
        formatter_class=formatter,
        help="dsat's own search (the one to use): every result bounds what is still worth "
        "trying; knobs are stepped around each stage's best; ends when nothing can beat it",
    )
    asha = sub.add_parser(
        "asha",
        formatter_class=formatter,
        help="adaptive search: more binary-search trials for promising configurations",
    )
    binary = sub.add_parser(
        "binary",
        formatter_class=formatter,
        help="binary search over the micro-batch of random configurations",
    )
    random = sub.add_parser(
        "random",
        formatter_class=formatter,
        help="random configurations with aggressive early stopping",
    )
    for subparser in (guided, asha, binary, random):
        _add_common_flags(subparser)
    report = sub.add_parser(
        "report",
        formatter_class=formatter,
        help="draw a search's results (report.png, report.html in RESULTS_DIR); needs "
        "matplotlib (pip install matplotlib)",
    )
    report.add_argument("report_dir", metavar="RESULTS_DIR", help="the directory a search wrote")
    random.add_argument(
        "--trials-per-random-config",
        type=positive_int,
        default=defaults.DEFAULT_TRIALS_PER_RANDOM_CONFIG,
        help="maximum trials per random configuration",
    )
    random.add_argument(
        "--early-stopping",
        type=positive_int,
        default=None,
        metavar="N",
        help="stop after N trials in a row without improvement",
    )
    _add_range_factor(binary)
    _add_range_factor(guided)
    asha.add_argument(
        "--max-rungs",
        type=positive_int,
        default=defaults.DEFAULT_MAX_RUNGS,
        help="number of ASHA rungs",
    )
    asha.add_argument(
        "--min-binary-search-trials",
        type=positive_int,
        default=defaults.DEFAULT_MIN_BINARY_SEARCH_TRIALS,
        help="binary-search trials a configuration gets at rung 0",
    )
    asha.add_argument(
        "--asha-early-stopping",
        type=non_negative_int,
        default=defaults.DEFAULT_ASHA_EARLY_STOPPING,
        help="ASHA's early-stopping rate s",
    )
    asha.add_argument(
        "--divisor",
        type=positive_int,
        default=defaults.DEFAULT_DIVISOR,
        help="ASHA's reduction factor: the top 1/divisor of a rung is promoted",
    )
    _add_range_factor(asha)
    return parser


def _method_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse offers no public way to reach its subparsers
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def given_arguments(argv: Sequence[str]) -> dict[str, Any]:
    """Only what the command line says itself, no defaults: a resumed search keeps its own."""
    parser = build_parser()
    for subparser in _method_parsers(parser).values():
        for action in subparser._actions:
            action.default = argparse.SUPPRESS
    return vars(parser.parse_args(argv))


def flag_names() -> dict[str, str]:
    """Each setting's name on the command line, for messages."""
    names: dict[str, str] = {}
    for subparser in _method_parsers(build_parser()).values():
        for action in subparser._actions:
            if action.help == argparse.SUPPRESS:
                continue  # an old name (--backend) shares its setting with the current one
            if action.option_strings:
                names[action.dest] = max(action.option_strings, key=len)
            elif action.metavar:
                names[action.dest] = str(action.metavar)
    return names


def parse_settings(argv: Sequence[str] | None = None) -> SearchSettings:
    """The settings of the search to run: from the flags, or, with --resume, the saved ones."""
    argv = list(sys.argv[1:] if argv is None else argv)
    namespace = build_parser().parse_args(argv)
    if namespace.fresh_processes and namespace.trial_host:
        raise DsatError(  # which one ran went unsaid
            "--fresh-processes starts each trial in a new interpreter and --trial-host runs "
            "them in a warm one; drop one of the two"
        )
    if namespace.resume is not None:
        return resumed_settings(
            namespace.method, given_arguments(argv), namespace.resume, flag_names()
        )
    if (namespace.config_path is None or namespace.model_dir is None) and namespace.include:
        raise DsatError(  # `-i extra.py deepspeed.yaml .`: --include took them
            f"CONFIG_PATH and MODEL_DIR are required, and --include took every path after it "
            f"({' '.join(namespace.include)}); {positionals_first(namespace.method)}"
        )
    if namespace.config_path is None or namespace.model_dir is None:
        raise DsatError(
            "CONFIG_PATH and MODEL_DIR are required, e.g. `python3 -m dsat "
            f"{namespace.method} deepspeed.yaml .`; to continue a search, pass --resume DIR"
        )
    fields = {f.name for f in dataclasses.fields(SearchSettings)}
    values = {k: v for k, v in vars(namespace).items() if k in fields}
    values["include"] = tuple(values["include"] or ())
    values["zero_stages"] = tuple(values["zero_stages"])
    return SearchSettings(**values).with_absolute_paths()


class CurrentStdout:
    """Writes to whatever sys.stdout is now, so log lines go above rich's live progress line."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()


def printable_output() -> None:
    """A path or reason the terminal's encoding cannot show (a non-ASCII results directory under
    ``PYTHONIOENCODING=ascii``, ``LANG=C`` on an old Python) is escaped, not a traceback after the
    work is done."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")


def show_progress_logs() -> None:
    """dsat's own INFO messages (memory estimates, why a search ended) on stdout."""
    log = logging.getLogger("dsat")
    if not log.handlers:
        handler = logging.StreamHandler(CurrentStdout())
        handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def report_main(argv: Sequence[str]) -> int:
    """`python3 -m dsat report RESULTS_DIR`."""
    from dsat.results.report import report_to_terminal

    try:
        namespace = build_parser().parse_args(["report", *argv])
        report_to_terminal(Path(namespace.report_dir))
    except DsatError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return USAGE_EXIT_CODE
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    printable_output()
    with stdout_without_reader():
        return command_run(list(sys.argv[1:] if argv is None else argv))


def command_run(argv: list[str]) -> int:
    """The report, or the search and how it ended, as an exit status."""
    from dsat.runners.local.full_run import FullExperimentFailed
    from dsat.search_launch import (
        FullRunInterrupted,
        SearchFailed,
        SearchInterrupted,
        SearchStopped,
        launch,
    )
    from dsat.search_run import STOP_SIGNALS

    if argv[:1] == ["report"]:
        return report_main(argv[1:])
    show_progress_logs()
    dump_stacks_on_request()
    stopped_by: list[int] = []

    def stop_as_ctrl_c(signum: int, frame: object) -> None:
        """SIGTERM, and SIGHUP (the terminal closed), stop a search the way Ctrl-C does: trials
        stopped, state kept; SIGHUP could end dsat between a trial's row and the state."""
        stopped_by.append(signum)
        raise KeyboardInterrupt

    previous = {
        signum: signal.signal(signum, stop_as_ctrl_c)
        for signum in STOP_SIGNALS
        # SIGINT raises KeyboardInterrupt itself; nohup's SIGHUP stays ignored
        if signum != signal.SIGINT and signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        launch(parse_settings(argv), os.environ)
    except DsatError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except SearchFailed as err:
        print(f"{PROG}: search failed: {err}", file=sys.stderr)
        return 1
    except (FullExperimentFailed, SearchStopped) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    except (SearchInterrupted, FullRunInterrupted, KeyboardInterrupt) as err:
        said = "interrupted" if isinstance(err, KeyboardInterrupt) else str(err)
        print(f"{PROG}: {said}", file=sys.stderr)
        # The shell's convention, 128 + the signal: 130 for Ctrl-C, 143 for SIGTERM (a
        # scheduler that preempted the job tells it from a failure so).
        return 128 + (stopped_by[0] if stopped_by else signal.SIGINT)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


def dump_stacks_on_request() -> None:
    """``kill -USR1 <dsat's pid>`` prints where each of dsat's threads is to stderr, and dsat
    goes on: the first thing to look at when a search seems stuck."""
    if not hasattr(signal, "SIGUSR1"):
        return
    # Where stderr is no file (dsat called from Python with its output captured), there is
    # nowhere to print to.
    with contextlib.suppress(OSError, ValueError):
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)


def main_exit() -> None:
    """Console-script entry point. Once dsat has said how it ended, a second Ctrl-C is
    ignored: it landed in torch's exit handlers and printed a traceback after the message."""
    code = main()
    from dsat.search_run import STOP_SIGNALS

    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    sys.exit(code)
