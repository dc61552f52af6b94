"""A fake Determined master: the HTTP calls dsat's Determined runner makes, served in-process.

No Determined master can run on these machines, so the cluster path is tested at the client
boundary: Determined's own client code (``determined.experimental.client``, the API bindings,
``RemoteSearchRunner``, the Core API checkpoint context) talks HTTP, and ``responses`` answers as a
0.37 master would. Replies are built with Determined's own binding classes, so a shape the client
cannot parse fails here as it would against a real master.

Trials do not train: ``outcome(hparams)`` scripts each trial's result (a metrics dict, or an
exception for a trial that errors). A trial that raises an out-of-memory error reports it first
through dsat's own ``report_out_of_memory``, and any other error through ``report_error``, as
``dsat_reporting_context`` does in a real trial (``FailedOutsideReporting``: one raised outside it).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import tarfile
import types
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlparse

import responses
from determined.common.api import bindings

from dsat.training.oom import is_out_of_memory
from dsat.training.reporting import report_error, report_out_of_memory, searcher_metric

MASTER = "http://fake-master:8080"
TOKEN = "fake-token"
Outcome = Callable[[dict[str, Any]], dict[str, Any]]


class FailedOutsideReporting(Exception):
    """A trial's failure before or outside ``dsat_reporting_context`` (an import, the engine's
    set-up): the master says only 'errored' of it."""


class MasterGone(ConnectionError):
    """Raised into the search runner to stand for its container dying mid-search."""


@dataclasses.dataclass
class CreatedExperiment:
    id: int
    config_text: str
    files: dict[str, bytes]  # path in the uploaded context -> content

    @property
    def config(self) -> Any:
        import yaml

        return yaml.safe_load(self.config_text)


class FakeMaster:
    def __init__(self, outcome: Outcome | None = None, version: str = "0.37.0") -> None:
        self.outcome = outcome
        self.version = version
        self.experiments: list[CreatedExperiment] = []
        self.events: list[bindings.v1SearcherEvent] = []
        self.next_event_id = 1
        self.trial_hparams: dict[str, dict[str, Any]] = {}
        self.created_order: list[str] = []
        self.checkpoints: list[str] = []
        self.posts = 0
        self.crash_at_post: int | None = None  # the post that "kills" the search runner
        self.progress: list[float] = []
        self.final_state: bindings.experimentv1State | None = None
        self.cancel_after_trials: int | None = None  # a user kills the trials' experiment
        self.stopped_trial: int | None = None  # a user stops this trial (1 the first run)
        self.refuse_create: tuple[int, str] | None = None  # (HTTP status, the master's error)
        self.refuse_from = 0  # refuse_create applies once this many experiments were created
        self.trials_run = 0
        # The first checkpoint report once this many experiments exist answers 503 (storage
        # down for a moment): the search runner fails and Determined restarts it.
        self.checkpoint_fails_from: int | None = None

    # ------------------------------------------------------------------ wiring

    def install(self, mock: responses.RequestsMock) -> None:
        mock.add_callback(responses.GET, f"{MASTER}/api/v1/master", callback=self._get_master)
        mock.add_callback(
            responses.GET,
            re.compile(rf"{MASTER}/api/v1/experiments(\?.*)?$"),
            callback=self._list_experiments,
        )
        mock.add_callback(
            responses.POST, f"{MASTER}/api/v1/experiments", callback=self._create_experiment
        )
        mock.add_callback(
            responses.GET,
            re.compile(rf"{MASTER}/api/v1/experiments/\d+/searcher_events"),
            callback=self._get_events,
        )
        mock.add_callback(
            responses.POST,
            re.compile(rf"{MASTER}/api/v1/experiments/\d+/searcher_operations"),
            callback=self._post_operations,
        )
        mock.add_callback(
            responses.POST, f"{MASTER}/api/v1/checkpoints", callback=self._report_checkpoint
        )

    @staticmethod
    def _reply(body: Any) -> tuple[int, dict[str, str], str]:
        return 200, {"Content-Type": "application/json"}, json.dumps(body)

    # ------------------------------------------------------------------ endpoints

    def _get_master(self, request: Any) -> tuple[int, dict[str, str], str]:
        reply = bindings.v1GetMasterResponse(
            clusterId="fake-cluster",
            clusterName="fake",
            hasCustomLogo=False,
            masterId="fake-master",
            strictJobQueueControl=False,
            version=self.version,
        )
        return self._reply(reply.to_json())

    def _create_experiment(self, request: Any) -> tuple[int, dict[str, str], str]:
        if self.refuse_create is not None and len(self.experiments) >= self.refuse_from:
            status, message = self.refuse_create
            body = {"code": 7, "message": message, "details": []}
            return status, {"Content-Type": "application/json"}, json.dumps(body)
        body = bindings.v1CreateExperimentRequest.from_json(json.loads(request.body))
        files = {
            f.path: base64.b64decode(f.content)
            for f in body.modelDefinition or []
            if f.type == ord(tarfile.REGTYPE)
        }
        experiment_id = 100 + len(self.experiments)
        created = CreatedExperiment(experiment_id, body.config or "", files)
        self.experiments.append(created)
        if created.config.get("searcher", {}).get("name") == "custom":
            self._event(initialOperations=bindings.v1InitialOperations())
        reply = bindings.v1CreateExperimentResponse(
            config=created.config, experiment=self._binding(created)
        )
        return self._reply(reply.to_json())

    @staticmethod
    def _binding(created: CreatedExperiment) -> bindings.v1Experiment:
        return bindings.v1Experiment(
            archived=False,
            config=created.config,
            id=created.id,
            jobId="job",
            labels=list(created.config.get("labels") or []),
            name=str(created.config.get("name", "experiment")),
            numTrials=0,
            originalConfig=created.config_text,
            projectId=1,
            projectOwnerId=1,
            searcherType=str(created.config.get("searcher", {}).get("name", "single")),
            startTime="2026-11-22T00:00:00Z",
            state=bindings.experimentv1State.ACTIVE,
            username="determined",
        )

    def _list_experiments(self, request: Any) -> tuple[int, dict[str, str], str]:
        """GetExperiments, filtered by label as the master filters it (any of them)."""
        labels = set(parse_qs(urlparse(request.url).query).get("labels", []))
        found = [
            self._binding(e)
            for e in self.experiments
            if not labels or labels & set(e.config.get("labels") or [])
        ]
        reply = bindings.v1GetExperimentsResponse(
            experiments=found,
            pagination=bindings.v1Pagination(endIndex=len(found), total=len(found)),
        )
        return self._reply(reply.to_json())

    def _get_events(self, request: Any) -> tuple[int, dict[str, str], str]:
        reply = bindings.v1GetSearcherEventsResponse(searcherEvents=list(self.events))
        return self._reply(reply.to_json())

    def _post_operations(self, request: Any) -> tuple[int, dict[str, str], str]:
        self.posts += 1
        if self.crash_at_post is not None and self.posts == self.crash_at_post:
            self.crash_at_post = None
            raise MasterGone("the search runner's container died")
        body = bindings.v1PostSearcherOperationsRequest.from_json(json.loads(request.body))
        trigger = body.triggeredByEvent
        if trigger is not None:  # acknowledged: the master drops it and everything before it
            self.events = [e for e in self.events if e.id > trigger.id]
        for op in body.searcherOperations or []:
            self._apply(op)
        return self._reply({})

    def _report_checkpoint(self, request: Any) -> tuple[int, dict[str, str], str]:
        if self.checkpoint_fails_from is not None and len(self.experiments) >= (
            self.checkpoint_fails_from
        ):
            self.checkpoint_fails_from = None
            body = {"code": 14, "message": "storage unavailable", "details": []}
            return 503, {"Content-Type": "application/json"}, json.dumps(body)
        body = json.loads(request.body)
        self.checkpoints.append(body["uuid"])
        return self._reply({})

    # ------------------------------------------------------------------ the experiment

    def _event(self, **kind: Any) -> None:
        self.events.append(bindings.v1SearcherEvent(id=self.next_event_id, **kind))
        self.next_event_id += 1

    def _exited_early(self, request_id: str, reason: str) -> None:
        """The master's events of a trial that ended without its validation, then closed: the
        master closes such a trial itself and says so, as for any other."""
        exited = getattr(bindings.v1TrialExitedEarlyExitedReason, reason)
        self._event(
            trialExitedEarly=bindings.v1TrialExitedEarly(exitedReason=exited, requestId=request_id)
        )
        self._event(trialClosed=bindings.v1TrialClosed(requestId=request_id))

    def _apply(self, op: bindings.v1SearcherOperation) -> None:
        if op.createTrial is not None:
            request_id = op.createTrial.requestId
            assert request_id not in self.trial_hparams, f"trial {request_id} created twice"
            self.trial_hparams[request_id] = json.loads(op.createTrial.hyperparams or "{}")
            self.created_order.append(request_id)
            self._event(trialCreated=bindings.v1TrialCreated(requestId=request_id))
        elif op.trialOperation is not None and op.trialOperation.validateAfter is not None:
            validate = op.trialOperation.validateAfter
            self._run_trial(validate.requestId, validate.length)
        elif op.closeTrial is not None:
            self._event(trialClosed=bindings.v1TrialClosed(requestId=op.closeTrial.requestId))
        elif op.setSearcherProgress is not None:
            self.progress.append(float(op.setSearcherProgress.progress or 0.0))
        elif op.shutDown is not None:
            failed = bool(op.shutDown.failure)
            self.final_state = (
                bindings.experimentv1State.ERROR if failed else bindings.experimentv1State.COMPLETED
            )
            self._event(
                experimentInactive=bindings.v1ExperimentInactive(experimentState=self.final_state)
            )

    def _run_trial(self, request_id: str, length: str) -> None:
        assert self.outcome is not None, "this fake master was given no trial outcomes"
        self.trials_run += 1
        if self.cancel_after_trials is not None and self.trials_run > self.cancel_after_trials:
            if self.final_state is None:  # the master's event for the user's kill, once
                self.final_state = bindings.experimentv1State.CANCELED
                self._event(
                    experimentInactive=bindings.v1ExperimentInactive(
                        experimentState=self.final_state
                    )
                )
            return
        if self.trials_run == self.stopped_trial:  # from the web UI: the master says why
            self._exited_early(request_id, "USER_REQUESTED_STOP")
            return
        try:
            metrics = self.outcome(self.trial_hparams[request_id])
        except Exception as err:
            op = ReportingOperation()
            if is_out_of_memory(err):
                report_out_of_memory(CHIEF, op, err)
            elif not isinstance(err, FailedOutsideReporting):
                report_error(CHIEF, op, err)
            if op.reported is not None:
                self._event(
                    validationCompleted=bindings.v1ValidationCompleted(
                        metric=op.reported, requestId=request_id, validateAfterLength=length
                    )
                )
            self._exited_early(request_id, "UNSPECIFIED")
            return
        if isinstance(metrics, dict):  # as the trial's dsat_reporting_context reports it
            metrics = searcher_metric(metrics)
        self._event(
            validationCompleted=bindings.v1ValidationCompleted(
                metric=metrics, requestId=request_id, validateAfterLength=length
            )
        )


# The chief's view of a trial's Core API context, for the reports a trial makes itself.
CHIEF = types.SimpleNamespace(
    distributed=types.SimpleNamespace(get_rank=lambda: 0, get_size=lambda: 1)
)


class ReportingOperation:
    """A trial's searcher operation: keeps what the trial reports."""

    def __init__(self) -> None:
        self.reported: Any = None

    def report_completed(self, metric: Any) -> None:
        self.reported = metric


def trial_cluster_info(
    experiment_id: int, hparams: dict[str, Any] | None = None, latest_checkpoint: str | None = None
) -> Any:
    """The ClusterInfo a Determined trial container holds (the master writes it to a file)."""
    import determined as det

    return det.ClusterInfo(
        master_url=MASTER,
        cluster_id="fake-cluster",
        agent_id="agent",
        slot_ids=[],
        task_id=f"{experiment_id}.1",
        allocation_id=f"{experiment_id}.1.1",
        session_token=TOKEN,
        task_type="TRIAL",
        latest_checkpoint=latest_checkpoint,
        trial_info=det.TrialInfo(
            trial_id=1,
            experiment_id=experiment_id,
            trial_seed=0,
            hparams=hparams or {},
            config={},
            steps_completed=0,
            trial_run_id=1,
            debug=False,
            inter_node_network_interface=None,
        ),
    )


def logged_in_environment(patch: Any, home: Any) -> None:
    """What a logged-in user's shell (or a task container) has: the master's address, a user and
    a token, and no cached client. ``patch`` is a pytest MonkeyPatch."""
    from determined.experimental import client
    from determined.searcher import _search_runner

    patch.setenv("DET_MASTER", MASTER)
    patch.setenv("DET_USER", "determined")
    patch.setenv("DET_USER_TOKEN", TOKEN)
    patch.setenv("HOME", str(home))
    patch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    patch.setattr(client, "_determined", None)
    # RemoteSearchRunner polls once a second; the fake master has every event at once.
    patch.setattr(_search_runner, "time", types.SimpleNamespace(sleep=lambda _: None))
