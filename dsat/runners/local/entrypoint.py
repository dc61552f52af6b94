"""Turn an experiment's entrypoint into the command that runs one trial on this machine.

Determined's launch layers (`python3 -m determined.launch.deepspeed ...`,
`determined.launch.torch_distributed ...`) are dropped, so one experiment YAML works on a cluster
and here; a multi-slot trial runs under torchrun, a single-slot one directly with the variables
torch.distributed expects. `python`/`python3` become this interpreter, so every trial uses the
same environment (and DeepSpeed's JIT build cache stays valid).
"""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from dsat.errors import DsatError
from dsat.experiment.config import entrypoint_script, resolve_context_path
from dsat.paths import shown

DETERMINED_LAUNCHERS = (
    "determined.launch.deepspeed",
    "determined.launch.torch_distributed",
    "determined.launch.horovod",
)
PYTHON_NAMES = ("python", "python3", sys.executable)


def entrypoint_tokens(entrypoint: str | Sequence[str] | None, source: str) -> list[str]:
    if isinstance(entrypoint, str) and entrypoint.strip():
        try:
            return shlex.split(entrypoint)
        except ValueError as err:
            raise DsatError(f"{source}: entrypoint does not parse as a command ({err})") from None
    if isinstance(entrypoint, (list, tuple)) and entrypoint:
        for i, token in enumerate(entrypoint):
            if not isinstance(token, (str, int, float)) or isinstance(token, bool):
                raise DsatError(  # YAML's null, a nested list: no word of a command
                    f"{source}: entrypoint item {i + 1} is {token!r}; give each word of the "
                    "command as a string"
                )
        return [str(token) for token in entrypoint]
    raise DsatError(
        f"{source}: no entrypoint; set it to the command that trains, e.g. python3 train.py"
    )


# What Determined's launchers run a Trial class with: a module, not the user's command.
DETERMINED_HARNESS = "determined.exec.harness"


def trial_class(tokens: Sequence[str]) -> str | None:
    """The Trial class an entrypoint names (``--trial model_def:MyTrial`` after a Determined
    launcher, a bare ``model_def:MyTrial`` with or without a launcher before it, or Determined's
    harness named directly); None for a command."""
    command = strip_determined_launcher(list(tokens))
    if len(command) == 1 and ":" in command[0] and not command[0].startswith(("/", ".")):
        return command[0]
    if command[:3] in ([name, "-m", DETERMINED_HARNESS] for name in PYTHON_NAMES):
        named = [token for token in command[3:] if not token.startswith("-")]
        return named[0] if named else DETERMINED_HARNESS
    for flag, value in itertools.pairwise(tokens):
        if flag == "--trial":
            return value
    for token in tokens:
        if token.startswith("--trial="):
            return token.partition("=")[2]
    return None


def require_command(tokens: Sequence[str], source: str) -> None:
    """Trial classes (DeepSpeedTrial, PyTorchTrial) run only under Determined's harness."""
    name = trial_class(tokens)
    if name is not None:
        raise DsatError(
            f"{source}: the entrypoint runs the Trial class {name}, which Determined runs only on "
            "a cluster; use --runner determined, or port it to a script (docs/porting-core-api.md)"
        )


def strip_determined_launcher(tokens: list[str]) -> list[str]:
    """``python3 -m determined.launch.X [its flags] CMD...`` -> ``CMD...``."""
    if (
        len(tokens) >= 3
        and tokens[0] in PYTHON_NAMES
        and tokens[1] == "-m"
        and tokens[2] in DETERMINED_LAUNCHERS
    ):
        rest = tokens[3:]
        # The launch layers' own flags come first; the user's command starts at the first token
        # that is not an option (nor an option's value: `--trial`, `--autotuning` take none).
        while rest and rest[0].startswith("-"):
            rest = rest[1:]
        return rest
    return tokens


# Stands for the interpreter in a command built here to run on another machine, whose own
# interpreter takes its place there: dsat's path on this one need not exist on that one.
NODE_PYTHON = "{node python}"
# Where torchrun keeps its per-rank folders, in the trial's own directory: left to itself it
# made a torchelastic_* folder in /tmp for every trial of several processes, never removed.
LAUNCHER_LOGS = ".torchrun"


def check_program(
    command: Sequence[str], model_dir: Path, includes: Sequence[Path], source: str
) -> None:
    """``DsatError`` where the program the entrypoint runs (not a Python the trial replaces with
    this one, nor a Trial class) is neither on this machine's PATH nor a file of MODEL_DIR: every
    trial failed on it, the model profile first, after the launch had promised a checked input."""
    if command and command[0] in PYTHON_NAMES:  # run by this interpreter: it must parse
        check_script_parses(command, model_dir, includes)
        return
    if not command or trial_class(command) is not None:
        return
    program = command[0]
    if os.path.isabs(program):
        found = Path(program).is_file()
    elif "/" in program:  # run from the trial's copy of MODEL_DIR (and the includes)
        found = resolve_context_path(program, model_dir, includes) is not None
    else:
        found = shutil.which(program) is not None
    if not found:
        where = "in MODEL_DIR nor any --include" if "/" in program else "on this machine's PATH"
        raise DsatError(
            f"{source}: the entrypoint runs {program}, which is not {where}; fix the command "
            "(for a Python script: python3 train.py ...)"
        )


def check_script_parses(command: Sequence[str], model_dir: Path, includes: Sequence[Path]) -> None:
    """``DsatError`` where the Python script the entrypoint runs (by this interpreter, as every
    local trial's is) does not parse: the model-profile trial failed on it, after DeepSpeed's ops
    were built and the slots claimed, with neither the file nor the line in its one line."""
    script = entrypoint_script(list(command))
    path = None if script is None else resolve_context_path(script, model_dir, includes)
    if path is None:
        return
    try:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except SyntaxError as err:
        raise DsatError(
            f"{shown(path)}, line {err.lineno}: {type(err).__name__}: {err.msg}; the training "
            "script does not parse: fix it"
        ) from None
    except (OSError, ValueError):  # unreadable, or null bytes: the trial says what it is
        return


def trial_command(
    tokens: list[str],
    slots: int,
    master_port: int,
    nodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    python: str = sys.executable,
) -> list[str]:
    """The command for a trial's ``slots`` processes on this node (of ``nodes``, this one being
    ``node_rank``; the first node listens at ``master_addr:master_port``), run by ``python``
    where the entrypoint names one (another machine's trials name theirs: ``NODE_PYTHON``)."""
    command = strip_determined_launcher(list(tokens))
    if not command:
        raise DsatError(
            "the entrypoint names a Determined launcher but no training command after it"
        )
    is_python = command[0] in PYTHON_NAMES
    if is_python:
        command = [python, *command[1:]]
    if slots * nodes == 1:
        return command
    torchrun = [python, "-m", "torch.distributed.run", "--nnodes", str(nodes)]
    if nodes > 1:  # a static rendezvous: each node knows its rank
        torchrun += ["--node_rank", str(node_rank)]
    torchrun += [
        "--nproc_per_node",
        str(slots),
        "--master_addr",
        master_addr,
        "--master_port",
        str(master_port),
        "--log-dir",
        LAUNCHER_LOGS,
    ]
    if is_python:
        return [*torchrun, *command[1:]]
    return [*torchrun, "--no-python", *command]


def interpreter_first(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with this interpreter's bin directory first on PATH, so that what a trial or
    an op build runs by name comes from dsat's environment. torch builds DeepSpeed's ops with the
    ``ninja`` it finds there; two ninjas (the venv's and the system's) keep no common build log,
    and each rebuilds what the other built (some 40 s on the CPU, each time they alternate)."""
    env = dict(environ)
    bin_dir = str(Path(sys.executable).parent)
    path = env.get("PATH", "")
    if path.split(os.pathsep)[0] != bin_dir:
        env["PATH"] = f"{bin_dir}{os.pathsep}{path}" if path else bin_dir
    return env


# libgomp, torch's OpenMP on Linux, spins 300000 turns (milliseconds) before a waiting thread
# sleeps. A trial's threads that share their cores with other work then spin against a partner
# that is not running, and each parallel op waits out a time slice: 6-10x slower steps on 2 cores
# with one kept busy, 28x for the HF example's. 10000 turns cost nothing measurable on a quiet
# machine and win 1.4-8x of it back (benchmarks/README.md, openmp_wait.py).
OPENMP_SPIN_TURNS = 10000
OPENMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def trial_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What every process dsat starts for a trial inherits: ``interpreter_first``; Python's
    output unbuffered and OpenMP's short spin (``OPENMP_SPIN_TURNS``), each unless the user's
    environment says otherwise. Into a file, a script's prints are otherwise block-buffered: they
    reach the trial's log after its traceback, or never where the process is killed (the OOM
    killer, a timeout), and a full run shows them in 8 KiB bursts. Ray writes its workers' output
    unbuffered for the same reason, and torchrun's log files are line-buffered."""
    env = interpreter_first(environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if not any(name in env for name in OPENMP_WAIT_VARIABLES):
        env["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_TURNS)
    return env


# Determined's DistributedContext broadcasts between a trial's processes on two TCP ports that
# are fixed unless these variables say otherwise; concurrent trials on one machine need their own.
DETERMINED_PORT_VARIABLES = ("INTER_TRAIN_PROCESS_COMM_PORT_1", "INTER_TRAIN_PROCESS_COMM_PORT_2")


def rendezvous_environment(
    processes: int, nodes: int, ports: list[int], master_addr: str = "127.0.0.1"
) -> dict[str, str]:
    """How a trial's ``processes`` find each other. ``ports``: three free ports on the first
    node, torch.distributed's first, then Determined's two.

    One process gets the variables torch.distributed expects (torchrun sets them for several);
    several get Determined's ports (its DistributedContext, which dsat's trial helpers use, listens
    on the first node), and its address once the trial spans nodes. One process listens on port 0:
    the kernel gives its store a free port when it binds, so no other process can take that port
    between dsat choosing it and the trial binding it."""
    if processes > 1:
        env = dict(zip(DETERMINED_PORT_VARIABLES, map(str, ports[1:3]), strict=True))
        if nodes > 1:
            env["DET_CHIEF_IP"] = master_addr
        return env
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": "0",
    }
