"""The table of failures dsat knows: each message, whom it blames, and what the user reads."""

from __future__ import annotations

import signal

import pytest

from dsat.trial_failure import (
    KNOWN_FAILURES,
    OP_NOT_BUILT,
    REASON_CHARS,
    FailureCause,
    diagnose_crash,
    exception_lines,
    final_exceptions,
    first_line,
    known_failure,
    reporting_rank_left_first,
)

TRACEBACK = 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
# A frame of an installed package's (torch's rendezvous) and one of Python's own library.
PACKAGE_FRAME = (
    '  File "/venv/lib/python3.11/site-packages/torch/distributed/rendezvous.py", line 9\n'
)
STDLIB_FRAME = '  File "/usr/lib/python3.11/socket.py", line 851, in create_connection\n'

# torchrun's summary when one worker died of a signal (as torch 2.13 prints it).
TORCHRUN_SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
behaviour_train.py FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-25_03:15:18
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 8137)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 8137
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_03:15:18
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 8138)  ({name})
  error_file: <N/A>
  traceback : {traceback}
======================================================
"""

# One log per entry of the table, as the layer that fails prints it.
SAMPLES: dict[str, tuple[str, FailureCause]] = {
    # What a process limit (ulimit -n, -u, -v) made fail, whichever call met it first.
    "process limit": (
        TRACEBACK + "OSError: [Errno 24] Too many open files\n",
        FailureCause.MACHINE,
    ),
    # dsat's own helper, refusing how the script called it.
    "dsat helper": (
        TRACEBACK + "dsat.errors.DsatError: get_hf_args_with_overwrites: the HF arguments have no "
        "--deepspeed PATH; pass your DeepSpeed JSON with --deepspeed\n",
        FailureCause.SCRIPT,
    ),
    # A fork at ulimit -u, under the script's call into Python's library.
    "process count": (
        TRACEBACK
        + '  File "/usr/lib/python3.11/subprocess.py", line 1883, in _execute_child\n'
        + "BlockingIOError: [Errno 11] Resource temporarily unavailable\n",
        FailureCause.MACHINE,
    ),
    "op build": (
        TRACEBACK + "ImportError: /root/.cache/torch_extensions/py311_cpu/cpu_adam/cpu_adam.so: "
        "cannot open shared object file: No such file or directory\n",
        FailureCause.CONFIG,
    ),
    # A library the op links, loaded by DeepSpeed's op loader.
    "op dependency": (
        TRACEBACK
        + '  File "/venv/lib/python3.11/site-packages/deepspeed/ops/op_builder/builder.py"'
        ", line 541, in load\n    return importlib.import_module(self.absolute_name())\n"
        "ImportError: libcurand.so.10: cannot open shared object file: No such file or "
        "directory\n",
        FailureCause.CONFIG,
    ),
    "import": (
        TRACEBACK + "ModuleNotFoundError: No module named 'transformerz'\n",
        FailureCause.SCRIPT,
    ),
    "syntax": (
        '  File "train.py", line 9\n    def (:\nSyntaxError: invalid syntax\n',
        FailureCause.SCRIPT,
    ),
    # A DataLoader's spawned worker, importing the unguarded script; its parent then reports
    # only "DataLoader worker (pid(s) 29215) exited unexpectedly", which was cause unknown.
    "unguarded spawn": (
        TRACEBACK + "RuntimeError: \n        An attempt has been made to start a new process "
        "before the\n        current process has finished its bootstrapping phase.\n"
        + TRACEBACK
        + "RuntimeError: DataLoader worker (pid(s) 29215) exited unexpectedly\n",
        FailureCause.SCRIPT,
    ),
    "arguments": (
        "usage: train.py [-h] [--deepspeed_config DEEPSPEED_CONFIG]\n"
        "train.py: error: the following arguments are required: --data\n",
        FailureCause.SCRIPT,
    ),
    "no file": (
        "python: can't open file '/tmp/t/trian.py': [Errno 2] No such file or directory\n",
        FailureCause.SCRIPT,
    ),
    "deepspeed config": (
        TRACEBACK + "deepspeed.runtime.config.DeepSpeedConfigError: train_batch_size is not "
        "equal to micro_batch_per_gpu * gradient_acc_step * world_size 8 != 2 * 1 * 2\n",
        FailureCause.CONFIG,
    ),
    # Asserted by DeepSpeed's engine once it runs (it was cause unknown, and the failed
    # profile did not say to fix the config).
    "untested zero optimizer": (
        TRACEBACK + "AssertionError: You are using an untested ZeRO Optimizer. Please add "
        '<"zero_allow_untested_optimizer": true> in the configuration file to use it.\n',
        FailureCause.CONFIG,
    ),
    "batch sizes": (
        TRACEBACK + "AssertionError: Check batch related parameters. train_batch_size is not equal "
        "to micro_batch_per_gpu * gradient_acc_step * world_size 16 != 4 * 1 * 2\n",
        FailureCause.CONFIG,
    ),
    # DeepSpeedCPUAdam's __del__ where its op did not load (a CPU without the op's build).
    "op not loaded": (
        "Exception ignored in: <function DeepSpeedCPUAdam.__del__ at 0x7f3a>\n"
        + TRACEBACK
        + "AttributeError: 'DeepSpeedCPUAdam' object has no attribute 'ds_opt_adam'\n",
        FailureCause.CONFIG,
    ),
    # An entrypoint `bash run_train.sh` without its file: the shell's words, exit 127.
    "shell entrypoint missing": (
        "bash: run_train.sh: No such file or directory\n",
        FailureCause.SCRIPT,
    ),
    # NVMe offload's op on a machine without libaio: the config is valid, the machine lacks it.
    "async_io not loaded": (
        TRACEBACK + "RuntimeError: Unable to JIT load the async_io op due to it not being "
        "compatible due to hardware/software issue. None\n",
        FailureCause.CONFIG,
    ),
    "gpu": (
        TRACEBACK + "RuntimeError: CUDA error: uncorrectable ECC error encountered\n",
        FailureCause.MACHINE,
    ),
    "gpu hidden": (
        TRACEBACK + "RuntimeError: No CUDA GPUs are available\n",
        FailureCause.MACHINE,
    ),
    "gpu busy": (  # another process holds it in exclusive mode
        TRACEBACK + "RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable\n",
        FailureCause.MACHINE,
    ),
    "full disk": (
        TRACEBACK + "OSError: [Errno 28] No space left on device: '/tmp/trial/ckpt'\n",
        FailureCause.MACHINE,
    ),
    "taken port": (
        TRACEBACK + "torch.distributed.DistNetworkError: The server socket has failed to listen "
        "on any local network address. port: 55581, useIpv6: false, code: -98, name: EADDRINUSE, "
        "message: address already in use\n",
        FailureCause.MACHINE,
    ),
    "refused": (  # asyncio's words for it, not the socket's "Connection refused"
        TRACEBACK
        + PACKAGE_FRAME
        + "ConnectionRefusedError: [Errno 111] Connect call failed ('127.0.0.1', 29500)\n",
        FailureCause.MACHINE,
    ),
    "rendezvous": (
        TRACEBACK + "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: \n",
        FailureCause.MACHINE,
    ),
    "nccl": (
        TRACEBACK + "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
        "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed\n",
        FailureCause.MACHINE,
    ),
    "gloo": (
        TRACEBACK + "RuntimeError: Gloo connectFullMesh failed with [../third_party/gloo/gloo/"
        "transport/tcp/pair.cc:144] no error\n",
        FailureCause.MACHINE,
    ),
    "torchrun signalled": (
        TRACEBACK + "torch.distributed.elastic.multiprocessing.api.SignalException: Process 4242 "
        "got signal: 15\n",
        FailureCause.MACHINE,
    ),
    "warm worker lost": (
        "step 3\n\ndsat: the warm worker that ran this trial exited; trial stopped\n",
        FailureCause.MACHINE,
    ),
    "config given twice": (  # DeepSpeed's examples' --deepspeed_config beside config=
        TRACEBACK
        + PACKAGE_FRAME
        + "AssertionError: Not sure how to proceed, we were given deepspeed configs in the "
        "deepspeed arguments and deepspeed.initialize() function call\n",
        FailureCause.SCRIPT,
    ),
    "the reference's hyperparameters": (  # its guide's det.get_cluster_info().trial.hparams
        TRACEBACK + "AttributeError: 'NoneType' object has no attribute 'trial'\n",
        FailureCause.SCRIPT,
    ),
}


def test_a_trial_running_the_references_own_dsat_is_told_to_import_dsat() -> None:
    """``from determined.pytorch import dsat``, as the reference's guide writes it: its
    reporting context failed the trial with "Torch not compiled with CUDA enabled", said as a
    crash of no known kind."""
    log = (
        "Traceback (most recent call last):\n"
        '  File "/t/train.py", line 40, in <module>\n'
        "    with dsat.dsat_reporting_context(core_context, op):\n"
        '  File "/v/site-packages/determined/pytorch/dsat/_utils.py", line 312, in '
        "report_json_results\n"
        "    torch.cuda.synchronize()\n"
        "AssertionError: Torch not compiled with CUDA enabled\n"
    )
    diagnosis = diagnose_crash(log, 1, oom_killed=False)
    assert diagnosis.cause is FailureCause.SCRIPT
    assert diagnosis.reason.startswith("the trial ran Determined's own dsat (from ")
    assert "`import dsat` instead" in diagnosis.reason
    assert diagnosis.reason.endswith(": AssertionError: Torch not compiled with CUDA enabled")


def test_every_known_failure_has_a_sample_it_alone_explains() -> None:
    """Samples, some entries one per way a layer says it, each explained by its entry."""
    matched = [known_failure(log) for log, _ in SAMPLES.values()]
    assert {id(k) for k in matched if k} == {id(k) for k in KNOWN_FAILURES}
    for (log, cause), known in zip(SAMPLES.values(), matched, strict=True):
        assert known is not None
        diagnosis = diagnose_crash(log, 1, oom_killed=False)
        assert diagnosis.cause is cause, log
        assert diagnosis.reason.startswith(known.summary)
        assert not diagnosis.out_of_memory


def test_the_reason_quotes_the_exception_in_one_line() -> None:
    log, _ = SAMPLES["import"]
    diagnosis = diagnose_crash(log, 1, None)
    assert diagnosis.reason == (
        "the training script cannot import what it needs: "
        "ModuleNotFoundError: No module named 'transformerz'"
    )
    # HF's callbacks say a missing package in words of their own.
    wandb = "RuntimeError: WandbCallback requires wandb to be installed. Run `pip install wandb`."
    missing = diagnose_crash(TRACEBACK + wandb + "\n", 1, None)
    assert missing.cause is FailureCause.SCRIPT
    assert missing.reason == f"the training script cannot import what it needs: {wandb}"
    unknown = diagnose_crash(TRACEBACK + "ValueError: bad shape (3, 4)\n", 1, None)
    assert unknown.cause is FailureCause.UNKNOWN
    assert unknown.reason == "ValueError: bad shape (3, 4) (exit code 1)"
    silent = diagnose_crash("loading\nstep 1 done\n", 3, None)
    assert silent.reason == "exit code 3: step 1 done"
    long = diagnose_crash(TRACEBACK + "RuntimeError: " + "x" * 500 + "\n", 1, None)
    assert len(long.reason) == REASON_CHARS and "\n" not in long.reason


def test_a_module_that_does_not_parse_is_named_with_its_line() -> None:
    """Not the entrypoint (checked before launch) but a module it imports: the reason said
    "SyntaxError: invalid syntax", and the user had to open the log to find where."""
    log = (
        TRACEBACK
        + '  File "/r/trials/002-ab/train.py", line 3, in <module>\n    from model import Net\n'
        + '  File "/r/trials/002-ab/model.py", line 30\n    def broken() -> None\n'
        + "                        ^\nSyntaxError: expected ':'\n"
    )
    diagnosis = diagnose_crash(log, 1, None)
    assert diagnosis.cause is FailureCause.SCRIPT
    assert diagnosis.reason == (
        "the training script does not parse (model.py, line 30): SyntaxError: expected ':'"
    )


def test_a_network_error_of_the_scripts_own_code_is_the_scripts() -> None:
    """Its own metrics push or a port it binds itself fails whatever dsat does: not the machine's
    torch.distributed, three runs and "fix the machine"."""
    refused = "ConnectionRefusedError: [Errno 111] Connection refused\n"
    own = diagnose_crash(TRACEBACK + STDLIB_FRAME + refused, 1, None)
    assert own.cause is FailureCause.SCRIPT
    assert own.reason == (
        "the training script's own code (train.py, line 3) failed: ConnectionRefusedError: "
        "[Errno 111] Connection refused"
    )
    labelled = "".join(f"[rank1]: {line}\n" for line in (TRACEBACK + refused).splitlines())
    assert diagnose_crash(labelled, 1, None).reason == own.reason
    # torch's (a package frame further in), or an error of torch's own kind: the machine's
    for log in (TRACEBACK + PACKAGE_FRAME + STDLIB_FRAME + refused, SAMPLES["taken port"][0]):
        assert diagnose_crash(log, 1, None).cause is FailureCause.MACHINE, log


def test_a_lock_the_script_takes_without_waiting_is_the_scripts_not_a_limit() -> None:
    """``fcntl.flock(f, LOCK_EX | LOCK_NB)`` on a lock another process holds raises EAGAIN, as a
    fork at the process limit does: "a limit of the machine", three runs and "fix the machine".
    Raised on the script's own line it is the script's; through Python's library (a fork in
    subprocess or multiprocessing) it stays the machine's limit."""
    eagain = "BlockingIOError: [Errno 11] Resource temporarily unavailable\n"
    own = diagnose_crash(
        TRACEBACK + "    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)\n" + eagain, 1, None
    )
    assert own.cause is FailureCause.SCRIPT
    assert own.reason == (
        "the training script's own code (train.py, line 3) failed: BlockingIOError: [Errno 11] "
        "Resource temporarily unavailable"
    )
    fork = '  File "/usr/lib/python3.11/subprocess.py", line 1883, in _execute_child\n'
    for log in (TRACEBACK + fork + eagain, TRACEBACK + PACKAGE_FRAME + eagain):
        limit = diagnose_crash(log, 1, None)
        assert limit.cause is FailureCause.MACHINE and "limit of the machine" in limit.reason


def test_a_reason_shows_control_characters_as_escapes() -> None:
    """A NUL or a colour code in a script's message would print raw on the terminal line."""
    log = TRACEBACK + "RuntimeError: bad \x00 nul \x1b[31mred\x1b[0m\n"
    reason = diagnose_crash(log, 1, None).reason
    assert reason == "RuntimeError: bad \\x00 nul \\x1b[31mred\\x1b[0m (exit code 1)"


def test_a_crashing_rank_is_blamed_not_the_peers_that_lost_it() -> None:
    # Rank 0 crashes before its store listens; rank 1 then cannot connect.
    log = (
        TRACEBACK
        + "[rank0]: ValueError: hidden size 30 is not divisible by 4 heads\n"
        + TRACEBACK
        + "torch.distributed.DistNetworkError: failed to connect to 127.0.0.1:29500: "
        "Connection refused\n"
        + TORCHRUN_SUMMARY.format(code=1, name="", traceback="To enable traceback see: ...")
    )
    diagnosis = diagnose_crash(log, 1, oom_killed=False)
    assert diagnosis.cause is FailureCause.UNKNOWN
    assert diagnosis.reason.startswith("ValueError: hidden size 30")


def test_sigkill_is_memory_unless_the_oom_killer_stood_still() -> None:
    for log, code in (
        ("", -signal.SIGKILL),
        (
            TORCHRUN_SUMMARY.format(
                code=-9, name="SIGKILL", traceback="Signal 9 (SIGKILL) received by PID 8138"
            ),
            1,
        ),
    ):
        outside = diagnose_crash(log, code, oom_killed=False)
        assert outside.cause is FailureCause.MACHINE and not outside.out_of_memory
        assert "from outside dsat" in outside.reason
        oom = diagnose_crash(log, code, oom_killed=True)
        assert oom.out_of_memory and "out-of-memory killer" in oom.reason
        unknown = diagnose_crash(log, code, oom_killed=None)  # no counter here: as before
        assert unknown.out_of_memory and unknown.cause is FailureCause.CONFIG


@pytest.mark.parametrize(
    ("log", "code"),
    [
        ("RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed.\n", 1),
        ("step 3\n", 137),  # a shell entrypoint: 128 + SIGKILL
        ("[launch.py:319:sigkill_handler] ... exits with return code = -9\n", 247),  # deepspeed
        ("subprocess 4242 exited with return code -9\n", 1),  # a launcher's subprocess
    ],
)
def test_sigkill_as_other_layers_report_it_is_memory_when_the_oom_killer_struck(
    log: str, code: int
) -> None:
    assert diagnose_crash(log, code, oom_killed=True).out_of_memory
    outside = diagnose_crash(log, code, oom_killed=False)
    assert outside.cause is FailureCause.MACHINE and not outside.out_of_memory


def test_a_signal_the_trial_died_of_is_named() -> None:
    diagnosis = diagnose_crash("step 1\n\ndsat: the trial ended the process it ran in\n", -11, None)
    assert diagnosis.cause is FailureCause.UNKNOWN
    assert diagnosis.reason == "exit code -11 (SIGSEGV): step 1"  # its words, not dsat's note


def test_a_rank_that_segfaulted_is_the_cause_not_its_peers_lost_connection() -> None:
    log = (
        TRACEBACK + "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
        "unhandled system error, ncclSystemError: socket\n"
        + TORCHRUN_SUMMARY.format(code=-11, name="SIGSEGV", traceback="Signal 11 (SIGSEGV)")
    )
    diagnosis = diagnose_crash(log, 1, oom_killed=False)
    assert diagnosis.cause is FailureCause.UNKNOWN  # not the machine's: not run again
    assert diagnosis.reason == "a process of the trial died of SIGSEGV (torchrun's root cause)"
    bare = diagnose_crash(
        "step 1\n" + TORCHRUN_SUMMARY.format(code=1, name="", traceback="x"), 1, None
    )
    assert "=====" not in bare.reason


def test_a_worker_killed_after_another_failed_is_not_the_root_cause() -> None:
    # Rank 1 raised; torchrun then stopped rank 0 (its SIGTERM, SIGKILL after the grace period).
    log = (
        TRACEBACK
        + "ValueError: this trial crashes on purpose\n"
        + TORCHRUN_SUMMARY.format(
            code=1, name="", traceback="To enable traceback see: ..."
        ).replace("-15 (pid: 8137)  (SIGTERM)", "-9 (pid: 8137)  (SIGKILL)")
    )
    diagnosis = diagnose_crash(log, 1, oom_killed=False)
    assert diagnosis.cause is FailureCause.UNKNOWN and not diagnosis.out_of_memory
    assert diagnosis.reason.startswith("ValueError: this trial crashes on purpose")


def test_a_warm_worker_lost_to_the_oom_killer_is_out_of_memory() -> None:
    log, _ = SAMPLES["warm worker lost"]
    lost = diagnose_crash(log, 1, oom_killed=True)
    assert lost.out_of_memory and lost.cause is FailureCause.CONFIG
    assert "out-of-memory killer" in lost.reason
    assert diagnose_crash(log, 1, oom_killed=None).cause is FailureCause.MACHINE


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_a_signal_from_outside_is_the_machine(sig: signal.Signals) -> None:
    diagnosis = diagnose_crash("step 1\n", -sig, oom_killed=False)
    assert diagnosis.cause is FailureCause.MACHINE
    # dsat cannot tell another process's signal from the script's own, and says so
    assert diagnosis.reason.startswith(
        f"stopped by {sig.name} from outside dsat: another process, or the training script itself"
    )
    assert ("KeyboardInterrupt" in diagnosis.reason) is (sig is signal.SIGINT)


def test_exception_line_skips_torchruns_summary() -> None:
    log = (
        TRACEBACK + "KeyError: 'labels'\n" + TORCHRUN_SUMMARY.format(code=1, name="", traceback="x")
    )
    assert exception_lines(log)[-1] == "KeyError: 'labels'"
    assert first_line("first\nsecond") == "first" and first_line(None) == ""


def test_without_torchrun_s_summary_a_rank_s_own_error_beats_its_peer_s_lost_connection() -> None:
    """DeepSpeed's launcher names no first failure: the last exception, a peer's closed
    connection, was the reason."""
    log = (
        "[rank1]: ValueError: the real failure\n"
        "[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer\n"
    )
    assert diagnose_crash(log, 1, None).reason.startswith("ValueError: the real failure")


@pytest.mark.parametrize(
    "last_words",
    [
        "RuntimeError: pipe: Too many open files",  # gloo, at ulimit -n 24
        "RuntimeError: can't start new thread",
        # a fork at ulimit -u (a DataLoader's workers: multiprocessing's frame under the script's)
        '  File "/usr/lib/python3.11/multiprocessing/popen_fork.py", line 66, in _launch\n'
        "BlockingIOError: [Errno 11] Resource temporarily unavailable",
        # torch's import at ulimit -v: not the script's missing module, nor an op's build
        "ImportError: /venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so: failed to "
        "map segment from shared object",
        "ImportError: cpu_adam.so: cannot open shared object file: Too many open files",
    ],
)
def test_a_limit_of_the_process_is_the_machine_not_the_config_nor_the_script(
    last_words: str,
) -> None:
    diagnosis = diagnose_crash(TRACEBACK + last_words + "\n", 1, oom_killed=False)
    assert diagnosis.cause is FailureCause.MACHINE
    assert "limit of the machine" in diagnosis.reason


def test_a_warning_raised_as_an_error_is_the_reason_not_the_last_words() -> None:
    """A script with ``warnings.filterwarnings("error")`` failed in DeepSpeed's import, and the
    reason read "exit code 1: atexit ran" (its atexit handler's print)."""
    log = (
        TRACEBACK
        + '  File "torch/jit/_script.py", line 365, in script_method\n    warnings.warn(\n'
        + "DeprecationWarning: `torch.jit.script_method` is deprecated.\natexit ran\n"
    )
    diagnosis = diagnose_crash(log, 1, None)
    assert diagnosis.reason.startswith("DeprecationWarning: `torch.jit.script_method`")
    # A warning only printed (its file's path first) is not how a trial ended.
    printed = "/venv/x.py:3: UserWarning: slow path\n  warnings.warn(\nstep 1\n"
    assert "UserWarning" not in diagnose_crash(printed, 1, None).reason


def test_a_message_that_starts_on_its_own_line_is_quoted_by_its_first_paragraph() -> None:
    log = "RuntimeError: \n        An attempt was made\n        too early.\n\n        Fix it.\n"
    assert exception_lines(log) == ["RuntimeError: An attempt was made too early."]
    assert exception_lines("ValueError:\nstep 3\n    at 4\n") == ["ValueError:"]


def test_a_machine_fault_printed_before_the_end_is_not_the_machines() -> None:
    """A file listing that named "Too many open files", then ``sys.exit("error: ...")``: the
    machine was blamed, each configuration run three times, and the search stopped with "fix the
    machine"; the script's own last line was never shown."""
    log = (
        "dataset listing: shard_0001.bin notes_Too many open files.txt\n"
        + "".join(f"step {n}\n" for n in range(3))
        + "error: loss became NaN at step 3, stopping\n"
    )
    diagnosis = diagnose_crash(log, 1, oom_killed=False)
    assert diagnosis.cause is FailureCause.UNKNOWN, diagnosis
    assert diagnosis.reason == "exit code 1: error: loss became NaN at step 3, stopping"
    # Said last, it is the machine's, and the reason quotes the line.
    limit = diagnose_crash("step 1\npipe: Too many open files\n", 1, oom_killed=False)
    assert limit.cause is FailureCause.MACHINE and limit.reason.endswith(
        ": pipe: Too many open files"
    )


def test_an_exception_caught_and_logged_is_not_the_reason_the_trial_failed() -> None:
    """ "the training script cannot import what it needs: ValueError: ..." contradicted itself,
    and after three trials the search stopped, sending the user after apex."""
    log = (
        "WARNING:train:apex not installed\n"
        + TRACEBACK
        + "    import apex\nModuleNotFoundError: No module named 'apex'\n"
        + "step 1\nstep 2\n"
        + TRACEBACK
        + "    check()\nValueError: loss became NaN at step 3\n"
    )
    diagnosis = diagnose_crash(log, 1, oom_killed=False)
    assert diagnosis.cause is FailureCause.UNKNOWN, diagnosis
    assert diagnosis.reason == "ValueError: loss became NaN at step 3 (exit code 1)"


def test_rank_0_left_first_unless_the_first_to_fail_died_of_a_signal_of_its_own() -> None:
    """NCCL's watchdog aborts (SIGABRT) a rank whose peer left: still rank 0's early exit; a
    segfault is the rank's own end."""
    left = TORCHRUN_SUMMARY.replace(
        "rank      : 0 (local_rank: 0)", "rank      : 2 (local_rank: 2)"
    )
    assert reporting_rank_left_first(left.format(code=-6, name="SIGABRT", traceback="x"))
    assert reporting_rank_left_first(left.format(code=1, name="", traceback="x"))
    assert not reporting_rank_left_first(left.format(code=-11, name="SIGSEGV", traceback="x"))
    assert not reporting_rank_left_first(TORCHRUN_SUMMARY.format(code=1, name="", traceback="x"))


def test_a_worker_torchrun_stopped_from_outside_is_no_crash_of_its_own() -> None:
    """Its SIGTERM is a stop from outside dsat, like torchrun's own: not a rank's crash."""
    log, _ = SAMPLES["torchrun signalled"]
    log += TORCHRUN_SUMMARY.format(code=-15, name="SIGTERM", traceback="Signal 15 (SIGTERM)")
    assert diagnose_crash(log, 1, oom_killed=False).cause is FailureCause.MACHINE


OOM_CAUGHT = TRACEBACK + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n"


def test_lines_of_output_after_a_caught_oom_part_it_from_the_crash_after() -> None:
    """torchrun's ranks failing together print their tracebacks one after another, an
    exception's message may take a few lines after it (NCCL's do): five lines of output of
    its own part a caught OOM from the ValueError that ended the trial."""
    said = "".join(f"retrying at micro-batch {8 - i}\n" for i in range(5))
    summary = TORCHRUN_SUMMARY.format(code=1, name="", traceback="x")
    log = OOM_CAUGHT + said + TRACEBACK + "ValueError: bad labels\n" + summary
    assert [line for _, line in final_exceptions(log, 1)] == ["ValueError: bad labels"]


@pytest.mark.parametrize(
    "after",
    [
        # an atexit callback's traceback after the exception that ended the process
        "Error in atexit._run_exitfuncs:\n" + TRACEBACK + "ValueError: flush failed\n",
        "Exception ignored in: <function Engine.__del__>\n" + TRACEBACK + "ValueError: gone\n",
    ],
)
def test_a_traceback_printed_at_exit_is_not_why_the_process_ended(after: str) -> None:
    log = TRACEBACK + "KeyError: 'labels'\n" + after
    assert diagnose_crash(log, 1, oom_killed=False).reason.startswith("KeyError: 'labels'")


def test_a_peers_broken_pipe_is_not_the_reason() -> None:
    log = (
        "[rank1]: ValueError: the real failure\n[rank0]: BrokenPipeError: [Errno 32] Broken pipe\n"
    )
    assert diagnose_crash(log, 1, None).reason.startswith("ValueError: the real failure")


def test_a_library_the_script_loads_itself_is_no_deepspeed_op() -> None:
    """The script's own ctypes.CDLL("libsndfile.so") was "a DeepSpeed op this configuration
    needs", blamed on every configuration with advice on compilers and torch_adam, and the
    search ran its whole budget instead of stopping on failures alike."""
    log = (
        TRACEBACK
        + "OSError: libdsatmissingaudio.so: cannot open shared object file: No such file\n"
    )
    diagnosis = diagnose_crash(log, 1, oom_killed=False)
    assert diagnosis.cause is FailureCause.UNKNOWN
    assert not diagnosis.reason.startswith(OP_NOT_BUILT)
    assert "libdsatmissingaudio.so" in diagnosis.reason
