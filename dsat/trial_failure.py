"""Why a trial failed, and so who is to blame: its configuration, the training script, or the machine.

An outcome steers the search: an OOM lowers a configuration's ceiling, a failed model-profile
trial ends the search. A failure that no configuration causes must not do either: a fault of the
machine (a taken port, a rendezvous that never formed, a signal from outside) is run again; a
fault of the script (an ImportError, no metrics reported) fails every trial the same way, so the
search stops early and says so. Every runner reads its trials' logs through this one table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import re
import signal

from dsat.paths import shown

DOES_NOT_PARSE = "the training script does not parse"
# Where a SyntaxError's traceback says the file that does not parse is: its last frame line,
# the source line and caret between it and the error.
SYNTAX_ERROR_AT = re.compile(
    r'File "([^"]+)", line (\d+)\n(?:.*\n){0,4}?\s*(?:\[rank\d+\]:\s*)?'
    r"(?:SyntaxError|IndentationError|TabError)\b"
)
REASON_CHARS = 200  # the one-line reason a terminal line shows
# The reason a search ends with (its last line, its summary): dsat's own advice runs longer, and
# was cut off in mid-fix; a dump of a tensor in an exception's message is still cut.
STOP_REASON_CHARS = 1000
# A signal dsat did not send: dsat cannot tell another process's from the script's own.
FROM_OUTSIDE = "from outside dsat"
WHO_ELSE = "another process, or the training script itself"
# A configuration's op (CPU Adam for offload) that this machine cannot build: the search learns
# to avoid it, but where the user's own configuration needs it, the build is what to fix.
OP_NOT_BUILT = "a DeepSpeed op this configuration needs could not be built or loaded here"
MACHINE_ATTEMPTS = 3  # runs of a trial the machine keeps failing before it counts as an error
SCRIPT_FAILURES_TO_STOP = 3  # trials in a row failing alike for the script before a search stops
MACHINE_FAILURES_TO_STOP = 2  # trials in a row the machine failed on every attempt, likewise
# Trials in a row failing alike with a crash of no known kind, before anything succeeded, over
# at least two ZeRO stages and three micro-batches: what no configuration tried escapes.
UNKNOWN_FAILURES_TO_STOP = 5


class FailureCause(str, enum.Enum):
    CONFIG = "config"  # the configuration itself: out of memory, or DeepSpeed rejecting it
    SCRIPT = "script"  # the training script, whatever the configuration
    MACHINE = "machine"  # the machine: a port, a rendezvous, a lost node, a signal from outside
    UNKNOWN = "unknown"  # a crash that may or may not depend on the configuration


@dataclasses.dataclass(frozen=True)
class KnownFailure:
    """A message some layer prints when it fails, and what it means to the user."""

    pattern: re.Pattern[str]
    cause: FailureCause
    summary: str
    killed: bool = False  # a process died unasked: the kernel's OOM killer, when it struck
    # The machine's only when a library raised it (torch.distributed's connections): raised by
    # the script's own code (its metrics push, a port it binds), the script's.
    libraries_only: bool = False
    # ... and only the script's when its own line raised it, not a call into Python's library
    # under it: a lock it takes without waiting fails so, a fork at the process limit through
    # subprocess or multiprocessing too.
    own_line_only: bool = False


def _known(
    pattern: str,
    cause: FailureCause,
    summary: str,
    killed: bool = False,
    libraries_only: bool = False,
    own_line_only: bool = False,
) -> KnownFailure:
    return KnownFailure(
        re.compile(pattern, re.MULTILINE), cause, summary, killed, libraries_only, own_line_only
    )


LIMIT_OF_THE_MACHINE = (
    "the process ran into a limit of the machine (open files, threads, processes or address "
    "space: see `ulimit -a`)"
)


# A rank that cannot reach its peers: the machine's, or the end of a peer that failed first (a
# rank that crashed leaves the others failing to connect).
CONNECT_FAILURES = (
    "torch.distributed could not connect the trial's processes",
    "NCCL could not connect the trial's GPUs",
    "gloo could not connect the trial's processes",
)


# First match wins; out-of-memory is checked before this table (dsat.training.oom). The script's
# and the config's come first: a rank that crashes leaves its peers failing to connect.
KNOWN_FAILURES: tuple[KnownFailure, ...] = (
    _known(
        # First: a limit of the process (ulimit -n, -u, -v) fails whatever the trial was doing,
        # an import (a library it cannot map) or an op's build included; no configuration escapes
        # it and none is to blame.
        r"Too many open files|\[Errno 2[34]\]|can't start new thread|pthread_create failed"
        r"|failed to map segment from shared object",
        FailureCause.MACHINE,
        LIMIT_OF_THE_MACHINE,
    ),
    _known(
        # EAGAIN: a fork at the process limit (ulimit -u), or the script's own lock taken
        # without waiting (fcntl.flock with LOCK_NB) that another process holds.
        r"\[Errno 11\] Resource temporarily unavailable",
        FailureCause.MACHINE,
        LIMIT_OF_THE_MACHINE,
        libraries_only=True,
        own_line_only=True,
    ),
    _known(
        # Before ImportError: an op only some configurations load (CPU Adam for offload), built
        # in the trial, that this machine cannot build or load; the script is not to blame. The
        # library is the op's own (under torch_extensions or DeepSpeed's ops), or a CUDA or AIO
        # library an op links: the script's own ctypes.CDLL("libx.so") is not an op.
        r"Error building extension '\w+'|has no attribute 'ds_opt_adam'"
        r"|(?:torch_extensions|deepspeed/ops)/\S+\.so: cannot open shared object file"
        r"|ImportError: lib(?:cu\w+|aio|nccl)\.so[.\d]*: cannot open shared object file"
        r"|Unable to JIT load the \w+ op",
        FailureCause.CONFIG,
        OP_NOT_BUILT,
    ),
    _known(
        # HF's callbacks say it so: "WandbCallback requires wandb to be installed".
        r"ModuleNotFoundError|ImportError|requires \S+ to be installed",
        FailureCause.SCRIPT,
        "the training script cannot import what it needs",
    ),
    _known(
        # dsat's trial-side helpers refuse how the script calls them (no --deepspeed to merge
        # into, hyperparameters without the config's path): the script's, whatever the config.
        r"\bDsatError: ",
        FailureCause.SCRIPT,
        "dsat's trial helpers refused how the script calls them",
    ),
    _known(
        r"^\s*(?:\[rank\d+\]:\s*)?(?:SyntaxError|IndentationError|TabError)\b",
        FailureCause.SCRIPT,
        DOES_NOT_PARSE,
    ),
    _known(
        # A process started with spawn or forkserver (a DataLoader's workers with that context,
        # torch.multiprocessing.spawn) imports the script again, and the unguarded script starts
        # its training, and the workers, once more; the parent reports only that a worker died.
        r"finished its bootstrapping phase",
        FailureCause.SCRIPT,
        "a process the script started (spawn) ran its training again as it imported the script: "
        'put the training under `if __name__ == "__main__":`',
    ),
    _known(
        # DeepSpeed's own --deepspeed_config (deepspeed.add_config_arguments) beside the trial's
        # config passed to deepspeed.initialize(args=args, config=...): refused in every trial.
        r"Not sure how to proceed, we were given deepspeed configs in the deepspeed arguments",
        FailureCause.SCRIPT,
        "DeepSpeed was given a config twice: the entrypoint's --deepspeed_config (in args) and "
        "the trial's (config=); drop --deepspeed_config from the entrypoint",
    ),
    _known(
        # A Core API script as the reference's guide writes it, reading its hyperparameters
        # from the cluster's info: there is none off a Determined cluster.
        r"AttributeError: 'NoneType' object has no attribute 'trial'",
        FailureCause.SCRIPT,
        "det.get_cluster_info() is None off a Determined cluster: read the trial's "
        "hyperparameters with dsat.get_hparams() (docs/porting-core-api.md)",
    ),
    _known(
        # argparse's refusal, which exits 2 before any training: the entrypoint's arguments.
        r"^(?:\[rank\d+\]:\s*)?\S+: error: (?:unrecognized arguments|the following arguments "
        r"are required|argument \S+: )",
        FailureCause.SCRIPT,
        "the training script rejected its command line (the entrypoint's arguments)",
    ),
    _known(
        # Python's, dsat's own, and a shell's (an entrypoint `bash run.sh`: exit 127 or 126).
        r"can't open file|^cannot run \S+: "
        r"|^(?:\S*/)?(?:ba|da|z)?sh: (?:line \d+: )?\S+: (?:No such file or directory|command not "
        r"found|Permission denied)$",
        FailureCause.SCRIPT,
        "the entrypoint's command cannot start (is its file in the model dir?)",
    ),
    _known(
        r"DeepSpeedConfigError|validation errors? for DeepSpeed\w*Config",
        FailureCause.CONFIG,
        "DeepSpeed rejected the configuration",
    ),
    _known(
        # What DeepSpeed's engine asserts of a config only once it runs: ZeRO with an optimizer
        # it has not tested (SGD), ZeRO's own runtime refusals.
        r"zero_allow_untested_optimizer|ZeRORuntimeException",
        FailureCause.CONFIG,
        "DeepSpeed's engine refused the configuration",
    ),
    _known(
        r"Check batch related parameters",
        FailureCause.CONFIG,
        "DeepSpeed rejected the batch sizes",
    ),
    _known(
        r"uncorrectable ECC error|No CUDA GPUs are available"
        r"|CUDA-capable device\(s\) (?:is/are|are|is) busy or unavailable|cudaErrorDevicesUnavailable",
        FailureCause.MACHINE,
        "the trial's GPU is failing, busy or not visible",
    ),
    _known(
        r"No space left on device|\[Errno 28\]",
        FailureCause.MACHINE,
        "the disk is full",
    ),
    _known(
        r"EADDRINUSE|Address already in use",
        FailureCause.MACHINE,
        "a port the trial listens on was taken by another process (EADDRINUSE)",
        libraries_only=True,
    ),
    _known(
        r"DistNetworkError|Rendezvous(?:Connection|Timeout|Closed)Error|ConnectionRefusedError"
        r"|Connection refused",
        FailureCause.MACHINE,
        CONNECT_FAILURES[0],
        libraries_only=True,
    ),
    _known(
        r"ncclSystemError|NCCL error.*(?:unhandled system error|socket)",
        FailureCause.MACHINE,
        CONNECT_FAILURES[1],
    ),
    _known(
        r"Gloo connectFullMesh failed",
        FailureCause.MACHINE,
        CONNECT_FAILURES[2],
    ),
    _known(
        r"SignalException|got signal: (?:1|2|3|15)\b",
        FailureCause.MACHINE,
        f"torchrun was stopped by a signal {FROM_OUTSIDE}",
    ),
    _known(
        r"the warm worker that ran this trial exited",  # dsat.runners.local.warm_trials
        FailureCause.MACHINE,
        "the warm worker this trial was forked from died",
        killed=True,
    ),
)

# The last line of a Python traceback (torch may prefix its processes' lines with [rankN]:).
# A warning turned into an error (``warnings.filterwarnings("error")``) ends a traceback as
# "DeprecationWarning: ..."; a warning only printed starts with its file's path instead. A class
# may be private (numpy's ``numpy.core._exceptions._ArrayMemoryError``).
EXCEPTION_LINE = re.compile(
    r"^(?:\[rank\d+\]:\s*)?((?:\w+\.)*_?[A-Z]\w*(?:Error|Exception|Warning)\b.*)$"
)
# Launchers' own summaries of a failed worker, which name no cause (torchrun's; accelerate's
# and other wrappers' subprocess.CalledProcessError).
LAUNCHER_EXCEPTIONS = ("ChildFailedError", "SignalException", "CalledProcessError")
# torchrun's report of the worker that failed first, when a signal ended it.
ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):(?P<block>(?:(?!={6}).*\n)*)")
OUTSIDE_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    cause: FailureCause
    reason: str  # one line, for the terminal
    out_of_memory: bool = False


# What a terminal would act on, not show: a NUL, a colour code's escape, a backspace.
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    """``text`` in one line that shows as it reads: whitespace runs made one space, control
    characters written as escapes (``\\x1b``); at most ``limit`` characters."""
    line = CONTROL_CHARACTER.sub(lambda m: f"\\x{ord(m.group()):02x}", " ".join(text.split()))
    return line if len(line) <= limit else line[: limit - 3] + "..."


def exception_lines(log: str, rank: int | None = None) -> list[str]:
    """The exceptions the tracebacks in ``log`` end with, in order, torchrun's summaries left
    out; only those of the process torch labels ``[rank<rank>]:``, where given."""
    lines = log.splitlines()
    found = []
    for number, line in enumerate(lines):
        if rank is None or line.startswith(f"[rank{rank}]:"):
            exception = _exception_at(lines, number)
            if exception is not None:
                found.append(exception)
    return found


def _exception_at(lines: list[str], number: int) -> str | None:
    """The exception a traceback ends with on line ``number``, in one line; None if none does
    (torchrun's summaries are none)."""
    match = EXCEPTION_LINE.match(lines[number].strip())
    if match is None or any(name in match.group(1) for name in LAUNCHER_EXCEPTIONS):
        return None
    exception = match.group(1)
    if exception.endswith(":"):  # a message that starts on the next line: its paragraph
        exception += " " + " ".join(_paragraph(lines[number + 1 :]))
    return one_line(exception)


def _paragraph(lines: list[str]) -> list[str]:
    """The indented lines up to the first blank one, leading blank lines skipped: the first
    paragraph of an exception's message that starts on a line of its own (multiprocessing's
    is indented; a line that is not is what the process printed next)."""
    paragraph: list[str] = []
    for line in lines:
        if line.strip() and line[:1].isspace():
            paragraph.append(line)
        elif paragraph or line.strip():
            break
    return paragraph


# A traceback's frame line; the line after it quotes the frame's source, comments and all.
FRAME_LINE = re.compile(r'^(?:\[rank\d+\]:)?\s*File "(?P<path>.*)", line (?P<line>\d+)')
# A frame's quoted source, indented under it; a frame without source (``<frozen runpy>``, code
# from ``-c``) is followed by the next frame or the exception itself.
QUOTED_LINE = re.compile(r"^(?:\[rank\d+\]:)?\s{4}")
# Python's markers under a quoted source line (3.11 and later).
MARKER_LINE = re.compile(r"^(?:\[rank\d+\]:)?\s*[\^~]+\s*$")


def said_lines(log: str) -> list[str]:
    """The lines of ``log`` that a process said, without the source lines its tracebacks quote:
    a comment there ("# not out of memory here") says nothing about how the trial ended."""
    said, quoting = [], False
    for line in log.splitlines():
        if not (quoting and QUOTED_LINE.match(line)) and not MARKER_LINE.match(line):
            said.append(line)
        quoting = FRAME_LINE.match(line) is not None
    return said


# A frame of the reference's own trial-side package (``from determined.pytorch import dsat``, as
# its guide writes it): its reporting context reports only to a Determined cluster's searcher.
REFERENCE_DSAT_FRAME = re.compile(r'File "[^"\n]*/determined/pytorch/dsat/')
REFERENCE_DSAT_USED = (
    "the trial ran Determined's own dsat (from determined.pytorch import dsat), which reports "
    "only on its cluster: `import dsat` instead"
)


def known_failure(text: str) -> KnownFailure | None:
    return next((known for known in KNOWN_FAILURES if known.pattern.search(text)), None)


# Python's exit status for an exception nothing caught (and for ``sys.exit("message")``).
UNCAUGHT_EXIT = 1
# Between two tracebacks of one chain: the second was raised while the first was handled.
CHAINED = re.compile(
    r"^(?:\[rank\d+\]:)?\s*(?:During handling of the above exception|The above exception was "
    r"the direct cause)"
)
RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:")
ROOT_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")


def exit_status(log: str, code: int | None) -> int | None:
    """The exit status of the process that failed first: the one torchrun's summary names as
    its root cause, else ``code``."""
    root = ROOT_CAUSE.search(log)
    found = ROOT_EXIT.search(root.group("block")) if root else None
    return int(found.group(1)) if found else code


def final_exceptions(log: str, code: int | None, rank: int | None = None) -> list[tuple[int, str]]:
    """The exceptions that ended the trial's processes, by their line in ``said_lines(log)``:
    an exception a script caught and logged, and went on after, ended nothing (an OOM probe
    logged at start-up made a later ValueError an OOM of the configuration), nor did one
    printed by an atexit callback or a finaliser after the one that did.

    torch labels what ends a process once its process group exists (``[rankN]:``), and only
    that: a labelled chain (exceptions raised while handling another, with that one) ended its
    process, whatever the exit status. Unlabelled lines are one stream: of one process, its
    last chain (its printed lines may come later than its tracebacks where its stdout is
    buffered: on Determined, or where the user's environment turned unbuffered output off), and
    where that only says a worker it started died, the worker's traceback printed just before
    it; of torchrun's ranks (before their group), the tracebacks printed at its end with no
    more than ``BLOCK_GAP`` lines of other output between them (ranks failing together). Among
    these, those that neither a lost peer nor the machine explains, where any (the machine is
    blamed only where nothing else is). Unlabelled ones count only where the process that
    failed first exited as an exception ends it (not a signal, nor ``sys.exit(3)``), and only
    where no labelled chain of its own is there (logging does not label). Only the process
    labelled ``[rank<rank>]:``, where given."""
    status = exit_status(log, code)
    signalled = status is not None and status != UNCAUGHT_EXIT
    said = said_lines(log)
    chains: dict[str | None, list[list[tuple[int, str]]]] = {}
    trailing: dict[str | None, int] = {}  # where each stream's trailing block of chains starts
    linked: dict[str | None, bool] = {}
    ignored: dict[str | None, bool] = {}
    gap: dict[str | None, int] = {}
    message: dict[str | None, int] = {}  # lines the last exception's message may still take
    for number, line in enumerate(said):
        stream = _stream(line)
        if (rank is not None and stream != str(rank)) or (signalled and stream is None):
            continue
        if IGNORED.match(line):
            ignored[stream] = True
            continue
        if CHAINED.match(line):  # the chain goes on, unless other output came between
            linked[stream] = gap.get(stream, 0) <= BLOCK_GAP
            continue
        exception = _exception_at(said, number)
        if exception is None:
            if not _unlabelled(line).strip():
                message[stream] = 0
            elif message.get(stream, 0) > 0 and _other_output(line):
                message[stream] -= 1  # the exception's message goes on (NCCL's does)
            elif _other_output(line):
                gap[stream] = gap.get(stream, 0) + 1
            continue
        message[stream] = MESSAGE_LINES
        if ignored.pop(stream, False):
            continue
        streams = chains.setdefault(stream, [])
        if linked.get(stream) and streams:
            streams[-1].append((number, exception))
        else:
            if gap.get(stream, 0) > BLOCK_GAP:
                trailing[stream] = len(streams)
            streams.append([(number, exception)])
        linked[stream], gap[stream] = False, 0
    several = ROOT_CAUSE.search(log) is not None  # torchrun's ranks
    chosen: dict[str | None, list[tuple[int, str]]] = {}
    for stream, streams in chains.items():
        block = streams[-1:]
        if stream is None and several:
            block = streams[trailing.get(stream, 0) :]
        elif stream is None and len(streams) > 1 and not _of_its_own(streams[-1]):
            # One process and the workers it started: a worker's own traceback just before
            # the parent's "worker exited unexpectedly" is why.
            if trailing.get(stream, 0) < len(streams) - 1:
                block = streams[-2:]
        own = [entry for chain in block if _of_its_own(chain) for entry in chain]
        chosen[stream] = own or [entry for chain in block for entry in chain]
    labelled = any(_of_its_own(chain) for stream, chain in chosen.items() if stream is not None)
    found = [entry for stream, chain in chosen.items() if stream or not labelled for entry in chain]
    return sorted(found)


# Lines of other output that may stand between the tracebacks of processes failing together
# without parting them: none (a caught OOM, one line, then a ValueError read as one block).
BLOCK_GAP = 0
# Lines after an exception's own that go on with its message, up to a blank line: NCCL's errors
# add "ncclRemoteError: ...", "Last error:" and its text, unindented, which are no other output.
MESSAGE_LINES = 4
# What precedes a traceback that ended nothing: one printed by an atexit callback or a finaliser.
IGNORED = re.compile(
    r"^(?:\[rank\d+\]:)?\s*(?:Exception ignored in|Error in atexit\._run_exitfuncs)"
)


def message_after(said: list[str], number: int, count: int) -> list[str]:
    """The lines after the exception on ``said[number]`` that go on with its message (NCCL's
    "Last error:" and its text), of its process (other ranks' lines between are passed over):
    up to ``count``, and up to a blank line, a traceback, another exception or a line that
    begins another's (an atexit callback's traceback after it is not its message: its OOM made
    a KeyError one)."""
    stream = _stream(said[number])
    message: list[str] = []
    for after in range(number + 1, len(said)):
        line = said[after]
        if _stream(line) != stream:
            continue
        if len(message) == count or (
            not _unlabelled(line).strip()
            or NOT_WORDS.match(line)
            or IGNORED.match(line)
            or CHAINED.match(line)
            or _exception_at(said, after) is not None
        ):
            break
        message.append(line)
    return message


def _other_output(line: str) -> bool:
    """Whether a line is output of its own, not part of a traceback, an exception's indented
    message or launcher noise."""
    text = _unlabelled(line)
    return bool(text.strip()) and not text[:1].isspace() and not NOT_WORDS.match(line)


def _stream(line: str) -> str | None:
    """The rank torch labels ``line`` with (``[rankN]:``); None for an unlabelled line."""
    label = RANK_PREFIX.match(line)
    return label.group(1) if label else None


def with_what_follows(log: str, exception: str) -> str:
    """An exception whose message ends in a colon with the line after it, which says what it
    announces: HF's "... mismatch TrainingArguments values:" said nothing without its "- ds
    train_batch_size=2 vs hf train_batch_size (calculated)=1"."""
    said = said_lines(log)
    for number in range(len(said) - 1, -1, -1):
        if _unlabelled(said[number]).strip() == exception.strip():
            follows = message_after(said, number, 1)
            return (
                f"{exception.rstrip()} {_unlabelled(follows[0]).strip()}" if follows else exception
            )
    return exception


def _unlabelled(line: str) -> str:
    """The line without torch's ``[rankN]:`` label (and the one space after it)."""
    label = RANK_PREFIX.match(line)
    return line if label is None else line[label.end() :].removeprefix(" ")


def _of_its_own(chain: list[tuple[int, str]]) -> bool:
    """Whether a chain holds an exception that neither a lost peer nor the machine explains."""
    return any(
        not lost_a_peer(line)
        and getattr(known_failure(line), "cause", None) is not FailureCause.MACHINE
        for _, line in chain
    )


# What the last words leave out: a traceback's header and frames, a C++ backtrace's frames,
# faulthandler's dump, torchrun's warnings and summary.
NOT_WORDS = re.compile(
    r"^(?:\[rank\d+\]:)?\s*(?:Traceback \(most recent call last\)|File \"|frame #\d+|"
    r"Exception raised from |Fatal Python error|(?:Current thread|Thread) 0x|Extension modules:|"
    r"<no Python frame>|\[?[IWE]\d{4} |[-=]{6}|"
    # torchrun's and DeepSpeed's launchers' own lines (torch 2.1-2.3, DeepSpeed's launch.py)
    r"\[[-\d :,]+\] (?:torch\.distributed\.elastic|\[(?:INFO|ERROR|WARNING)\] \[launch\.py)|"
    # CUDA's advice under its errors; a shell's report of the job it ran
    r"CUDA kernel errors might be|For debugging consider passing|Compile with `TORCH_USE_CUDA_DSA`|"
    r"\S+: line \d+: +\d+ )"
)
# A process's last words: ``sys.exit``'s message, or an abort's "terminate called after
# throwing ..." and its "what(): ..." (a line printed a few steps earlier is not among them).
LAST_WORDS = 4


def last_words(log: str, count: int = LAST_WORDS) -> list[str]:
    """The last lines the trial's processes said before they ended: where no exception ended
    them, what says how (an allocator's abort, a limit of the machine, an exception just before
    an abort at teardown); a line printed earlier (a tip that mentions out of memory, a file
    listing that names "Too many open files") does not."""
    root = ROOT_CAUSE.search(log)
    said = said_lines(log if root is None else log[: root.start()])
    words = [line for line in said if _unlabelled(line).strip() and not NOT_WORDS.match(line)]
    summary = next((i for i, line in enumerate(words) if "ChildFailedError" in line), None)
    return words[:summary][-count:]


# SIGKILL as other layers report it: a shell's 128 + 9, a DataLoader worker, DeepSpeed's launcher.
SIGKILL_REPORTS = re.compile(
    r"killed by signal: Killed|exits with return code = -9\b|exited with return code -9\b"
)


def killed_by_sigkill(log: str, code: int | None) -> bool:
    """The trial's process, or the worker torchrun names as the first to fail, died of SIGKILL
    (or a layer between says one of its processes did)."""
    if code in (-signal.SIGKILL, 128 + signal.SIGKILL) or SIGKILL_REPORTS.search(log):
        return True
    return exit_status(log, None) == -signal.SIGKILL


# What a rank says when a peer it talked to has gone: its failure followed from the peer's.
PEER_LOST = re.compile(
    r"Connection (?:closed|reset) by peer|remote worker (?:crashing|hanging)|Broken pipe"
    r"|remote process exited"
    r"|DataLoader worker \(pid(?:\(s\))? [\d, ]+\) exited unexpectedly"  # its worker says why
)


def lost_a_peer(reason: str) -> bool:
    """Whether a rank's failure ``reason`` says only that a peer went away before it."""
    return PEER_LOST.search(reason) is not None


def could_not_connect(reason: str) -> bool:
    """Whether a rank's failure ``reason`` is that it could not reach its peers (with peers, it
    may follow from another rank's failure)."""
    return reason.startswith(CONNECT_FAILURES)


# The rank a torchrun failure report names ("  rank      : 1 (local_rank: 1)").
RANK_FIELD = re.compile(r"^\s*rank\s*:\s*(\d+)", re.MULTILINE)


def root_cause_rank(log: str) -> int | None:
    """The rank torchrun names as the first to fail: its peers' errors (a connection closed by
    it) followed from its own."""
    root = ROOT_CAUSE.search(log)
    found = RANK_FIELD.search(root.group("block")) if root else None
    return None if found is None else int(found.group(1))


def reporting_rank_left_first(log: str) -> bool:
    """Whether torchrun reports a failed trial in which rank 0, the rank that reports, is not
    among the ranks that failed: it exited cleanly before its peers, which then failed for
    want of it (a connection reset by it). Not where the first to fail died of a signal other
    than an abort (NCCL's watchdog aborts a rank whose peer left): a segfault or the OOM
    killer's SIGKILL is the rank's own end, and torchrun may list no other rank (its
    ``<NO_OTHER_FAILURES>``) though it stopped rank 0 then."""
    start = log.rfind("Failures:")
    if start < 0 or ROOT_CAUSE.search(log, start) is None:
        return False
    status = exit_status(log, None)
    if status is not None and status < 0 and status != -signal.SIGABRT:
        return False
    failed = {int(rank) for rank in RANK_FIELD.findall(log, start)}
    return bool(failed) and 0 not in failed


EXIT_FIELD = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)


def peer_left_cleanly(log: str, code: int | None) -> bool:
    """Whether torchrun reports a failed trial whose failed ranks all only lost a peer, and
    none by a signal: the rank they lost is not among them, so it exited cleanly while they
    trained (the script ended it early: its shard of the data ran out, an exit of its own)."""
    start = log.rfind("Failures:")
    if start < 0 or ROOT_CAUSE.search(log, start) is None:
        return False
    if any(int(status) < 0 for status in EXIT_FIELD.findall(log, start)):
        return False
    exceptions = [line for _, line in final_exceptions(log, code)]
    return bool(exceptions) and all(lost_a_peer(line) for line in exceptions)


def root_cause_signal(log: str) -> signal.Signals | None:
    """The signal torchrun's first failed worker died of, where it was one of its own (not
    SIGKILL, read apart, nor a stop from outside)."""
    status = exit_status(log, None)
    if status is None or status >= 0:
        return None
    try:
        sig = signal.Signals(-status)
    except ValueError:
        return None
    return None if sig in OUTSIDE_SIGNALS or sig is signal.SIGKILL else sig


def not_the_machines(exceptions: list[str]) -> list[str]:
    """The exceptions the table does not put down to the machine."""
    return [
        line
        for line in exceptions
        if getattr(known_failure(line), "cause", None) is not FailureCause.MACHINE
    ]


def diagnose_crash(log: str, code: int | None, oom_killed: bool | None) -> Diagnosis:
    """A trial that ended without metrics, no OOM in its log and not by dsat's timeout: what
    its exit ``code`` and ``log`` say. ``oom_killed``: whether the kernel's OOM killer struck
    while it ran (None: this machine cannot tell).

    The machine is blamed only where nothing else is: an exception the table does not put down
    to the machine (a rank's crash, which leaves its peers unable to connect) takes precedence."""
    if killed_by_sigkill(log, code):
        if oom_killed is False:
            return Diagnosis(
                FailureCause.MACHINE,
                f"killed by SIGKILL {FROM_OUTSIDE} (not the kernel's out-of-memory killer): "
                f"{WHO_ELSE}",
            )
        how = "by the kernel's out-of-memory killer" if oom_killed else "most likely out of memory"
        return Diagnosis(FailureCause.CONFIG, f"killed by SIGKILL, {how}", out_of_memory=True)
    # The trial's process, or the rank torchrun names as the first to fail (its peers then lost
    # it, and said only that): a rank stopped from outside is no more the config's than a
    # trial's process is.
    for stopped in (code, exit_status(log, None)):
        if stopped is not None and stopped < 0 and -stopped in OUTSIDE_SIGNALS:
            name = signal.Signals(-stopped).name
            raised = " (a KeyboardInterrupt it raised)" if -stopped == signal.SIGINT else ""
            rank = root_cause_rank(log)
            whose = (
                ""
                if stopped == code
                else "a process of the trial "
                if rank is None
                else f"rank {rank} of the trial "
            )
            return Diagnosis(
                FailureCause.MACHINE,
                f"{whose}stopped by {name} {FROM_OUTSIDE}: {WHO_ELSE}{raised}",
            )
    lines = [line for _, line in final_exceptions(log, code)]
    first_rank = root_cause_rank(log)
    others = []
    if first_rank is not None:
        first = [line for _, line in final_exceptions(log, code, first_rank)]
        others = not_the_machines(first)
        if not others and not all(lost_a_peer(line) for line in first):
            # The first to fail, failed of the machine (a limit, a port): that, not the lost
            # peer its peers then said, is the trial's end.
            others = first
    if all(lost_a_peer(line) for line in others):  # it only lost a peer (a worker of its own)
        others = not_the_machines(lines)
    others = [line for line in others if not lost_a_peer(line)] or others
    words = last_words(log)
    known = known_failure("\n".join(others or lines + words))
    detail = others[-1] if others else lines[-1] if lines else None
    if detail is not None and detail.rstrip().endswith(":"):
        detail = with_what_follows(log, detail)
    if known is not None and detail is None:  # said in the last words: the line that says it
        detail = next((one_line(w) for w in reversed(words) if known.pattern.search(w)), None)
    if known is not None and known.killed and oom_killed:
        reason = f"{known.summary}, killed by the kernel's out-of-memory killer"
        return Diagnosis(FailureCause.CONFIG, reason, out_of_memory=True)
    crashed = root_cause_signal(log)
    machine = known is not None and known.cause is FailureCause.MACHINE
    if crashed is not None and (known is None or machine):
        # torchrun names the rank that failed first: it died of a signal of its own (a
        # segfault), and its peers' connection errors followed from it.
        return Diagnosis(
            FailureCause.UNKNOWN,
            one_line(f"a process of the trial died of {crashed.name} (torchrun's root cause)"),
        )
    if detail is not None and REFERENCE_DSAT_FRAME.search(log) and not machine:
        return Diagnosis(FailureCause.SCRIPT, one_line(f"{REFERENCE_DSAT_USED}: {detail}"))
    if known is not None and known.libraries_only and detail is not None:
        where = raised_by_own_code(log, detail, known.own_line_only)
        if where is not None:
            return Diagnosis(
                FailureCause.SCRIPT,
                one_line(f"the training script's own code ({where}) failed: {detail}"),
            )
    if known is not None:
        summary = known.summary
        if summary == DOES_NOT_PARSE:  # which file, and where: a module it imports, say
            found = SYNTAX_ERROR_AT.findall(log)
            summary += f" ({os.path.basename(found[-1][0])}, line {found[-1][1]})" if found else ""
        reason = summary if detail is None else f"{summary}: {detail}"
        return Diagnosis(known.cause, one_line(reason))
    # The status of the rank torchrun names as the root cause (torchrun's own is 1 whatever
    # the script exited with), and that rank.
    status = exit_status(log, code)
    exit_code = f"exit code {status}"
    with contextlib.suppress(ValueError, TypeError):
        if status is not None and status < 0:
            exit_code += f" ({signal.Signals(-status).name})"  # a segfault, an abort
    if status != code and first_rank is not None:
        exit_code += f" (rank {first_rank})"
    if detail is not None:  # a code of None: an exception the trial caught itself, no exit
        said = detail if code is None else f"{detail} ({exit_code})"
        return Diagnosis(FailureCause.UNKNOWN, one_line(said))
    # The trial's own last words (not torchrun's report of the failure), not dsat's note of how
    # it ended.
    spoken = [line for line in words if not _unlabelled(line).startswith("dsat: ")]
    last = (
        spoken[-1]
        if spoken
        else next(
            (
                line
                for line in reversed(log.splitlines())
                if line.strip().strip("=-") and not line.startswith("dsat: ")  # nor a rule
            ),
            "",
        )
    )
    reason = f"{exit_code}: {last}" if last else exit_code
    return Diagnosis(FailureCause.UNKNOWN, one_line(reason))


# The files of Python's own library and of installed packages, as a traceback's frames name them.
PACKAGE_FILE = re.compile(r"[/\\](?:site|dist)-packages[/\\]")
STDLIB_FILE = re.compile(r"[/\\]lib[/\\]python3\.\d+[/\\]|^<frozen ")


def raised_by_own_code(log: str, exception: str, own_line_only: bool = False) -> str | None:
    """Where the last traceback ending in ``exception`` was raised, as "train.py, line 40", when
    the innermost of its frames outside Python's own library is the user's code (not an
    installed package's, such as torch's) and the exception is Python's own (an OSError of a
    socket the script opened, not torch's DistNetworkError of a store it asked torch for);
    None otherwise, or where its frames cannot be read. ``own_line_only``: the innermost frame
    of all must be the user's (a call into Python's library under it says None)."""
    if "." in exception.partition(":")[0]:
        return None
    said = said_lines(log)
    number = next(
        (i for i in range(len(said) - 1, -1, -1) if _exception_at(said, i) == exception), None
    )
    if number is None:
        return None
    stream = _stream(said[number])
    for line in reversed(said[:number]):
        if _stream(line) != stream:
            continue
        frame = FRAME_LINE.match(line)
        if frame is None:
            return None  # the traceback's header, or a line that is not a frame
        path = frame["path"]
        if PACKAGE_FILE.search(path) or (own_line_only and STDLIB_FILE.search(path)):
            return None
        if not STDLIB_FILE.search(path):
            return f"{os.path.basename(path)}, line {frame['line']}"
    return None


def first_line(error: str | None, limit: int = REASON_CHARS) -> str:
    """The one-line reason an outcome's error starts with."""
    return one_line(error.splitlines()[0], limit) if error else ""


def log_note(log: str | None) -> str:
    """Where a trial's log is, for a line on the terminal."""
    return f" (log: {shown(log)})" if log else ""
