"""The Ray runner checked against the experiment, then opened on the cluster.

``prepare`` finds every user mistake it can without a cluster (Ray not installed, an entrypoint
that is no command); ``open`` connects (``--ray-address``, else ``RAY_ADDRESS``, else a Ray
instance started on this machine), checks that the cluster can place one trial, and sends the
model dir to the object store once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from dsat.constants import ENV_RAY_ADDRESS
from dsat.errors import USAGE_EXIT_CODE, DsatError
from dsat.experiment.config import Experiment
from dsat.experiment.settings import SearchSettings
from dsat.runners.local.entrypoint import entrypoint_tokens, require_command
from dsat.runners.local.trial_timeout import TrialTimeout
from dsat.runners.ray.model_archive import model_archive
from dsat.runners.ray.placement import node_capacities, slot_resource, trial_layout
from dsat.runners.ray.runner import RayRunner

INSTALL_HINT = (
    "--runner ray needs Ray on this machine and the cluster's: pip install 'ray>=2.9' "
    "(or reinstall dsat from its clone with the extra: pip install -e '/path/to/dsat[ray]')"
)
# What dsat's own environment passes on to every trial (DeepSpeed's accelerator choice: `cpu`
# runs trials on CPUs, as the tests do).
FORWARDED_VARIABLES = ("DS_ACCELERATOR",)
CONNECT_TIMEOUT_S = 5.0
ARCHIVE_WARNING_BYTES = 200 * 2**20
# In logs/: what the cluster's raylets reported to the driver (keep_cluster_reports_in).
CLUSTER_REPORTS_LOG = "ray-cluster.log"
# An address that answers but is not a Ray head's GCS (the dashboard's 8265, the client's 10001)
# keeps ray.init retrying for minutes, saying only that the GCS did not answer.
CONNECT_NOTE_S = 20.0
# After this long, dsat gives up on it: ray.init cannot be interrupted from Python.
CONNECT_DEADLINE_S = 90.0
NOT_THE_GCS = (
    "give the head node's GCS address, which `ray start --head` prints (port 6379 by default, "
    "not the dashboard's 8265 nor the client's 10001, which needs ray://)"
)


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise DsatError(INSTALL_HINT) from None
    return ray


def host_and_port(address: str) -> tuple[str, int] | None:
    """A ``host:port`` address split (None for Ray Client's ``ray://``, ``auto`` and the like,
    which are left to Ray)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return None
    return host, int(port)


def reachable(address: str) -> bool:
    """Whether something listens at a ``host:port`` address (anything else: left to Ray)."""
    split = host_and_port(address)
    if split is None:
        return True
    try:
        with socket.create_connection(split, timeout=CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


# An HTTP/2 client's first bytes: the preface, then an empty SETTINGS frame (a 9-byte header:
# length 0, type 4, no flags, stream 0). A Ray head's GCS, a gRPC server, answers with a
# SETTINGS frame of its own; the dashboard (8265) or any web server answers in HTTP/1.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(3) + b"\x04" + bytes(5)
HTTP2_SETTINGS = 4
FRAME_HEADER_BYTES = 9


# How a web server's answer starts: a status line, or (http.server's to a request it cannot
# parse) an HTML page.
WEB_ANSWERS = (b"HTTP/", b"<")


def answers_http2(address: str) -> bool | None:
    """Whether what listens at a ``host:port`` address answers an HTTP/2 client as a GCS does:
    False only where a web server answers (the dashboard); None where it cannot be told (no
    answer in time, a closed connection, TLS, an address that is no ``host:port``), which
    ``ray.init`` and ``connect_deadline`` are left to judge. ``ray.init`` against an address
    that accepts connections but is no GCS retries for minutes."""
    split = host_and_port(address)
    if split is None:
        return None
    answer = b""
    with contextlib.suppress(OSError):  # a timeout, a reset: what came so far is judged
        with socket.create_connection(split, timeout=CONNECT_TIMEOUT_S) as connection:
            connection.sendall(HTTP2_PREFACE)
            while len(answer) < FRAME_HEADER_BYTES:
                chunk = connection.recv(FRAME_HEADER_BYTES - len(answer))
                if not chunk:
                    break
                answer += chunk
    if len(answer) == FRAME_HEADER_BYTES and answer[3] == HTTP2_SETTINGS:
        return True
    return False if answer.startswith(WEB_ANSWERS) else None


def check_address(address: str) -> None:
    """A DsatError where nothing listens at ``address``, or something that is no Ray head."""
    if address.lower().startswith(("http://", "https://")):
        # Ray's own refusal ends "To fix this, either:", its fixes on the lines below.
        raise DsatError(
            f"{address} (--ray-address or {ENV_RAY_ADDRESS}) is a web address, as the "
            f"dashboard's and the Jobs API's are: {NOT_THE_GCS}"
        )
    if not reachable(address):
        raise DsatError(
            f"no Ray cluster answers at {address} (--ray-address or {ENV_RAY_ADDRESS}); start "
            "one with `ray start --head` there, or fix the address"
        )
    if answers_http2(address) is False:
        raise DsatError(
            f"something answers at {address} (--ray-address or {ENV_RAY_ADDRESS}), but not as a "
            f"Ray head does: {NOT_THE_GCS}"
        )


@dataclasses.dataclass(frozen=True)
class RaySetup:
    settings: SearchSettings
    experiment: Experiment
    entrypoint: tuple[str, ...]
    address: str | None
    environ: dict[str, str]

    @classmethod
    def prepare(
        cls, settings: SearchSettings, experiment: Experiment, environ: Mapping[str, str]
    ) -> RaySetup:
        import_ray()
        config_path = str(experiment.config_path)
        entrypoint = tuple(entrypoint_tokens(experiment.config.get("entrypoint"), config_path))
        require_command(entrypoint, config_path)
        address = settings.ray_address or environ.get(ENV_RAY_ADDRESS) or None
        forwarded = {k: environ[k] for k in FORWARDED_VARIABLES if k in environ}
        return cls(settings, experiment, entrypoint, address, forwarded)

    def connect(self) -> Any:
        ray = import_ray()
        address = self.address
        if address is not None:
            check_address(address)
        if not ray.is_initialized():
            stopping = signal.getsignal(signal.SIGTERM)
            try:
                with slow_connect_note(address), connect_deadline(address):
                    ray.init(
                        # "local": a new instance, as dsat says; None would join any cluster
                        # already running on this machine (ray start's), unsaid and unsaved.
                        address=address or "local",
                        logging_level=logging.ERROR,
                        log_to_driver=False,
                        **({} if address else {"include_dashboard": False}),
                    )
            except (ConnectionError, RuntimeError, ValueError) as err:
                # All of Ray's message on one line: its first alone can end mid-sentence.
                said = " ".join(str(err).split()) or type(err).__name__
                raise DsatError(f"cannot connect to the Ray cluster at {address}: {said}") from None
            keep_sigterm(stopping)
        return ray

    def open(self, results_dir: Path) -> RayRunner:
        ray = self.connect()
        timeout = TrialTimeout(self.settings.trial_timeout)
        if self.settings.resume is not None:
            timeout.resume_from(results_dir)
        experiment = self.experiment
        runner = open_runner(
            ray,
            list(self.entrypoint),
            experiment.model_dir,
            experiment.includes,
            results_dir,
            experiment.slots_per_trial,
            timeout,
            dict(self.environ),
            self.address or "a Ray instance started on this machine",
            resumed=self.settings.resume is not None,
        )
        print(f"dsat: {timeout.describe()}")
        keep_cluster_reports_in(results_dir / "logs" / CLUSTER_REPORTS_LOG)
        return runner


@contextlib.contextmanager
def unless_done_within(seconds: float, action: Callable[[], None], armed: bool) -> Iterator[None]:
    """Run ``action`` (in a thread) if the block has not ended within ``seconds``; ``armed``:
    whether to watch at all."""
    timer = threading.Timer(seconds, action)
    timer.daemon = True
    if armed:
        timer.start()
    try:
        yield
    finally:
        timer.cancel()


@contextlib.contextmanager
def slow_connect_note(address: str | None, after: float = CONNECT_NOTE_S) -> Iterator[None]:
    """Say what is likely wrong when connecting takes longer than ``after`` seconds."""

    def note() -> None:
        print(
            f"dsat: still connecting to the Ray cluster at {address} after {after:.0f} s: is it "
            "the head node's GCS address, which `ray start --head` prints (port 6379 by "
            f"default, not the dashboard's 8265 nor the client's 10001)? Ctrl-C stops; dsat gives "
            f"up after {CONNECT_DEADLINE_S:.0f} s",
            flush=True,
        )

    with unless_done_within(after, note, address is not None):
        yield


@contextlib.contextmanager
def connect_deadline(address: str | None, after: float = CONNECT_DEADLINE_S) -> Iterator[None]:
    """End dsat with the usage error's line and status when connecting to ``address`` has not
    ended after ``after`` seconds: nothing of the search has started, so nothing is lost."""

    def give_up() -> None:
        print(
            f"dsat: error: no Ray cluster answered at {address} within {after:.0f} s "
            f"(--ray-address or {ENV_RAY_ADDRESS}): {NOT_THE_GCS}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(USAGE_EXIT_CODE)

    with unless_done_within(after, give_up, address is not None):
        yield


def keep_sigterm(handler: Any) -> None:
    """Put back the SIGTERM handler ``ray.init`` replaced: it installs one that exits the driver
    at once (after a stack dump of Ray's core worker), so a SIGTERM (``kill``, a job scheduler,
    ``timeout``) ended dsat with 15 and no word on how to resume, where the CLI's handler stops
    the search as Ctrl-C does."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        return  # a handler set outside Python, or none to set from here
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGTERM, handler)


def open_runner(
    ray: Any,
    entrypoint: list[str],
    model_dir: Path,
    includes: tuple[Path, ...],
    results_dir: Path,
    slots_per_trial: int,
    timeout: TrialTimeout,
    environ: dict[str, str],
    where: str,
    resumed: bool = False,
) -> RayRunner:
    """A runner on the cluster ``ray`` is connected to: the trial's layout chosen from its live
    nodes (a DsatError when no layout fits), the model dir sent to the object store once."""
    nodes = [node for node in ray.nodes() if node["Alive"]]
    resource = slot_resource(nodes)
    capacities = node_capacities(nodes, resource)
    layout = trial_layout(slots_per_trial, capacities, resource, resumed)
    total = sum(c // layout.slots_per_node * layout.slots_per_node for c in capacities)
    print(
        f"dsat: Ray cluster ({where}): {len(nodes)} node(s), {sum(capacities)} {resource}(s); "
        f"each trial takes {layout.describe()}"
    )
    archive = model_archive(model_dir, includes, results_dir.resolve())
    if len(archive) > ARCHIVE_WARNING_BYTES:
        print(
            f"dsat: MODEL_DIR and its includes weigh {len(archive) / 2**20:.0f} MB zipped, sent "
            "to every node of every trial; keep data outside MODEL_DIR"
        )
    search_name = node_search_name(results_dir)
    runner = RayRunner(
        ray,
        entrypoint,
        ray.put(archive),
        layout,
        total,
        results_dir,
        search_name,
        timeout,
        environ,
    )
    runner.clear_earlier_copies([node["NodeID"] for node in nodes])
    return runner


def keep_cluster_reports_in(path: Path) -> None:
    """What the cluster's raylets report to the driver (a node dying: some 45 lines of its state)
    goes to ``path``, not between dsat's lines on the terminal, where Ray's error listener prints
    it whatever ``log_to_driver`` says; dsat says itself what a lost node means for the search.
    Ray's printing function is a private one: where it is not there, Ray prints as before."""
    import ray._private.worker as ray_worker

    printing = getattr(ray_worker, "print_to_stdstream", None)
    printing = getattr(printing, "ray_prints", printing)  # a later search's: its own file
    if printing is None:
        return

    def keep(data: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(data, dict) or data.get("pid") != "raylet":
            return printing(data, *args, **kwargs)
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8", errors="replace") as log:
                log.writelines(f"{line}\n" for line in data.get("lines", []))
        return None

    keep.ray_prints = printing  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = keep


def node_search_name(results_dir: Path) -> str:
    """The directory of a search's trial copies on every node (under NODE_ROOT), named after
    its results directory: a resumed search's trials find their earlier copies."""
    return hashlib.sha256(str(results_dir.resolve()).encode()).hexdigest()[:12]
