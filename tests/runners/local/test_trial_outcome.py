"""A finished trial read as its outcome: status, the one-line reason first, and whom it blames."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from dsat.constants import (
    CONFIG_NOT_TAKEN,
    HPARAMS_FILE,
    MEMORY_RAN_OUT,
    OVERWRITE_KEY,
    RUN_ALONE,
    TRIAL_OUTCOME_FILE,
)
from dsat.runners.local.trial_outcome import (
    ResultWatch,
    classify,
    oom_kill_count,
    oom_killed_since,
)
from dsat.trial import TrialStatus
from dsat.trial_failure import FailureCause


def trial(tmp_path: Path, log: str, outcome: dict[str, object] | None = None) -> Path:
    (tmp_path / "trial.log").write_text(log)
    if outcome is not None:
        (tmp_path / TRIAL_OUTCOME_FILE).write_text(json.dumps(outcome))
    return tmp_path / "trial.log"


def test_metrics_reported_are_a_completed_trial(tmp_path: Path) -> None:
    log = trial(tmp_path, "ok\n", {"status": "completed", "values": {"throughput": 3.0}})
    end = classify(tmp_path, log, 0, False, 60)
    assert end.status is TrialStatus.COMPLETED and end.metrics == {"throughput": 3.0}
    assert end.error is None and end.cause is None
    # Fed more rows than the trial's batch (the script's own batch size): another configuration
    # measured, the script's error, also where it lingered and dsat stopped it.
    over = {"status": "completed", "values": {"throughput": 3.0, "rows_over_batch": 3.0}}
    for timed_out in (False, True):
        end = classify(tmp_path, trial(tmp_path, "ok\n", over), 0, timed_out, 60)
        assert (end.status, end.cause) == (TrialStatus.ERROR, FailureCause.SCRIPT), timed_out
        assert end.error is not None and "3.00x the rows of the trial's batch" in end.error


TEARDOWN_ABORT = (
    "Autotuning: done with running current ds config.\n"
    "terminate called without an active exception\n"
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    "  exitcode  : -6 (pid: 10748)\n"
)


def test_a_crash_after_the_measurement_keeps_it(tmp_path: Path) -> None:
    # Rank 0 wrote the metrics after every rank's measured steps; a rank then aborted at
    # interpreter exit, and torchrun exited 1 (one process alone: -6).
    done = {"status": "completed", "values": {"throughput": 3.0}}
    log = trial(tmp_path, TEARDOWN_ABORT, done)
    for code in (1, -signal.SIGABRT):
        end = classify(tmp_path, log, code, False, 60)
        assert end.status is TrialStatus.COMPLETED and end.metrics == {"throughput": 3.0}
    # The same exit without the metrics written is the failure it was.
    (tmp_path / TRIAL_OUTCOME_FILE).unlink()
    assert classify(tmp_path, log, 1, False, 60).status is TrialStatus.ERROR


def test_an_oom_after_the_measurement_is_an_oom(tmp_path: Path) -> None:
    done = {"status": "completed", "values": {"throughput": 3.0}}
    text = "Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory.\n"
    end = classify(tmp_path, trial(tmp_path, text, done), 1, False, 60)
    assert end.status is TrialStatus.OOM and end.cause is FailureCause.CONFIG
    killed = classify(
        tmp_path, trial(tmp_path, "step 9\n", done), -signal.SIGKILL, False, 60, oom_killed=True
    )
    assert killed.status is TrialStatus.OOM


def test_failures_the_script_causes_whatever_the_config(tmp_path: Path) -> None:
    log = trial(tmp_path, "trained\n", {"status": "incomplete", "steps": 3, "needed": 15})
    end = classify(tmp_path, log, 0, False, 60)
    assert end.status is TrialStatus.ERROR and end.cause is FailureCause.SCRIPT
    assert end.error is not None and end.error.startswith("training ended after 3 optimizer steps")
    assert "--start-profile-step" not in end.error  # the default window's 15
    # A window the profile flags set past the loop's end: the fix left out the flags.
    log = trial(tmp_path, "trained\n", {"status": "incomplete", "steps": 20, "needed": 110})
    end = classify(tmp_path, log, 0, False, 60)
    assert end.cause is FailureCause.SCRIPT and end.error is not None
    assert end.error.splitlines()[0] == (
        "training ended after 20 optimizer steps; the profile window of "
        "--start-profile-step/--end-profile-step needs 110: lower them, or let the training "
        "loop run at least 110 steps"
    )
    (tmp_path / TRIAL_OUTCOME_FILE).unlink()
    end = classify(tmp_path, log, 0, False, 60)  # it never called dsat's helpers
    assert end.cause is FailureCause.SCRIPT and end.error is not None
    assert end.error.splitlines()[0].startswith("the script exited without reporting metrics")
    assert "; its last line: trained:" in end.error.splitlines()[0]
    # A script that printed nothing at all: its training never started (no main() called).
    log = trial(tmp_path, "", None)
    end = classify(tmp_path, log, 0, False, 60)
    assert end.cause is FailureCause.SCRIPT and end.error is not None
    assert end.error.splitlines()[0].startswith(
        "the script exited (exit code 0) without a word: does the entrypoint start its training"
    )
    # Its engine never got the trial's config (its own JSON): that is what it is told.
    log = trial(tmp_path, "trained\n", {"status": CONFIG_NOT_TAKEN})
    end = classify(tmp_path, log, 0, False, 60)
    assert end.status is TrialStatus.ERROR and end.cause is FailureCause.SCRIPT
    assert end.error is not None
    assert end.error.splitlines()[0] == (
        "the script built its DeepSpeed engine without the trial's config: pass "
        "dsat.get_ds_config_from_hparams(hparams) to deepspeed.initialize, not your own JSON"
    )
    assert end.error.splitlines()[1] == "trained"  # the log's tail follows
    # An HF script is told the HF fix; one that asked and threw the result away, that it did.
    said = {
        (False, True): "pass its arguments through dsat.get_hf_args_with_overwrites(args, hparams)",
        (True, True): "the HF Trainer ran without the trial's config (its DeepSpeed engine had no",
        (True, False): "the script's DeepSpeed engine ran without the trial's config (it had no",
    }
    for (taken, hf), words in said.items():
        outcome = {"status": CONFIG_NOT_TAKEN, "taken": taken, "hf": hf}
        end = classify(tmp_path, trial(tmp_path, "trained\n", outcome), 0, False, 60)
        assert end.cause is FailureCause.SCRIPT and end.error is not None
        assert words in end.error.splitlines()[0], end.error


RAN_OUT = (
    "Traceback (most recent call last):\n"
    '  File "train.py", line 57, in train\n'
    "    batch = next(data)\n"
    "[rank0]: {last}\n"
)


def test_data_that_runs_out_in_the_measured_steps_is_the_scripts_with_the_advice(
    tmp_path: Path,
) -> None:
    """An epoch's loader exhausted mid-window (``next(data)`` raised) was an unknown crash,
    "exit code 1: StopIteration", learned from as the configuration's; it is the same too-short
    loop as one that ends cleanly."""
    short = {"status": "incomplete", "steps": 4, "needed": 15}
    for last in ("StopIteration", "RuntimeError: generator raised StopIteration"):
        log = trial(tmp_path, RAN_OUT.format(last=last), short)
        end = classify(tmp_path, log, 1, False, 60)
        assert end.status is TrialStatus.ERROR and end.cause is FailureCause.SCRIPT
        assert end.error is not None
        assert end.error.startswith("the data ran out (StopIteration) after 4 optimizer steps")
        assert "cycle it" in end.error.splitlines()[0]
    # Another exception in the measured steps stays what it was.
    log = trial(tmp_path, RAN_OUT.format(last="RuntimeError: shape mismatch"), short)
    end = classify(tmp_path, log, 1, False, 60)
    assert end.cause is FailureCause.UNKNOWN and end.error is not None
    assert "RuntimeError: shape mismatch" in end.error.splitlines()[0]
    # A quoted source line that says StopIteration is not the process saying it.
    quoted = RAN_OUT.format(last="RuntimeError: shape mismatch").replace(
        "next(data)", "next(data)  # StopIteration at the epoch's end"
    )
    assert classify(tmp_path, trial(tmp_path, quoted, short), 1, False, 60).cause is not (
        FailureCause.SCRIPT
    )


BATCH_REFUSED = (
    "Traceback (most recent call last):\n"
    '  File "train.py", line 40, in <module>\n'
    "AssertionError: Check batch related parameters. train_batch_size is not equal to "
    "micro_batch_per_gpu * gradient_acc_step * world_size 4 != 8 * 1 * 1\n"
)


@pytest.mark.parametrize(
    ("asked", "cause"),
    [
        ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 8}, FailureCause.CONFIG),
        ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4}, FailureCause.SCRIPT),
    ],
)
def test_batch_sizes_refused_blame_the_script_only_where_it_changed_them(
    tmp_path: Path, asked: dict[str, int], cause: FailureCause
) -> None:
    # dsat's own sizes always multiply out: DeepSpeed got 8 where it gave 4, so the script's
    # own --batch-size flag won; where DeepSpeed got what dsat gave, the config is to blame.
    (tmp_path / HPARAMS_FILE).write_text(json.dumps({OVERWRITE_KEY: asked}))
    end = classify(tmp_path, trial(tmp_path, BATCH_REFUSED), 1, False, 60)
    assert end.status is TrialStatus.ERROR and end.cause is cause
    reason = (end.error or "").splitlines()[0]
    if cause is FailureCause.SCRIPT:
        assert reason.startswith(
            "the training script changed the batch sizes dsat gave the trial "
            "(train_micro_batch_size_per_gpu 8, not 4), and DeepSpeed rejected them"
        )
    else:
        assert reason.startswith("DeepSpeed rejected the batch sizes: AssertionError")


def test_an_oom_blames_the_config_and_quotes_the_allocator(tmp_path: Path) -> None:
    text = "Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory.\n"
    end = classify(tmp_path, trial(tmp_path, text), 1, False, 60)
    assert end.status is TrialStatus.OOM and end.cause is FailureCause.CONFIG
    assert end.error is not None
    assert end.error.splitlines()[0] == "torch.OutOfMemoryError: CUDA out of memory."


def test_an_oom_quotes_the_rank_that_ran_out_not_a_peer_that_lost_it(tmp_path: Path) -> None:
    text = (
        "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
        "[rank0]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970\n"
    )
    end = classify(tmp_path, trial(tmp_path, text), 1, False, 60)
    assert end.status is TrialStatus.OOM and end.error is not None
    assert end.error.splitlines()[0].startswith("torch.OutOfMemoryError: CUDA out of memory.")


def test_sigkill_tells_the_oom_killer_from_outside(tmp_path: Path) -> None:
    log = trial(tmp_path, "step 2\n")
    outside = classify(tmp_path, log, -signal.SIGKILL, False, 60, oom_killed=False)
    assert outside.status is TrialStatus.ERROR and outside.cause is FailureCause.MACHINE
    killer = classify(tmp_path, log, -signal.SIGKILL, False, 60, oom_killed=True)
    assert killer.status is TrialStatus.OOM and killer.cause is FailureCause.CONFIG


@pytest.mark.parametrize(
    ("log", "code", "host"),
    [
        ("step 9\n", -signal.SIGKILL, True),  # the kernel's OOM killer: the host's memory
        (
            "Traceback (most recent call last):\nRuntimeError: [enforce fail at alloc_cpu.cpp:"
            "117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB\n",
            1,
            True,
        ),
        # As dsat_reporting_context prints it, before the traceback.
        (
            "DSAT_TRIAL_OUT_OF_MEMORY: MemoryError: \nTraceback (most recent call last):\nMemoryError\n",
            1,
            True,
        ),
        # Raised before the reporting context (the data, the model): an error of no known kind.
        ("Traceback (most recent call last):\nMemoryError\n", 1, True),
        (
            "Traceback (most recent call last):\nnumpy.core._exceptions._ArrayMemoryError: Unable "
            "to allocate 8.00 GiB for an array with shape (1073741824,) and data type float64\n",
            1,
            True,
        ),
        (
            "Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory. "
            "Tried to allocate 2.00 GiB\n",
            1,
            False,
        ),
    ],
)
def test_an_oom_of_the_hosts_memory_on_a_gpu_trial_says_so(
    tmp_path: Path, log: str, code: int, host: bool
) -> None:
    """It says nothing of how much of the GPU is usable (usable_memory); on the CPU the host's
    memory is the device's."""
    path = trial(tmp_path, log)
    on_gpu = classify(tmp_path, path, code, False, 60, oom_killed=True, on_gpu=True)
    assert on_gpu.status is TrialStatus.OOM
    assert on_gpu.metrics == ({MEMORY_RAN_OUT: "host"} if host else {})
    on_cpu = classify(tmp_path, path, code, False, 60, oom_killed=True)
    assert on_cpu.status is TrialStatus.OOM and on_cpu.metrics == {}
    # Beside other trials, the host's memory running out blames the machine: it runs again alone.
    for gpu in (True, False):
        shared = classify(tmp_path, path, code, False, 60, oom_killed=True, on_gpu=gpu, shared=True)
        if not host:  # the GPU's own memory is the trial's alone
            assert (shared.status, shared.cause) == (TrialStatus.OOM, FailureCause.CONFIG)
            continue
        assert (shared.status, shared.cause) == (TrialStatus.ERROR, FailureCause.MACHINE)
        assert shared.metrics[RUN_ALONE] is True
        assert shared.error is not None and shared.error.startswith(
            "the host's memory ran out while other trials shared this machine ("
        )


def test_a_timeout_says_so_first(tmp_path: Path) -> None:
    end = classify(tmp_path, trial(tmp_path, "step 1\n"), None, True, 300)
    assert end.status is TrialStatus.TIMEOUT and end.error is not None
    assert end.error.splitlines()[0] == "stopped after the trial timeout of 300 s"
    assert end.cause is FailureCause.UNKNOWN  # slow for its config, or the machine: not known


def test_an_oom_the_reporting_context_wrote_down_is_one_whatever_the_log(tmp_path: Path) -> None:
    """dsat_reporting_context writes it where it caught the OOM; the log need not say so."""
    log = trial(tmp_path, "step 3\n", {"status": "oom"})
    end = classify(tmp_path, log, 1, False, 60)
    assert end.status is TrialStatus.OOM and end.cause is FailureCause.CONFIG, end.error


def test_the_oom_killer_count_moves_only_forward() -> None:
    count = oom_kill_count()
    if count is None:  # no /proc/vmstat nor cgroup v2 events here: SIGKILL stays an OOM
        assert oom_killed_since(0) is None
        return
    assert count >= 0 and oom_killed_since(count) is False
    assert oom_killed_since(count - 1) is True and oom_killed_since(None) is None


def test_an_outcome_file_overwritten_with_something_else_is_no_crash_of_the_search(
    tmp_path: Path,
) -> None:
    """A list, a string or "values" of the wrong kind raised in the runner (AttributeError,
    TypeError): the search ended with a traceback. Now the trial is judged by its exit and log."""
    log = trial(tmp_path, "trained\n")
    for written in ([1, 2], "completed", {"status": "completed", "values": [3.0]}, None):
        (tmp_path / TRIAL_OUTCOME_FILE).write_text(json.dumps(written))
        end = classify(tmp_path, log, 0, False, 60)
        assert end.status is TrialStatus.ERROR and end.cause is FailureCause.SCRIPT
        assert end.error is not None and "is not what dsat" in end.error.splitlines()[0]


def test_memory_words_beside_a_machine_fault_do_not_blame_the_config(tmp_path: Path) -> None:
    """A note that mentions memory, or a traceback's source line with a comment that does, made
    a taken port an OOM of the configuration (its micro-batch ceiling lowered)."""
    port_taken = "OSError: [Errno 98] Address already in use\n"
    for before in (
        "note: the allocator retries once on out of memory\n",
        'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n'
        "    _connect()  # before the model, so that an out of memory leaves no store\n"
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/rendezvous.py", line 9\n',
    ):
        end = classify(tmp_path, trial(tmp_path, before + port_taken), 1, False, 60)
        assert end.status is TrialStatus.ERROR and end.cause is FailureCause.MACHINE, end.error
    # Nor does a hint under it, read as the taken port's message.
    hint = port_taken + "hint: a port left by a trial that ran out of memory may still be held\n"
    end = classify(tmp_path, trial(tmp_path, hint), 1, False, 60)
    assert end.status is TrialStatus.ERROR and end.cause is FailureCause.MACHINE, end.error
    # An allocator's message outside any exception line, with no machine fault, is still an OOM.
    printed = "step 3\nCUDA out of memory. Tried to allocate 2.00 GiB\n"
    assert classify(tmp_path, trial(tmp_path, printed), 1, False, 60).status is TrialStatus.OOM
    # And the OOM's own exception wins over a peer's connection error after it.
    both = "torch.OutOfMemoryError: CUDA out of memory.\n" + port_taken
    assert classify(tmp_path, trial(tmp_path, both), 1, False, 60).status is TrialStatus.OOM


def test_a_trial_stopped_after_it_reported_keeps_its_result(tmp_path: Path) -> None:
    """It measured, then something it started kept it from exiting until dsat stopped it."""
    done = {"status": "completed", "values": {"throughput": 3.0}}
    end = classify(tmp_path, trial(tmp_path, "step 15\n", done), -signal.SIGKILL, True, 60)
    assert end.status is TrialStatus.COMPLETED and end.metrics == {"throughput": 3.0}


RANK_ONE_FAILED_FIRST = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "train.py", line 36, in _fault
[rank1]:     raise ValueError("bad value")  # not really out of memory here
[rank1]: ValueError: bad value
[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:58041.
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_21:44:33
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 16930)
============================================================
"""


def test_a_comment_in_a_traceback_is_no_oom_and_the_rank_that_failed_first_is_named(
    tmp_path: Path,
) -> None:
    """The comment made rank 1's ValueError an OOM of the configuration, its micro-batch ceiling
    lowered, and the reason was rank 0's closed connection, which only followed from it."""
    end = classify(tmp_path, trial(tmp_path, RANK_ONE_FAILED_FIRST), 1, False, 60)
    assert end.status is TrialStatus.ERROR and end.cause is FailureCause.UNKNOWN, end.error
    assert end.error is not None and end.error.startswith("ValueError: bad value")


def test_an_oom_said_outside_an_exception_line_is_the_reason_given(tmp_path: Path) -> None:
    """NCCL says it on a line of its own below its exception; dsat's marker beats a machine fault
    after it, and either is the reason, not the last exception of the log."""
    nccl = (
        "[rank0]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
        "unhandled cuda error\n[rank0]: Last error:\n[rank0]: Cuda failure 'out of memory'\n"
    )
    end = classify(tmp_path, trial(tmp_path, nccl), 1, False, 60)
    assert end.status is TrialStatus.OOM and end.error is not None
    assert end.error.splitlines()[0] == "[rank0]: Cuda failure 'out of memory'"
    marked = "DSAT_TRIAL_OUT_OF_MEMORY: CUDA out of memory at micro-batch 64\n"
    end = classify(
        tmp_path, trial(tmp_path, marked + "OSError: Address already in use\n"), 1, False, 60
    )
    assert end.status is TrialStatus.OOM and end.error is not None
    assert end.error.splitlines()[0] == "CUDA out of memory at micro-batch 64"


def test_an_atexit_tracebacks_oom_after_an_exception_is_not_its_message(tmp_path: Path) -> None:
    """The lines after the KeyError were read as its message, into the traceback an atexit
    callback printed after it: its OOM made the script's KeyError an OOM of the configuration."""
    log = (
        'step 1\nTraceback (most recent call last):\n  File "train.py", line 10, in <module>\n'
        "    batch[\"labels\"]\nKeyError: 'labels'\nError in atexit._run_exitfuncs:\n"
        'Traceback (most recent call last):\n  File "cuda.py", line 5, in _cleanup\n'
        "    torch.cuda.synchronize()\nRuntimeError: CUDA error: out of memory\n"
    )
    end = classify(tmp_path, trial(tmp_path, log), 1, False, 60)
    assert end.status is TrialStatus.ERROR, end.error
    assert end.error is not None and end.error.startswith("KeyError: 'labels'")
    # NCCL's message, its error's name on a line of its own, is still read to its end.
    nccl = (
        "[rank0]: torch.distributed.DistBackendError: NCCL error in: NCCLUtils.hpp:275, "
        "unhandled cuda error\n[rank0]: ncclUnhandledCudaError: Call to CUDA function failed.\n"
        "[rank0]: Last error:\n[rank0]: Cuda failure 'out of memory'\n"
    )
    end = classify(tmp_path, trial(tmp_path, nccl), 1, False, 60)
    assert end.status is TrialStatus.OOM, end.error
    # Another rank's line printed in the middle of it does not end it.
    between = nccl.replace("[rank0]: Last error:", "[rank1]: step 3\n[rank0]: Last error:")
    end = classify(tmp_path, trial(tmp_path, between), 1, False, 60)
    assert end.status is TrialStatus.OOM, end.error
    # Five lines on, what a process says is no longer the message (a note, a later print).
    later = nccl.replace("[rank0]: Last error:", "[rank0]: Last error:\n" + "[rank0]: more\n" * 3)
    assert classify(tmp_path, trial(tmp_path, later), 1, False, 60).status is TrialStatus.ERROR


def first_to_fail(rank: int, pid: int) -> str:
    """torchrun's summary naming ``rank`` alone as failed (exit code 1)."""
    return (
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        "Failures:\n  <NO_OTHER_FAILURES>\n"
        f"Root Cause (first observed failure):\n[0]:\n  rank      : {rank} (local_rank: {rank})\n"
        f"  exitcode  : 1 (pid: {pid})\n============================================================\n"
    )


def test_rank_0_leaving_cleanly_before_its_peers_is_the_scripts_fault(tmp_path: Path) -> None:
    """It was an unknown crash, blamed on no one and learned from as the configuration's, with
    rank 1's connection reset as the reason; torchrun lists rank 0 among no failures."""
    log = (
        "[rank1]: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:22156: "
        "Connection reset by peer.\n" + first_to_fail(rank=1, pid=17486)
    )
    end = classify(tmp_path, trial(tmp_path, log), 1, False, 60)
    assert end.status is TrialStatus.ERROR and end.cause is FailureCause.SCRIPT, end.error
    assert end.error is not None and end.error.startswith("rank 0 (the rank that reports) exited")
    # Rank 0 stopped by torchrun after rank 1 failed is among the failures: rank 1's crash.
    stopped = log.replace(
        "  <NO_OTHER_FAILURES>\n", "[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15\n"
    )
    end = classify(tmp_path, trial(tmp_path, stopped), 1, False, 60)
    assert end.cause is not FailureCause.SCRIPT, end.error
    # On one node of several, its torchrun names only its own ranks' failures: rank 0 may have
    # been on another node, and failed there.
    end = classify(tmp_path, trial(tmp_path, log), 1, False, 60, every_rank_here=False)
    assert end.cause is not FailureCause.SCRIPT, end.error


def test_another_rank_leaving_cleanly_is_the_scripts_fault(tmp_path: Path) -> None:
    """Rank 1 ran out of its shard and exited 0; rank 0 then lost it mid-step. It was an unknown
    crash, learned from as the configuration's, with the lost peer as its reason."""
    log = (
        "rank 1: no more data in my shard, done\n"
        "[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:42201. This is typically caused by a remote worker crashing.\n"
        + first_to_fail(rank=0, pid=4033)
    )
    end = classify(tmp_path, trial(tmp_path, log), 1, False, 60)
    assert end.status is TrialStatus.ERROR and end.cause is FailureCause.SCRIPT, end.error
    assert end.error is not None and end.error.startswith("a rank exited cleanly (exit code 0)")
    # A rank of its own failure, or one killed by a signal, is no clean exit of another.
    for other in (
        log.replace("RuntimeError: [gloo", "ValueError: bad shape [gloo")
        .replace("Connection closed by peer", "")
        .replace("remote worker crashing", "bug"),
        log.replace(
            "  <NO_OTHER_FAILURES>\n", "[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9\n"
        ),
    ):
        end = classify(tmp_path, trial(tmp_path, other), 1, False, 60)
        assert end.cause is not FailureCause.SCRIPT, end.error
    end = classify(tmp_path, trial(tmp_path, log), 1, False, 60, every_rank_here=False)
    assert end.cause is not FailureCause.SCRIPT, end.error


def test_a_note_printed_before_an_exception_of_another_kind_is_no_oom(tmp_path: Path) -> None:
    """The note made the script's own KeyError an OOM of every configuration it reached."""
    log = (
        "# note: this is not an out of memory error\n"
        'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n'
        "    step()\nKeyError: 'x'\n"
    )
    end = classify(tmp_path, trial(tmp_path, log), 1, False, 60)
    assert end.status is TrialStatus.ERROR and end.error is not None
    assert end.error.startswith("KeyError: 'x'")
    # Said by a process that crashed without an exception of its own (an allocator's abort in
    # C++), beside a peer that lost it, it is still the OOM.
    native = (
        "terminate called after throwing an instance of 'c10::OutOfMemoryError'\n"
        "  what():  CUDA out of memory. Tried to allocate 20.00 MiB\n"
        "frame #0: c10::Error::Error() + 0x96 (0x7f0 in libc10.so)\n"
        "[rank1]: RuntimeError: Connection reset by peer\n"
    )
    assert classify(tmp_path, trial(tmp_path, native), 1, False, 60).status is TrialStatus.OOM


OOM_TRACEBACK = (
    'Traceback (most recent call last):\n  File "train.py", line 9, in probe\n    step()\n'
    "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (probe)\n"
)
CAUGHT_OOM = (
    "ERROR:train:probe failed, continuing\n"
    + OOM_TRACEBACK
    + "note: out of memory is retried with a smaller probe\n"
)
STEPS = "".join(f"step {n}\n" for n in range(3))
VALUE_ERROR = (
    'Traceback (most recent call last):\n  File "train.py", line 40, in <module>\n    check()\n'
    "ValueError: loss became NaN at step 3\n"
)


def test_an_oom_the_script_caught_and_went_on_after_is_no_oom(tmp_path: Path) -> None:
    """A logged OOM probe, and a note that mentions out of memory just after its traceback, made
    the script's later ValueError an OOM of every configuration: ceilings lowered until the
    budget ran out (a trial host and a fresh process alike: helper audit, 2026-11-28)."""
    end = classify(tmp_path, trial(tmp_path, CAUGHT_OOM + STEPS + VALUE_ERROR), 1, False, 60)
    assert end.status is TrialStatus.ERROR and end.cause is FailureCause.UNKNOWN, end.error
    assert end.error is not None and end.error.startswith("ValueError: loss became NaN")
    # Nor does a crash without an exception after it (a segfault) make it one.
    segfault = classify(tmp_path, trial(tmp_path, CAUGHT_OOM + STEPS), -11, False, 60)
    assert segfault.status is TrialStatus.ERROR, segfault.error
    # A trial that reported, then aborted at teardown, keeps its measurement.
    done = {"status": "completed", "values": {"throughput": 3.0}}
    log = trial(tmp_path, CAUGHT_OOM + STEPS + TEARDOWN_ABORT, done)
    assert classify(tmp_path, log, -6, False, 60).status is TrialStatus.COMPLETED
    # torch labels the exception that ends a process whose group exists, not one logged.
    (tmp_path / TRIAL_OUTCOME_FILE).unlink()
    labelled = "".join(f"[rank0]: {line}\n" for line in VALUE_ERROR.splitlines())
    end = classify(tmp_path, trial(tmp_path, CAUGHT_OOM + STEPS + labelled), 1, False, 60)
    assert end.status is TrialStatus.ERROR, end.error
    assert end.error is not None and end.error.startswith("ValueError: loss became NaN")
    # Chained to the exception that ended the process, it is the OOM.
    chained = (
        OOM_TRACEBACK
        + "\nDuring handling of the above exception, another exception occurred:\n\n"
        + VALUE_ERROR
    )
    assert classify(tmp_path, trial(tmp_path, chained), 1, False, 60).status is TrialStatus.OOM


def test_a_tip_that_mentions_out_of_memory_is_no_oom_without_an_allocators_words(
    tmp_path: Path,
) -> None:
    """The model-profile trial's ``sys.exit("config error ...")`` after a tip was an OOM, and
    the search ended with "the model does not fit at micro-batch 1 in any way dsat tried"."""
    tip = "hint: if you see CUDA out of memory, lower --micro-batch\n"
    end = classify(
        tmp_path,
        trial(tmp_path, tip + "config error: data path /data/train not found\n"),
        1,
        False,
        60,
    )
    assert end.status is TrialStatus.ERROR, end.error
    assert end.error is not None and "data path /data/train not found" in end.error
    # A segfault after it likewise; an allocator's own words at the end are still an OOM.
    assert classify(tmp_path, trial(tmp_path, tip + STEPS), -11, False, 60).status is (
        TrialStatus.ERROR
    )
    said = STEPS + "CUDA out of memory. Tried to allocate 2.00 GiB\n"
    assert classify(tmp_path, trial(tmp_path, said), -6, False, 60).status is TrialStatus.OOM
    aborted = STEPS + (
        "terminate called after throwing an instance of 'c10::Error'\n"
        "  what():  cudaErrorMemoryAllocation: out of memory\n"
    )
    assert classify(tmp_path, trial(tmp_path, aborted), -6, False, 60).status is TrialStatus.OOM


def test_an_exit_the_script_chose_after_a_caught_exception_is_said_as_its_own(
    tmp_path: Path,
) -> None:
    """``sys.exit(3)`` after a KeyError logged at start-up was "KeyError: 'wandb_project'"."""
    caught = (
        "WARNING:train:no wandb\n"
        'Traceback (most recent call last):\n  File "train.py", line 4, in <module>\n    cfg()\n'
        "KeyError: 'wandb_project'\n"
    )
    end = classify(
        tmp_path, trial(tmp_path, caught + STEPS + "ERROR:train:loss is NaN\n"), 3, False, 60
    )
    assert end.error is not None and end.error.startswith("exit code 3: ERROR:train:loss is NaN")


def test_a_script_that_swallowed_an_exception_and_exited_0_names_it(tmp_path: Path) -> None:
    """It was told to let its loop run longer; the ValueError that ended its training was never
    mentioned."""
    log = trial(tmp_path, STEPS + VALUE_ERROR, {"status": "incomplete", "steps": 3, "needed": 15})
    end = classify(tmp_path, log, 0, False, 60)
    assert end.status is TrialStatus.ERROR and end.cause is FailureCause.SCRIPT
    assert end.error is not None
    assert "which the script caught: ValueError: loss became NaN" in end.error.splitlines()[0]
    (tmp_path / TRIAL_OUTCOME_FILE).unlink()
    end = classify(tmp_path, log, 0, False, 60)
    assert end.error is not None and "ValueError: loss became NaN" in end.error.splitlines()[0]


def test_a_traceback_followed_by_more_than_the_scanned_end_is_still_the_reason(
    tmp_path: Path,
) -> None:
    """An atexit summary of thousands of lines after it gave "exit code 1: | layer.03999 | ..."."""
    summary = "".join(f"| layer.{n:05d}.mlp | {'x' * 80} |\n" for n in range(4000))
    log = trial(tmp_path, STEPS + VALUE_ERROR + summary)
    end = classify(tmp_path, log, 1, False, 60)
    assert end.error is not None and end.error.startswith("ValueError: loss became NaN"), end.error
    # One enormous line is cut in the tail the row keeps.
    huge = trial(tmp_path, "Traceback (most recent call last):\nValueError: " + "7, " * 200_000)
    end = classify(tmp_path, huge, 1, False, 60)
    assert end.error is not None and len(end.error) < 2000


TRIAL_LOGS = Path(__file__).parents[2] / "fixtures" / "trial_logs"
CASES = json.loads((TRIAL_LOGS / "cases.json").read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_logs_as_the_layers_print_them(tmp_path: Path, name: str) -> None:
    """Logs as PyTorch, torchrun (2.1 to 2.13), DeepSpeed's launcher, accelerate, faulthandler,
    NCCL and atexit print them: each real OOM stays one (a traceback after it from an atexit
    callback, a launcher's own exception, an abort at teardown, a rank torchrun misnames as the
    root cause), and a caught one does not make a later failure one."""
    case = CASES[name]
    shutil.copy(TRIAL_LOGS / f"{name}.log", tmp_path / "trial.log")
    end = classify(tmp_path, tmp_path / "trial.log", case["code"], False, 60, case["oom_killed"])
    assert end.status.value == case["status"], end.error
    assert (end.cause and end.cause.value) == case["cause"], end.error
    assert (end.error or "").startswith(case.get("reason", "")), end.error


def test_a_reported_trial_lingers_only_past_the_linger_time() -> None:
    """Stopped as soon as its result was seen, a trial would lose its DeepSpeed teardown; never,
    a thread it started would hold its slot until the timeout."""
    looks: list[float] = []

    def has_reported() -> bool:
        looks.append(0.0)
        return True

    watch = ResultWatch(linger_s=10.0)
    assert watch.lingered(100.0, has_reported) is None  # seen written now
    assert watch.lingered(100.5, has_reported) is None and len(looks) == 1
    assert watch.lingered(110.0, has_reported) is None  # exactly the linger time: not yet
    assert watch.lingered(110.5, has_reported) == pytest.approx(10.5)
    unwritten = ResultWatch(linger_s=10.0)
    looked: list[float] = []

    def not_yet() -> bool:
        looked.append(0.0)
        return False

    for now in (100.0, 100.5, 101.0, 200.0):  # the file is read once a second at most
        assert unwritten.lingered(now, not_yet) is None  # never written: never lingers
    assert len(looked) == 3


def test_a_timed_out_trial_keeps_its_last_words_not_its_launchers_shutdown(
    tmp_path: Path,
) -> None:
    """A two-process trial whose rank 1 hung, stopped at its timeout: its row kept torchrun's
    20-line shutdown traceback (ending in SignalException), and the line that showed where it
    hung ("RANK1 HANG") was left out above it. (A real log, from Ray.)"""
    shutil.copy(TRIAL_LOGS / "timeout_rank1_hang_torchrun_stopped.log", tmp_path / "trial.log")
    end = classify(tmp_path, tmp_path / "trial.log", -15, True, 30)
    assert end.status is TrialStatus.TIMEOUT and end.error is not None
    reason, *tail = end.error.splitlines()
    assert reason == "stopped after the trial timeout of 30 s"
    assert tail[-1] == "RANK1 HANG"
    assert not [line for line in tail if "SignalException" in line or "closing signal" in line]
