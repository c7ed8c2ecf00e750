"""Unit tests of the second call's options (SPEC §15, issue #22): validation at declaration,
the waiting call's verdict, its back-off and its timeout, and what an RQ job's meta carries.
Framework-free except for the meta round trip."""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any

import pytest

from taskdedup import (
    BusyTimeoutError,
    ConfigurationError,
    Deduplicator,
    Event,
    MemoryStore,
    OnBusy,
    Policy,
    TaskDedupError,
)
from taskdedup.core import Verdict
from taskdedup.events import DedupEvent
from taskdedup.flow import busy_wait, waiting_since
from taskdedup.stats import event_fields

# -- declaration -----------------------------------------------------------------------------


def test_on_busy_defaults_to_skip() -> None:
    assert Policy().on_busy is OnBusy.SKIP and Policy().busy_timeout is None


@pytest.mark.parametrize("mode", ["while_executing", "until_executed", "until_expired"])
def test_wait_is_accepted_with_every_mode_that_gates_execution(mode: str) -> None:
    policy = Policy(mode=mode, on_busy="wait", busy_timeout=timedelta(seconds=30))
    assert policy.on_busy is OnBusy.WAIT and policy.busy_timeout == 30.0


def test_wait_without_an_execution_gate_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"until_executing.*gates no execution"):
        Policy(mode="until_executing", on_busy="wait")


def test_an_unknown_on_busy_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"on_busy='block' is not one of 'skip', 'wait'"):
        Policy(on_busy="block")


@pytest.mark.parametrize("value", [-1, 0, math.nan, math.inf, "10", True])
def test_a_bad_busy_timeout_is_refused(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="busy_timeout"):
        Policy(mode="while_executing", on_busy="wait", busy_timeout=value)


def test_busy_timeout_without_wait_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="only a waiting call times out"):
        Policy(busy_timeout=5)


def test_a_dict_policy_takes_the_new_fields() -> None:
    policy = Policy.coerce({"mode": "while_executing", "on_busy": "wait", "busy_timeout": 2})
    assert policy is not None and policy.on_busy is OnBusy.WAIT and policy.busy_timeout == 2


# -- the verdict -----------------------------------------------------------------------------


def test_a_claim_finding_another_id_running_waits_under_on_busy_wait() -> None:
    dedup = Deduplicator(MemoryStore())
    seen: list[DedupEvent] = []
    dedup.events.add(seen.append)
    policy = Policy(mode="while_executing", on_busy="wait")
    assert dedup.start("t", policy, "k", "a").verdict is Verdict.ACCEPTED
    result = dedup.start("t", policy, "k", "b")
    assert (result.verdict, result.existing_id) == (Verdict.WAITING, "a")
    assert (seen[-1].event, seen[-1].detail, seen[-1].existing_id) == (Event.DEFERRED, "busy",
                                                                       "a")
    assert ("deferred:busy", 1) in event_fields(seen[-1])
    # the default still skips
    skip = dedup.start("t", Policy(mode="while_executing"), "k", "c")
    assert skip.verdict is Verdict.DUPLICATE
    # once the holder has finished, the waiter claims
    dedup.finish("t", policy, "k", "a", success=True)
    assert dedup.start("t", policy, "k", "b").verdict is Verdict.ACCEPTED


def test_wait_does_not_wait_for_a_done_identity() -> None:
    """until_expired: a holder that succeeded keeps the identity done; a waiter then ends
    as a skipped duplicate (the window says it ran), it does not wait for ttl."""
    dedup = Deduplicator(MemoryStore())
    policy = Policy(on_busy="wait")
    dedup.start("t", policy, "k", "a")
    dedup.finish("t", policy, "k", "a", success=True)
    assert dedup.start("t", policy, "k", "b").verdict is Verdict.DUPLICATE


# -- back-off and timeout --------------------------------------------------------------------


def test_the_wait_backs_off_with_the_time_waited_within_the_lease() -> None:
    policy = Policy(mode="while_executing", lease=60, on_busy="wait")
    assert busy_wait(policy, 0) == 1.0
    assert busy_wait(policy, 10) == 5.0
    assert busy_wait(policy, 1000) == 15.0  # a quarter of the lease
    assert busy_wait(policy, 1000, redelivery=8) == 4.0  # under half the visibility timeout


def test_the_last_wait_lands_on_busy_timeout_then_it_is_over() -> None:
    policy = Policy(mode="while_executing", lease=60, on_busy="wait", busy_timeout=10)
    assert busy_wait(policy, 9.5) == pytest.approx(0.5)
    assert busy_wait(policy, 9.99) is None
    assert busy_wait(policy, 12) is None


def test_a_carried_start_is_used_only_when_plausible() -> None:
    now = time.time()
    assert waiting_since(now - 5) == now - 5
    for bad in (None, "1", True, -1, math.nan, now + 3600):
        assert waiting_since(bad) is None


def test_busy_timeout_error_names_the_holder_and_survives_a_result_backend() -> None:
    error = BusyTimeoutError("taskdedup:t:abc", "holder-1", 3.2)
    assert isinstance(error, TaskDedupError)
    assert "holder-1" in str(error) and "waited 3.2s" in str(error)
    rebuilt = BusyTimeoutError(*error.args)  # as Celery's JSON backend rebuilds it
    assert (rebuilt.key, rebuilt.holder_id, str(rebuilt)) == (error.key, "holder-1", str(error))


# -- RQ meta ---------------------------------------------------------------------------------


def test_rq_meta_carries_on_busy_and_busy_timeout_to_the_worker() -> None:
    from taskdedup.rq.meta import _worker_policy, meta_entry

    policy = Policy(mode="while_executing", on_busy="wait", busy_timeout=7)
    entry = meta_entry("t", "k", policy)
    assert entry["on_busy"] == "wait" and entry["busy_timeout"] == 7
    back = _worker_policy(entry["mode"], entry["ttl"], entry["lease"], entry["on_store_error"],
                          None, None, None, None, entry["on_busy"], entry["busy_timeout"])
    assert back.on_busy is OnBusy.WAIT and back.busy_timeout == 7
    assert "on_busy" not in meta_entry("t", "k", Policy())


# -- counting ----------------------------------------------------------------------------------


def test_stats_count_waits_and_show_them_when_there_are_some() -> None:
    from taskdedup.cli import _stats_table
    from taskdedup.stats import TaskStats
    from taskdedup.web.render import stats_table

    item = TaskStats("t", {"deferred": 3, "deferred:busy": 2, "duplicate:coalesced": 1})
    assert (item.waits, item.coalesced, item.superseded) == (2, 1, 0)
    assert item.as_dict()["waits"] == 2
    columns = [c.header for c in _stats_table({"t": item}, "here").columns]
    assert columns[-2:] == ["waits", "coalesced"]
    plain = [c.header for c in _stats_table({"t": TaskStats("t", {"skipped": 1})},
                                            "here").columns]
    assert "waits" not in plain
    assert "waits" in stats_table({"t": item}, {}, "5m")


def test_prometheus_counts_the_second_calls_answers() -> None:
    prometheus = pytest.importorskip("prometheus_client")
    from taskdedup.metrics import PrometheusListener

    registry = prometheus.CollectorRegistry()
    listener = PrometheusListener(registry)
    listener(DedupEvent(Event.DEFERRED, "t", "k", "b", "a", "busy"))
    listener(DedupEvent(Event.DEFERRED, "t", "k", "b", "b", "copy"))
    value = registry.get_sample_value("taskdedup_second_calls_total",
                                      {"task": "t", "answer": "wait"})
    assert value == 1.0
    assert registry.get_sample_value("taskdedup_events_total",
                                     {"task": "t", "event": "deferred"}) == 2.0
