"""The Ray runner: each trial a placement group on a Ray cluster, one actor per node of the trial.

A trial's slots are packed on one node when one can hold them, else spread evenly over nodes
(``placement``). Once its placement group is ready, each node's actor (``node_host``) unpacks the
model dir and starts the trial's command: the command itself on one slot, torchrun with a static
rendezvous (node count, node rank, the first node's address and a port free there) on several.
Outcomes are read on the nodes as the local runner reads them; each node's log comes back to
``logs/`` in the results directory. A trial that cannot be placed yet waits; its timeout runs from
its start. Stopping a trial stops each node's process group, then removes its actors and its
placement group (``ray.cancel`` would leave torchrun's workers running).
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import re
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from dsat.atomic_file import write_text_atomic
from dsat.constants import (
    ENV_HPARAMS_FILE,
    ENV_RESULTS_DIR,
    ENV_TRIAL_LENGTH,
    HPARAMS_FILE,
    LINGERED_KEY,
    MEMORY_RAN_OUT,
    METRICS_FILE,
    MODEL_INFO_FILE,
    RUN_ALONE,
    TRIAL_OUTCOME_FILE,
)
from dsat.errors import DsatError
from dsat.paths import shown
from dsat.results.directory import FULL_RUN_DIR, trials_numbered
from dsat.runners.local.entrypoint import NODE_PYTHON, rendezvous_environment, trial_command
from dsat.runners.local.full_run import FullExperimentFailed
from dsat.runners.local.log_cap import cap_log
from dsat.runners.local.trial_outcome import LINGER_S, ResultWatch
from dsat.runners.local.trial_processes import strays_note
from dsat.runners.local.trial_timeout import TrialTimeout
from dsat.runners.ray.node_host import (
    NODE_ROOT,
    TrialNodeHost,
    clear_earlier_copies,
    left_behind_log,
    protocol,
)
from dsat.runners.ray.placement import TrialLayout, node_capacities
from dsat.runners.trial_runner import RunnerStopped, StoppedRun
from dsat.trial import TrialOutcome, TrialStatus, trial_number
from dsat.trial_failure import FailureCause, first_line, lost_a_peer

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2
# After one node's process exited, the others get this long to end by themselves before they are
# stopped (a rank that failed leaves the others waiting in a collective).
OTHER_NODES_GRACE_S = 30.0
STOP_WAIT_S = 15.0
# How long Ray may take to mark a node that died as dead (its health checks, 3 s apart, missed
# five times in a row by default), after one of its actors could no longer be reached.
NODE_DEATH_WAIT_S = 30.0
# A trial not placed yet: how often the live cluster is asked whether it can still hold it (a
# node that left can make that impossible, and Ray then waits for ever), and after how long the
# wait is said.
PLACEMENT_CHECK_S = 10.0
PLACEMENT_NOTE_S = 60.0
LOG_CHUNK = 1 << 20
LOG_STREAM_S = 2.0  # how often a running trial's logs come back
LOG_STREAM_CHUNKS = 16  # at most this many LOG_CHUNKs of a node's log each time
COPY_NOTE_MB = 100  # what the full run wrote is said before it comes back from this size
SAME_DSAT = "install dsat with its ray extra on every node, the same version as here"
COPY_CHUNK = 8 << 20  # what the full run wrote comes back in pieces of this size
KEPT_FILES = [TRIAL_OUTCOME_FILE, METRICS_FILE, MODEL_INFO_FILE, HPARAMS_FILE]
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # the colours Ray's remote tracebacks carry


@dataclasses.dataclass
class RayTrial:
    request_id: str
    name: str  # like the local runner's trial directories: NNN-<request id's start>
    hparams: dict[str, Any]
    length: int | None
    group: Any  # its placement group
    placed: Any  # the object ref that resolves once the group is placed
    hosts: list[Any] = dataclasses.field(default_factory=list)  # actor handles, node rank order
    nodes: list[str] = dataclasses.field(default_factory=list)  # Ray node ids, same order
    asked: float = 0.0  # when its placement group was asked for (runner time)
    checked: float = 0.0  # when the cluster was last asked whether it can hold it
    waiting_said: bool = False
    start: float | None = None  # when its processes started (None: still being placed)
    first_exit: float | None = None
    # The node ranks whose processes ended by themselves before dsat stopped the rest: one of
    # them says what happened to the trial, not a node dsat stopped (None: none was stopped).
    ended_first: list[int] | None = None
    result_watch: ResultWatch = dataclasses.field(default_factory=ResultWatch)
    # Bytes of each node's log already in ``logs/`` (they come back while it runs), and when.
    log_here: list[int] = dataclasses.field(default_factory=list)
    logs_read: float = 0.0
    shared: bool = False  # another trial ran on one of its nodes at some time (classify)


def note_shared_nodes(trial: RayTrial, running: Collection[RayTrial]) -> None:
    """Mark ``trial`` and the ``running`` trials that share a node with it: an OOM of that
    node's memory is then the machine's (``trial_outcome.classify``)."""
    for other in running:
        if other is not trial and set(other.nodes) & set(trial.nodes):
            other.shared = trial.shared = True


def ran_out_of_host_memory(err: Exception) -> bool:
    """Whether Ray says its memory monitor killed the worker (``OutOfMemoryError``, or an
    actor death whose cause names it), rather than that the node is gone."""
    if type(err).__name__ == "OutOfMemoryError":
        return True
    text = str(err)
    return "OutOfMemoryError" in text or "running low on memory" in text


def lost_note(brought: int) -> bytes:
    """What a node's log says where the rest of it was lost with its node."""
    what = "the rest of this log" if brought else "this log (none of it had come back)"
    return f"\n[dsat: {what} was lost with its node]\n".encode()


def last_line(text: str) -> str:
    """The last line of one of Ray's messages, which span lines (tracebacks, indented context)
    where the search's reasons do not: its exception, as its own last line says it."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def step_failure(err: Exception) -> str:
    """What a step that raised on a node (a ``RayTaskError``) raised there, in one line."""
    cause = getattr(err, "cause", None) or err
    return f"{type(cause).__name__}: {last_line(str(cause))}"


def speaking_rank(results: list[dict[str, Any]], ended_first: list[int] | None) -> int:
    """The node whose outcome is the trial's: the first node's, unless dsat stopped it after
    others ended by themselves (``ended_first``: those, where some ended before the rest), or
    it failed after a peer it lost: then the first of those that failed by themselves, not for
    want of a peer (two that failed within one look at the nodes both ended first)."""
    candidates = ended_first or list(range(len(results)))
    failing = [rank for rank in candidates if results[rank]["status"] != "completed"]
    own = [rank for rank in failing if not lost_a_peer(first_line(results[rank]["error"]))]
    if ended_first and 0 not in ended_first:
        return (own or failing or ended_first)[0]
    return own[0] if 0 in failing and own else 0


class RayRunner:
    """Trials on a Ray cluster (see the module's docstring)."""

    takes_real_time = True

    def __init__(
        self,
        ray: Any,
        entrypoint: list[str],
        archive: Any,  # an object ref to the model dir's zip
        layout: TrialLayout,
        total_slots: int,
        results_dir: Path,
        search_name: str,
        timeout: TrialTimeout,
        environ: dict[str, str],
    ) -> None:
        self.ray = ray
        self.entrypoint = entrypoint
        self.archive = archive
        self.layout = layout
        self.total_slots = total_slots
        self.results_dir = results_dir
        self.search_name = search_name  # names this search's trial copies on the nodes
        self.timeout = timeout
        self.environ = environ  # what dsat passes on to every trial
        self.running: dict[str, RayTrial] = {}
        self.started_at = time.monotonic()
        self._count = trials_numbered(results_dir)
        self._host_class = ray.remote(TrialNodeHost)
        self.placement_check_s = PLACEMENT_CHECK_S
        self.linger_s = LINGER_S

    # ------------------------------------------------------------------ the runner contract

    @property
    def slot_limit(self) -> int:
        return self.total_slots

    @property
    def slot_kind(self) -> str:
        return self.layout.resource

    def now(self) -> float:
        return time.monotonic() - self.started_at

    def running_count(self) -> int:
        return len(self.running)

    def start(
        self, request_id: str, hparams: dict[str, Any], ds_config: dict[str, Any], length: int
    ) -> None:
        self.running[request_id] = self._place(request_id, hparams, length)

    def wait(self) -> TrialOutcome:
        while True:
            for trial in list(self.running.values()):
                outcome = self._advance(trial)
                if outcome is not None:
                    del self.running[trial.request_id]
                    return outcome
            time.sleep(POLL_SECONDS)

    def stop_all(self) -> list[StoppedRun]:
        """Stop every trial; what each wrote so far stays in ``logs/`` (where the disk still takes
        it: a full one must not keep the other trials running). A trial still being placed held
        no slot yet."""
        runs = []
        for trial in list(self.running.values()):
            self._stop(trial)
            if trial.start is not None:
                log = str(self._log_path(trial, 0))
                runs.append(StoppedRun(trial.request_id, trial.start, self.now(), log))
            with contextlib.suppress(OSError):
                self._collect_logs(trial)
            self._release(trial)
        self.running.clear()
        return runs

    def close(self) -> None:
        """Nothing is held between trials: each has its own placement group and actors."""

    def run_full_experiment(self, hparams: dict[str, Any], length: int | None = None) -> None:
        """Train once with ``hparams`` on the cluster, laid out as the trials were; the first
        node's output streams here and, with every node's, to ``logs/`` as it comes; what the run
        wrote in its copies on the nodes comes back to ``full-experiment/`` (as the local runner
        keeps its copy there), unless it was interrupted; where it cannot come back (a node's
        actor died, this disk is full, Ctrl-C while it comes), it stays on the nodes."""
        from ray.exceptions import OutOfMemoryError as RayOutOfMemoryError
        from ray.exceptions import RayActorError, RayTaskError

        for earlier in (self.results_dir / "logs").glob(f"{FULL_RUN_DIR}*.log"):
            earlier.unlink(missing_ok=True)  # an earlier run's, of more nodes perhaps
        trial = self._place(FULL_RUN_DIR, hparams, length, name=FULL_RUN_DIR)
        print(f"dsat: full experiment on the Ray cluster ({self.layout.describe()})", flush=True)
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")  # chunks split characters
        codes: list[int | None] | None = None
        ended, interrupted, failed_there = False, False, ""
        kept_on_nodes: list[str] = []
        try:
            while not self._launch_if_placed(trial):
                time.sleep(POLL_SECONDS)
            while True:
                codes = self._poll(trial)
                chunk = self._bring_log(trial, 0, trial.hosts[0], until_end=False)
                print(text.decode(chunk), end="", flush=True)
                self._stream_logs(trial, first_rank=1)
                # A node that failed ends the run (its peers would wait for it in the launcher's
                # exit barrier, or a collective, for minutes), as the first node's end does.
                if any(code not in (None, 0) for code in codes[1:]) or (
                    codes[0] is not None and not chunk
                ):
                    break
                if not chunk:
                    time.sleep(POLL_SECONDS)
            ended = True
        except RayActorError as err:  # a node left, or its actor died, while it started or ran
            codes, ended = None, True
            lost = ", ".join(self._lost_nodes(trial))
            failed_there = (
                f"its Ray node {lost} left the cluster"
                if lost
                else f"its Ray actor died on a node that is still up ({last_line(str(err))})"
            )
        except (RayTaskError, RayOutOfMemoryError) as err:  # a step failed there: its disk
            codes = None
            failed_there = f"a node failed to run it: {step_failure(err)}"
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:  # nothing of it stays on the cluster, unless its files could not come back
            self._stop(trial)
            self._stop_left_running(trial)
            try:
                self._collect_logs(trial, cap=False, clean=False)  # the user's training log
                if ended:
                    kept_on_nodes = self._bring_back(trial)
                elif interrupted:  # its checkpoints, hours of training perhaps, were removed
                    kept_on_nodes = list(trial.nodes)
                    print(
                        "dsat: the full run was interrupted, and what it wrote did not come "
                        f"back: {self._left_on_nodes(trial, kept_on_nodes)}",
                        flush=True,
                    )
            except KeyboardInterrupt:
                kept_on_nodes = list(trial.nodes)
                print(
                    "dsat: interrupted while what the full run wrote came back; "
                    f"{self._left_on_nodes(trial, kept_on_nodes)}",
                    flush=True,
                )
                raise
            finally:
                self._release(trial, keep=kept_on_nodes)
        # Judged by every node: a rank that failed on another node, its first node ending
        # cleanly, was a full run "finished".
        failed = [rank for rank, code in enumerate(codes or []) if code not in (None, 0)]
        rank = failed[0] if failed else 0
        log_path = shown(self._log_path(trial, rank))
        code = None if codes is None else codes[rank]
        if code != 0:
            on = f" on node {rank} of {len(trial.hosts)}" if rank else ""
            reason = f"ended: {failed_there}" if codes is None else f"exited with code {code}{on}"
            raise FullExperimentFailed(
                f"the full experiment with the best config {reason}; its log is {log_path}"
            )
        print(f"dsat: full experiment finished; its log is {log_path}")

    def _left_on_nodes(self, trial: RayTrial, nodes: list[str]) -> str:
        """Where what the full run wrote stays, on ``nodes``."""
        where = f"{NODE_ROOT}/{self.search_name}/{trial.name}-node<rank>"
        return (
            f"it stays on its Ray nodes {', '.join(nodes)}, in {where} under each one's "
            "temporary directory ($TMPDIR of its Ray processes, else /tmp; not Ray's "
            "--temp-dir): copy it off before the next --run-full-experiment of this search, "
            "which replaces it there"
        )

    def _bring_back(self, trial: RayTrial) -> list[str]:
        """Every node's copy of the full run into ``full-experiment/``, as one shared directory
        would hold it: the first node's files, then the files of the others that it lacks (the
        shards each rank wrote). Each file is written whole or not at all. A node gone loses its
        files, said in one line; where this machine's disk cannot take them, they stay on the
        nodes, and the node ids are returned (nothing is lost)."""
        from ray.exceptions import RayActorError

        directory = self.results_dir / FULL_RUN_DIR
        taken: set[str] = set()
        kept: list[str] = []
        for rank, host in enumerate(trial.hosts):
            try:
                found = self.ray.get(host.files.remote())
                new = [(name, size, mode) for name, size, mode in found if name not in taken]
                size_mb = sum(size for _, size, _ in new) / 2**20
                if size_mb >= COPY_NOTE_MB:
                    print(
                        f"dsat: bringing back what the full run wrote on node {rank} "
                        f"({size_mb:.0f} MB) to {shown(directory)}",
                        flush=True,
                    )
                for relative, size, mode in new:
                    self._copy_back(host, relative, size, mode, directory / relative)
                    taken.add(relative)
            except RayActorError:
                if trial.nodes[rank] in self._lost_nodes(trial):
                    print(f"dsat: node {rank} of the full run was lost with what it wrote there")
                else:  # its actor died; the node and the copy are still there
                    kept.append(trial.nodes[rank])
            except OSError as err:
                kept += list(trial.nodes[rank:])
                print(
                    f"dsat: what the full run wrote could not all come back to {shown(directory)} "
                    f"({err.strerror or err}); {self._left_on_nodes(trial, kept)}"
                )
                return kept
        if kept:
            print(
                f"dsat: what the full run wrote on a node whose Ray actor died could not come "
                f"back; {self._left_on_nodes(trial, kept)}"
            )
        if taken:
            print(f"dsat: what the full run wrote is in {shown(directory)}")
        return kept

    def _copy_back(self, host: Any, relative: str, size: int, mode: int, target: Path) -> None:
        """One file of a node's copy to ``target``, in chunks through the object store."""
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(f".{target.name}.dsat-part")
        try:
            with part.open("wb") as out:
                offset = 0
                while offset < size:
                    chunk = self.ray.get(host.read_file.remote(relative, offset, COPY_CHUNK))
                    if not chunk:
                        break  # shortened while read: what there is
                    out.write(chunk)
                    offset += len(chunk)
            os.chmod(part, mode)
            os.replace(part, target)
        finally:
            part.unlink(missing_ok=True)

    # ------------------------------------------------------------------ placing and launching

    def _place(
        self, request_id: str, hparams: dict[str, Any], length: int | None, name: str = ""
    ) -> RayTrial:
        """Ask for the trial's placement group; it starts once the group is ready."""
        from ray.util.placement_group import placement_group

        if not name:
            self._count += 1
            name = f"{self._count:03d}-{request_id[:8]}"
        group = placement_group(self.layout.bundles, strategy=self.layout.strategy)
        now = self.now()
        return RayTrial(
            request_id,
            name,
            hparams,
            length,
            group,
            group.ready(),
            asked=now,
            checked=now,
            result_watch=ResultWatch(self.linger_s),
        )

    def _check_placeable(self, trial: RayTrial) -> None:
        """While ``trial`` waits for room: say so once it has waited a while, and end the search
        in one line when the live cluster can no longer hold it (Ray would wait for ever)."""
        now = self.now()
        if now - trial.checked < self.placement_check_s:
            return
        trial.checked = now
        capacities = node_capacities(self.ray.nodes(), self.layout.resource)
        if not self.layout.fits(capacities):
            stopped = self.stop_all()
            have = ", ".join(str(c) for c in capacities) or "none"
            raise RunnerStopped(
                f"the Ray cluster can no longer place a trial: each takes {self.layout.describe()}"
                f", and its live nodes have {have} {self.layout.resource}(s) (a node left)",
                "add nodes",
                stopped,
            )
        if not trial.waiting_said and now - trial.asked > PLACEMENT_NOTE_S:
            trial.waiting_said = True
            logger.info(  # by its number, as the progress lines name it (not its folder)
                "trial %d waits for room on the Ray cluster (%s), %.0f s so far",
                trial_number(0, trial.name),
                self.layout.describe(),
                now - trial.asked,
            )

    def _launch_if_placed(self, trial: RayTrial) -> bool:
        """Start the trial's processes once its placement group is ready; True once started."""
        if trial.start is not None:
            return True
        ready, _ = self.ray.wait([trial.placed], timeout=0)
        if not ready:
            self._check_placeable(trial)
            return False
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        layout = self.layout
        per_node = float(layout.slots_per_node)
        resources = (
            {"num_gpus": per_node, "num_cpus": 0}
            if layout.resource == "GPU"
            else {"num_cpus": per_node}
        )
        for rank in range(layout.nodes):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=trial.group, placement_group_bundle_index=rank
            )
            trial.hosts.append(
                self._host_class.options(scheduling_strategy=strategy, **resources).remote(
                    self._node_directory(trial, rank)
                )
            )
        ray = self.ray
        files = {HPARAMS_FILE: json.dumps(trial.hparams, indent=1, sort_keys=True)}
        nodes = ray.get([host.node.remote() for host in trial.hosts])
        stale = [tuple(found[:2]) for found in nodes if len(found) != 3 or found[2] != protocol()]
        if stale:
            self.stop_all()
            named = ", ".join(f"{address} (node {node_id[:8]})" for node_id, address in stale)
            raise DsatError(
                f"the Ray cluster's node {named} runs another version of dsat than this machine; "
                f"{SAME_DSAT}"
            )
        directories = ray.get([host.prepare.remote(self.archive, files) for host in trial.hosts])
        trial.nodes = [node_id for node_id, *_ in nodes]
        note_shared_nodes(trial, self.running.values())
        master_addr = nodes[0][1] if layout.nodes > 1 else "127.0.0.1"
        ports = ray.get(trial.hosts[0].free_ports.remote(3))
        threads = self._threads()
        started = []
        for rank, host in enumerate(trial.hosts):
            command = self._command(rank, master_addr, ports[0])
            env = self._environment(Path(directories[rank]), master_addr, ports, trial)
            env["OMP_NUM_THREADS"] = str(threads.get(trial.nodes[rank], 1))
            started.append(host.start.remote(command, env))
        for rank, removed in enumerate(ray.get(started)):
            for lock in removed:
                logger.info(
                    "removed %s on the node of rank %d, left behind by an interrupted DeepSpeed "
                    "op build",
                    lock,
                    rank,
                )
        trial.start = self.now()
        return True

    def _command(self, rank: int, master_addr: str, master_port: int) -> list[str]:
        layout = self.layout
        return trial_command(
            self.entrypoint,
            layout.slots_per_node,
            master_port,
            layout.nodes,
            rank,
            master_addr,
            python=NODE_PYTHON,
        )

    def _environment(
        self, directory: Path, master_addr: str, ports: list[int], trial: RayTrial
    ) -> dict[str, str]:
        env = dict(self.environ)
        env[ENV_RESULTS_DIR] = str(self.results_dir)
        env[ENV_HPARAMS_FILE] = str(directory / HPARAMS_FILE)
        if trial.length is not None:
            env[ENV_TRIAL_LENGTH] = str(trial.length)
        layout = self.layout
        if layout.resource == "CPU":
            env["DS_ACCELERATOR"] = "cpu"
        processes = layout.nodes * layout.slots_per_node
        env.update(rendezvous_environment(processes, layout.nodes, ports, master_addr))
        return env

    def _threads(self) -> dict[str, int]:
        """OpenMP threads for each of a trial's processes (one per slot), by node id: a slot's
        share of its node's CPUs. Left to Ray, a trial would inherit the one thread Ray gives
        its actor (which reserves no CPU): 10% fewer samples/s on the CPU (benchmarks/README.md)."""
        threads = {}
        for node in self.ray.nodes():
            resources = node.get("Resources", {})
            cpus = float(resources.get("CPU", 1))
            slots = float(resources.get(self.layout.resource, 1)) or 1.0
            threads[node["NodeID"]] = max(1, int(cpus / slots))
        return threads

    # ------------------------------------------------------------------ waiting and finishing

    def _poll(self, trial: RayTrial) -> list[int | None]:
        """Each node's exit code (None: still running). An actor gone raises Ray's error, which
        says why (its node lost, Ray's memory monitor)."""
        codes: list[int | None] = self.ray.get([host.poll.remote() for host in trial.hosts])
        return codes

    def _advance(self, trial: RayTrial) -> TrialOutcome | None:
        """The trial's outcome if it has one now; it is launched once placed. An actor of the
        trial gone at any step means its node is gone; one that could not start there (dsat not
        installed on that node) ends the search in one line; a step that failed on a node (its
        disk full) is that node's fault, said in its own words."""
        from ray.exceptions import OutOfMemoryError as RayOutOfMemoryError
        from ray.exceptions import RayActorError, RayTaskError

        try:
            if not self._launch_if_placed(trial):
                return None
            ended = self._outcome_if_ended(trial, self._poll(trial))
            if ended is None:
                self._stream_logs(trial)
            return ended
        except (RayActorError, RayOutOfMemoryError) as err:
            if ran_out_of_host_memory(err):
                return self._host_memory_out(trial, err)
            assert isinstance(err, RayActorError)
            if err.actor_init_failed:
                self.stop_all()
                raise DsatError(
                    f"dsat cannot run on a node of the Ray cluster ({last_line(str(err))}); "
                    f"{SAME_DSAT}"
                ) from None
            return self._node_lost(trial, err)
        except RayTaskError as err:
            return self._node_failed(trial, err)

    def _host_memory_out(self, trial: RayTrial, err: Exception) -> TrialOutcome:
        """Ray's memory monitor stopped the trial's actor (and with it the trial) because its
        node ran low on host memory: out of memory, as the kernel's OOM killer is on the local
        runner, not a lost node."""
        said = last_line(str(err))
        metrics: dict[str, Any] = {MEMORY_RAN_OUT: "host"} if self.layout.resource != "CPU" else {}
        if not trial.shared:
            error = (
                f"out of host memory: Ray's memory monitor stopped the trial on its node ({said})"
            )
            return self._ended_by_ray(trial, TrialStatus.OOM, error, FailureCause.CONFIG, metrics)
        metrics[RUN_ALONE] = True  # as trial_outcome.classify says it of the local runner's
        error = (
            "the host's memory ran out while other trials shared its node: Ray's memory monitor "
            f"stopped it ({said})"
        )
        return self._ended_by_ray(trial, TrialStatus.ERROR, error, FailureCause.MACHINE, metrics)

    def _node_failed(self, trial: RayTrial, err: Exception) -> TrialOutcome:
        """A step of the trial's actor raised on its node: the machine's fault, not the
        config's; its other nodes are stopped and the search runs it again."""
        error = f"a node of this trial failed to run it: {step_failure(err)}"
        outcome = self._ended_by_ray(trial, TrialStatus.ERROR, error, FailureCause.MACHINE)
        # The step may have failed before the trial's processes wrote anything (unpacking the
        # model dir): the log the outcome names then holds what the node said, whole.
        with contextlib.suppress(OSError), self._log_path(trial, 0).open("a") as log:
            log.write(f"\ndsat: {error}\n{ANSI_ESCAPE.sub('', str(err))}\n")
        return outcome

    def _ended_by_ray(
        self,
        trial: RayTrial,
        status: TrialStatus,
        error: str,
        cause: FailureCause,
        metrics: dict[str, Any] | None = None,
    ) -> TrialOutcome:
        """The trial's end as Ray said it (not as its processes exited): what still runs of it
        is stopped, the logs that can be read come back, its actors and group go."""
        start = self.now() if trial.start is None else trial.start  # ended while it started
        self._stop(trial)
        with contextlib.suppress(OSError):
            self._collect_logs(trial)
        self._release(trial)
        return TrialOutcome(
            trial.request_id,
            status,
            metrics or {},
            error,
            start,
            self.now(),
            cause,
            str(self._log_path(trial, 0)),
        )

    def _outcome_if_ended(self, trial: RayTrial, codes: list[int | None]) -> TrialOutcome | None:
        assert trial.start is not None
        now = self.now()
        if all(code is not None for code in codes):
            return self._finish(trial, timed_out=False)
        lingered = trial.result_watch.lingered(
            now, lambda: bool(self.ray.get(trial.hosts[0].reported.remote()))
        )
        if now - trial.start > self.timeout.seconds or lingered is not None:
            self._stop(trial)
            return self._finish(trial, timed_out=True, lingered=lingered)
        if any(code is not None for code in codes):
            if trial.first_exit is None:
                trial.first_exit = now
            failed = any(code not in (None, 0) for code in codes)
            if failed or now - trial.first_exit > OTHER_NODES_GRACE_S:
                trial.ended_first = [rank for rank, code in enumerate(codes) if code is not None]
                self._stop(trial)
                return self._finish(trial, timed_out=False)
        return None

    def _finish(
        self, trial: RayTrial, timed_out: bool, lingered: float | None = None
    ) -> TrialOutcome:
        """Read each node's outcome, keep its log and files. The trial's outcome is the first
        node's, unless dsat stopped that node after another ended by itself: then the first of
        those that failed (a rank that fails leaves the others waiting, and the one dsat stopped
        would read as killed from outside). Out of memory on any rank overrides an error."""
        assert trial.start is not None
        results = self.ray.get(
            [
                host.outcome.remote(
                    timed_out,
                    self.timeout.seconds,
                    lingered if rank == 0 else None,
                    len(trial.hosts) == 1,
                    self.layout.resource != "CPU",
                    trial.shared,
                )
                for rank, host in enumerate(trial.hosts)
            ]
        )
        self._collect_logs(trial)
        self._keep_files(trial)
        self._release(trial)
        rank = speaking_rank(results, trial.ended_first)
        first = results[rank]
        oom = next(
            (
                r
                for i, r in enumerate(results)
                if i != rank and r["status"] == TrialStatus.OOM.value
            ),
            None,
        )
        if first["status"] == TrialStatus.ERROR.value and oom is not None:
            first = oom
        status = TrialStatus(first["status"])
        cause = None if first["cause"] is None else FailureCause(first["cause"])
        error = first["error"]
        if status is TrialStatus.TIMEOUT and error and len(trial.hosts) > 1:
            # A hang is often another node's (its rank stuck, node 0 waiting on it in a
            # collective): every node's log, not node 0's waiting alone.
            others = ", ".join(
                f"node {i}: {shown(self._log_path(trial, i))}"
                for i in range(len(trial.hosts))
                if i != rank
            )
            head, _, tail = error.partition("\n")
            error = f"{head} (the other nodes' logs: {others})\n{tail}"
        end = self.now()
        metrics = dict(first["metrics"])
        if status is TrialStatus.COMPLETED:  # the first to complete is the model-profile trial
            self.timeout.profile_finished(end - trial.start)
            if lingered is not None:
                metrics[LINGERED_KEY] = round(lingered)
        return TrialOutcome(
            trial.request_id,
            status,
            metrics,
            error,
            trial.start,
            end,
            cause,
            str(self._log_path(trial, rank)),
        )

    def _node_lost(self, trial: RayTrial, err: Exception) -> TrialOutcome:
        """An actor of the trial is gone (``err``): its node left the cluster, or it died with
        its node still up (``_lost_nodes_after``). Its other ranks are stopped; the trial is the
        machine's error."""
        lost = ", ".join(self._lost_nodes_after(trial, err))
        others = "; its other nodes' processes were stopped" if len(trial.nodes) > 1 else ""
        if lost:
            error = f"node lost: Ray node {lost} of this trial left the cluster while it ran"
        else:
            error = "the trial's Ray actor died on a node that is still up"
        # Ray's own words (why: a kill, its memory monitor) on the lines after the reason: in
        # it, a terminal line cut them off mid-word, and its bracket with them.
        said = str(err).strip()
        return self._ended_by_ray(
            trial,
            TrialStatus.ERROR,
            f"{error}{others}" + (f"\nRay: {said}" if said else ""),
            FailureCause.MACHINE,
        )

    def _lost_nodes_after(self, trial: RayTrial, err: Exception) -> list[str]:
        """The trial's nodes gone, where an actor of it is (``err``). One that cannot be reached
        may be on a node that has just died, which Ray marks dead only once it missed its health
        checks: that long is waited for."""
        from ray.exceptions import ActorUnavailableError

        lost = self._lost_nodes(trial)
        deadline = time.monotonic() + NODE_DEATH_WAIT_S
        while not lost and isinstance(err, ActorUnavailableError) and time.monotonic() < deadline:
            time.sleep(1.0)
            lost = self._lost_nodes(trial)
        return lost

    def _lost_nodes(self, trial: RayTrial) -> list[str]:
        alive = {node["NodeID"] for node in self.ray.nodes() if node["Alive"]}
        return [node for node in trial.nodes if node not in alive]

    def _ask_each_node(
        self, trial: RayTrial, method: str, skip: Collection[int] = ()
    ) -> dict[int, Any]:
        """What ``method`` of the trial's host on each node still there answers, by the node's
        rank (those in ``skip`` not asked): a node gone took its processes and copies with it
        (trial_guard), so there is nothing left there to stop or remove."""
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        answers: dict[int, Any] = {}
        for rank, host in enumerate(trial.hosts):
            if rank not in skip:
                try:
                    answers[rank] = self.ray.get(
                        getattr(host, method).remote(), timeout=STOP_WAIT_S
                    )
                except (RayActorError, GetTimeoutError, RayTaskError):
                    continue  # gone, or it failed there (its disk): nothing more to ask of it
        return answers

    def _stop(self, trial: RayTrial) -> None:
        """Stop the trial's process group on every node still there (SIGTERM, then SIGKILL)."""
        self._ask_each_node(trial, "stop")

    def _stop_left_running(self, trial: RayTrial) -> None:
        """Stop, on every node still there, what the full run left running (a daemon in a
        session of its own outlives its process group), and say what it was."""
        answers = self._ask_each_node(trial, "stop_left_running")
        strays = [f"{name} on node {rank}" for rank, names in answers.items() for name in names]
        note = strays_note(strays, "the full experiment")
        if note:
            print(note)

    def _release(self, trial: RayTrial, keep: list[str] | None = None) -> None:
        """Remove the trial's copies (but those on the nodes ``keep`` names), actors and
        placement group."""
        from ray.util.placement_group import remove_placement_group

        kept = [rank for rank, node in enumerate(trial.nodes) if keep and node in keep]
        self._ask_each_node(trial, "clean", skip=kept)
        for host in trial.hosts:
            self.ray.kill(host)
        remove_placement_group(trial.group)

    # ------------------------------------------------------------------ what comes back

    def _node_directory(self, trial: RayTrial, rank: int) -> str:
        """The trial's copy on its ``rank``-th node, under the node's NODE_ROOT."""
        return f"{self.search_name}/{trial.name}-node{rank}"

    def _log_path(self, trial: RayTrial, rank: int) -> Path:
        suffix = "" if rank == 0 else f"-node{rank}"
        return self.results_dir / "logs" / f"{trial.name}{suffix}.log"

    def _stream_logs(self, trial: RayTrial, first_rank: int = 0) -> None:
        """What each node's log (from ``first_rank``) gained since the last time, into
        ``logs/``, every ``LOG_STREAM_S``: a node that is lost takes only the rest with it, and
        a user can follow a trial there."""
        from ray.exceptions import GetTimeoutError, RayActorError

        now = self.now()
        if now - trial.logs_read < LOG_STREAM_S:
            return
        trial.logs_read = now
        for rank, host in enumerate(trial.hosts):
            if rank >= first_rank:
                with contextlib.suppress(RayActorError, GetTimeoutError, OSError):
                    self._bring_log(trial, rank, host, until_end=False)

    def _bring_log(self, trial: RayTrial, rank: int, host: Any, until_end: bool) -> bytes:
        """Node ``rank``'s log from where ``logs/`` has it, there too: up to ``LOG_STREAM_CHUNKS``
        chunks, or ``until_end``; returns what came."""
        while len(trial.log_here) <= rank:
            trial.log_here.append(0)
        path = self._log_path(trial, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        came = b""
        with path.open("ab" if trial.log_here[rank] else "wb") as log:
            for _ in itertools.count() if until_end else range(LOG_STREAM_CHUNKS):
                chunk = self.ray.get(
                    host.read_log.remote(trial.log_here[rank], LOG_CHUNK), timeout=STOP_WAIT_S
                )
                log.write(chunk)
                trial.log_here[rank] += len(chunk)
                came += chunk
                if not chunk:
                    break
        return came

    def _collect_logs(self, trial: RayTrial, cap: bool = True, clean: bool = True) -> None:
        """Each reachable node's log into ``logs/`` (the first node's under the trial's name),
        to its end, cut where it is too long (``cap_log``; not the full run's, ``cap``). Where a
        node's actor died, a task on the node reads it (and, ``clean``, removes the copy)."""
        from ray.exceptions import GetTimeoutError, RayActorError

        for rank, host in enumerate(trial.hosts):
            try:
                self._bring_log(trial, rank, host, until_end=True)
            except (RayActorError, GetTimeoutError):
                here = trial.log_here[rank] if rank < len(trial.log_here) else 0
                rest = self._left_behind_log(trial, rank, here, clean)
                with self._log_path(trial, rank).open("ab" if here else "wb") as log:
                    log.write(rest if rest is not None else lost_note(here))
            if cap:
                cap_log(self._log_path(trial, rank))

    def clear_earlier_copies(self, node_ids: list[str]) -> None:
        """What an earlier run of this search left on ``node_ids`` removed (``clear_earlier_copies``
        on each); a node that does not answer in time keeps it, and the search goes on."""
        from ray.exceptions import GetTimeoutError, RayError
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        clear = self.ray.remote(clear_earlier_copies)
        cleared = [
            clear.options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(self.search_name)
            for node in node_ids
        ]
        with contextlib.suppress(RayError, GetTimeoutError):
            self.ray.get(cleared, timeout=STOP_WAIT_S)

    def _left_behind_log(
        self, trial: RayTrial, rank: int, offset: int, clean: bool = True
    ) -> bytes | None:
        """The rest of a node's log, read by a task on that node, where its actor died but the
        node is still there (the task also removes the trial's copy, which the actor would have);
        None where the node is gone too."""
        from ray.exceptions import GetTimeoutError, RayError
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if rank >= len(trial.nodes) or trial.nodes[rank] in self._lost_nodes(trial):
            return None
        read = self.ray.remote(left_behind_log).options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(trial.nodes[rank], soft=False),
        )
        try:
            found: bytes = self.ray.get(
                read.remote(self._node_directory(trial, rank), offset, clean),
                timeout=STOP_WAIT_S,
            )
        except (RayError, GetTimeoutError):
            return None
        return found

    def _keep_files(self, trial: RayTrial) -> None:
        """The first node's result files into ``trials/<name>/``, as the local runner keeps them."""
        if not trial.hosts:
            return
        found = self.ray.get(trial.hosts[0].read_files.remote(KEPT_FILES))
        directory = self.results_dir / "trials" / trial.name
        directory.mkdir(parents=True, exist_ok=True)
        for name, (text, mtime) in found.items():
            write_text_atomic(directory / name, text)
            os.utime(directory / name, (mtime, mtime))
