"""A trial host: one process that runs a slot's one-process trials one after another.

A forked trial still pays, on a GPU, for its CUDA context and its process group (13 s of a 35-47 s
trial on the H100 check, benchmarks/README.md). With ``--trial-host`` the slot's warm worker forks
a host once; the host runs each trial in itself, as the script run anew, so the context and the
group made by its first trial serve the next, and afterwards puts back what the trial changed
(``process_reset``). A trial that leaves a thread running or an engine alive is still answered
normally, but its host leaves after answering, and the worker forks a new one for the next trial.
A host that dies during a trial (a crash, or dsat stopping the trial) is not replaced: the slot's
later trials are forked, as without a host. A trial that runs out of memory in the host is run
again in a forked process by the runner before its OOM counts (``LocalRunner``).

Protocol: the worker's requests (one JSON object per line, as the fork server's) on a pipe; after
each trial one line back: ``{"returncode": N, "leaks": [...]}``. Never pickle.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

from dsat.runners.local.fork_server import run_entry, set_trial_threads
from dsat.runners.local.process_reset import ProcessBaseline, one_trial


def serve(requests: int, answers: int) -> NoReturn:
    """In the host, forked from the worker and leading its own process group: run trials until
    the worker closes the requests' pipe, or a trial leaks."""
    # DeepSpeed imports torch._dynamo in its first initialize, and dynamo wraps torch functions
    # as it loads: imported now, the wrapped ones are what every trial is put back to.
    if "torch" in sys.modules:
        with contextlib.suppress(Exception):
            importlib.import_module("torch._dynamo")
    baseline = ProcessBaseline.capture()
    own_out, own_err = os.dup(1), os.dup(2)
    with os.fdopen(requests, "rb") as incoming:
        for line in incoming:
            request: dict[str, Any] = json.loads(line)
            returncode, failure = _run(request, baseline, own_out, own_err)
            leaks = baseline.leaks() if failure is None else [failure]
            if leaks:
                _note(request["log"], f"dsat: this trial host is replaced: {'; '.join(leaks)}")
            answer = {"returncode": returncode, "leaks": leaks}
            os.write(answers, (json.dumps(answer) + "\n").encode())
            if leaks:
                break
    os._exit(0)


def _run(
    request: dict[str, Any], baseline: ProcessBaseline, own_out: int, own_err: int
) -> tuple[int, str | None]:
    """One trial in this process, its output in its log: the exit status it would have had,
    and why this host cannot go on (None: it can)."""
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    code, failure = 1, None
    try:
        cwd = Path(request["cwd"])
        with one_trial(baseline, cwd) as traces:
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(request["env"])
            set_trial_threads()
            numpy = sys.modules.get("numpy")
            if numpy is not None:  # a fresh interpreter seeds numpy's global generator afresh
                numpy.random.seed()
            code = int(run_entry(list(request["argv"])))
            traces.run_exit_callbacks()  # as the interpreter would at the trial's exit
    except BaseException as err:  # putting the process back failed: the trial's log says how
        traceback.print_exc()
        failure = f"putting the process back failed ({type(err).__name__})"
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(own_out, 1)
        os.dup2(own_err, 2)
    return code, failure


def _note(log_path: str, line: str) -> None:
    with contextlib.suppress(OSError), open(log_path, "a") as log:
        log.write(f"\n{line}\n")
