"""dsat's methods as Determined custom searchers (``DsatSearcher``): the cluster path proposes the
very trials the plain loop does, and speaks Determined's events as the master expects."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from determined import searcher

from dsat.runners.determined.event_loop import DeterminedEventLoop
from dsat.runners.determined.searcher_adapter import DsatSearcher
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.trial import TrialKind, TrialStatus
from dsat.trial_failure import FailureCause
from tests.search.helpers import PROFILE, cliff_function, history, method, run

METHODS = ["guided", "asha", "binary", "random"]


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("seed", [3, 8])
def test_under_determined_events_a_method_tries_what_the_plain_loop_tries(
    name: str, seed: int
) -> None:
    function = cliff_function(19, {1: 0.3, 2: 0.1})
    overrides = {"max_trials": 24, "max_concurrent_trials": 3, "random_seed": seed}
    plain = method(name, **overrides)
    expected = history(run(plain, function))
    on_cluster = method(name, **overrides)
    loop = DeterminedEventLoop(
        DsatSearcher(on_cluster),
        SimulatedRunner(function, 1),
        on_cluster.spec.ds_config,
        oom_as_metric=True,  # as dsat_reporting_context reports one on a cluster
    )
    loop.run()
    assert history(loop) == expected
    assert any(status == "oom" for _, status in expected)  # the OOM path was exercised
    assert loop.shutdown is not None and not loop.shutdown.failure
    best, cluster_best = plain.tracker.best(), on_cluster.tracker.best()
    assert best is not None and cluster_best is not None
    assert cluster_best.request_id == best.request_id


def test_operations_lengths_and_progress() -> None:
    m = method("binary", max_trials=10)
    adapter = DsatSearcher(m)
    state = searcher.SearcherState()
    ops = adapter.initial_operations(state)
    assert [type(op).__name__ for op in ops] == ["Create", "ValidateAfter"]
    assert ops[1].length == 1  # the model profile needs one step
    assert adapter.on_trial_created(state, ops[0].request_id) == []
    assert adapter.progress(state) == 0.0
    closing = adapter.on_validation_completed(state, ops[0].request_id, dict(PROFILE), 1)
    assert [type(op).__name__ for op in closing] == ["Close"]
    started = adapter.on_trial_closed(state, ops[0].request_id)
    creates = [op for op in started if isinstance(op, searcher.Create)]
    lengths = {op.length for op in started if isinstance(op, searcher.ValidateAfter)}
    assert creates and lengths == {m.trial_length(m.tracker.get(str(creates[0].request_id)))}
    assert adapter.progress(state) == pytest.approx(0.1)


def test_a_trial_errored_after_its_metrics_keeps_them_and_gets_no_second_close() -> None:
    m = method("binary", max_trials=10)
    adapter = DsatSearcher(m)
    state = searcher.SearcherState()
    (create, _) = adapter.initial_operations(state)
    adapter.on_validation_completed(state, create.request_id, dict(PROFILE), 1)
    started = adapter.on_trial_closed(state, create.request_id)
    first = next(op for op in started if isinstance(op, searcher.Create))
    metrics = {"FLOPS_per_gpu": 5e9, "throughput": 5.0}
    adapter.on_validation_completed(state, first.request_id, metrics, 6)
    errored = adapter.on_trial_exited_early(state, first.request_id, searcher.ExitedReason.ERRORED)
    assert errored == []
    again = adapter.on_validation_completed(state, first.request_id, {"FLOPS_per_gpu": 1.0}, 6)
    assert again == []
    record = m.tracker.get(str(first.request_id))
    assert record.status is TrialStatus.COMPLETED and record.metrics == metrics


def test_an_oom_reported_as_a_metric_is_an_oom_and_a_canceled_trial_ends_the_search() -> None:
    m = method("binary", max_trials=10)
    adapter = DsatSearcher(m)
    state = searcher.SearcherState()
    (create, _) = adapter.initial_operations(state)
    adapter.on_validation_completed(state, create.request_id, dict(PROFILE), 1)
    started = [
        op.request_id
        for op in adapter.on_trial_closed(state, create.request_id)
        if isinstance(op, searcher.Create)
    ]
    oom = {"dsat_out_of_memory": "CUDA out of memory"}
    adapter.on_validation_completed(state, started[0], oom, 6)
    assert m.tracker.get(str(started[0])).status is TrialStatus.OOM
    ops = adapter.on_trial_exited_early(state, started[1], searcher.ExitedReason.USER_CANCELED)
    assert [type(op).__name__ for op in ops] == ["Shutdown"] and m.finished
    assert m.shutdown_reason == "trial exited early: USER_CANCELED"
    after = adapter.on_trial_closed(state, uuid.UUID(str(started[1])))
    assert [type(op).__name__ for op in after] == ["Shutdown"]  # nothing more starts


def test_trials_that_report_no_searched_metric_are_the_scripts_failure() -> None:
    """A script reporting its own metrics (a loss) through Determined: every trial read as
    completed with nothing to rank, and the search ran all of --max-trials."""
    fits = cliff_function(10**6)  # no OOM

    def loss_only(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        metrics = fits(ds_config, slots)
        return metrics if "num_params" in metrics else {"loss": 1.0}

    m = method("binary", max_trials=16)
    runner = SimulatedRunner(loss_only, 1)
    loop = DeterminedEventLoop(DsatSearcher(m), runner, m.spec.ds_config, oom_as_metric=True)
    loop.run()
    ran = [r for r in m.tracker.finished if r.kind is not TrialKind.MODEL_PROFILE]
    assert not [r for r in ran if r.status is TrialStatus.COMPLETED]
    failed = [r for r in ran if r.status is TrialStatus.ERROR]
    assert failed and all(r.cause is FailureCause.SCRIPT for r in failed)
    assert all(
        (r.error or "").startswith("the trial reported no FLOPS_per_gpu (it reported loss)")
        for r in failed
    )
    assert len(failed) < 10 and "failed alike" in (m.shutdown_reason or "")
    assert loop.shutdown is not None and loop.shutdown.failure
