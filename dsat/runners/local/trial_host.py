"""A trial host: one process that runs a slot's one-process trials one after another.

A forked trial still pays, on a GPU, for its CUDA context and its process group (13 s of a 35-47 s
trial on the H100 check, benchmarks/README.md), and a worker that a library left unsafe to fork
(a native thread, the CUDA driver) forks nothing at all. So the slot's worker (``--trial-host``,
the default) forks nothing: it runs each trial in itself, as the script run anew, so the context
and the group its first trial makes serve the next, and afterwards puts back what the trial
changed (``process_reset``). A trial that leaves a thread running, an engine alive, device
memory allocated or the process slower at small CPU operations than a fresh one still gets its
outcome, then the host leaves and the runner starts another for
the next trial. One that runs out of memory or fails in a host that ran other trials is run again
in a fresh process by the runner before it counts (the host stopped first after a failure, and
after an OOM on a GPU); after a host died during a trial (a crash, or dsat stopping the trial),
the slot's trials start fresh, unless it was the host's first trial or the crash repeated in the
fresh process.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from dsat.runners.local.fork_server import run_entry, take_on_trial
from dsat.runners.local.process_reset import ProcessBaseline, one_trial

# What a host imports before it takes its baseline (process_reset puts back only what it knew).
HOST_IMPORTS = ("deepspeed", "torch._dynamo")


class TrialHost:
    """This process, as the host of trials: its state as each trial must find it, and where its
    own output goes between trials."""

    def __init__(self) -> None:
        # The baseline knows only what is imported when it is taken, so DeepSpeed (and torch)
        # come first, whatever the script imports at its top: a script that reaches DeepSpeed
        # through another library (HF's Trainer imports it lazily) would otherwise leave every
        # ZeRO-3 trial's engine alive. DeepSpeed imports torch._dynamo in its first initialize,
        # and dynamo wraps torch functions as it loads: imported now, the wrapped ones are what
        # every trial is put back to.
        for name in HOST_IMPORTS:
            with contextlib.suppress(Exception):
                importlib.import_module(name)
        self.baseline = ProcessBaseline.capture()
        # What is here now stays: out of the collections that putting a process back runs
        # (several a trial; over all of torch's and DeepSpeed's objects, 0.4 s on the CPU).
        gc.freeze()
        # The requests come on stdin, which a trial must not read; its output goes to its log.
        self.own_in, self.own_out, self.own_err = os.dup(0), os.dup(1), os.dup(2)

    def run(self, request: dict[str, Any]) -> tuple[int, list[str]]:
        """One trial (a fork server's request), its output in its log: the exit status it would
        have had, and why this host cannot serve another (empty: it can)."""
        code, leaks = 1, []
        try:
            with one_trial(self.baseline, Path(request["cwd"])) as traces:
                take_on_trial(request)
                code = run_entry(list(request["argv"]))
                traces.run_exit_callbacks()  # as the interpreter would at the trial's exit
            leaks = self.baseline.leaks()
        except BaseException as err:  # putting the process back failed: the log says how
            traceback.print_exc()
            leaks = [f"putting the process back failed ({type(err).__name__})"]
        finally:
            if leaks:
                print(f"\ndsat: this trial host is replaced: {'; '.join(leaks)}")
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os.dup2(self.own_in, 0)
            os.dup2(self.own_out, 1)
            os.dup2(self.own_err, 2)
        return code, leaks
