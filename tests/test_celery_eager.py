"""Eager mode (``task_always_eager``), as test suites run it: no result backend, locks in a
real Redis. A duplicate's handle works like an ``EagerResult``: ``get()`` answers at once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, states
from celery.result import EagerResult

from taskdedup import Policy
from taskdedup.celery import DedupTask, get_deduplicator
from taskdedup.celery import eager as eager_results
from taskdedup.stores.redis import RedisStore


@pytest.fixture
def app(redis_client: redis.Redis) -> Iterator[Celery]:
    app = Celery("eager-tests", broker="memory://")  # no result backend, as in most test suites
    app.conf.update(task_always_eager=True, taskdedup_store=RedisStore(redis_client),
                    taskdedup_stats=False)
    app.finalize()
    yield app


def declare(app: Celery, runs: list[Any], **policy: Any) -> Any:
    @app.task(base=DedupTask, shared=False, dedup=Policy(ttl=60, **policy))
    def charge(order: str) -> str:
        runs.append(order)
        return f"charged {order}"

    return charge


def test_a_duplicates_handle_is_the_originals_eager_result(app: Celery) -> None:
    runs: list[Any] = []
    charge = declare(app, runs)
    first = charge.delay("ORD-1")
    again = charge.delay("ORD-1")
    assert isinstance(again, EagerResult)
    assert again.id == first.id
    assert again.get() == "charged ORD-1"  # before: NotImplementedError (no backend)
    assert again.state == states.SUCCESS
    assert runs == ["ORD-1"]


def test_a_duplicate_of_a_call_that_did_not_run_here_answers_at_once(
    app: Celery, monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs: list[Any] = []
    charge = declare(app, runs)
    dedup = get_deduplicator(app)
    key = dedup.identity(charge.name, charge._dedup_policy, ("ORD-2",), {},
                         func=charge._func()).key
    dedup.store.reserve(key, "queued-elsewhere", 60_000)  # another process's queued call
    handle = charge.delay("ORD-2")
    assert isinstance(handle, EagerResult)
    assert handle.id == "queued-elsewhere"
    assert handle.state == states.PENDING
    assert handle.get() is None  # at once, no backend asked
    assert runs == []


def test_the_process_keeps_a_bounded_number_of_eager_results(
    app: Celery, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(eager_results, "KEEP", 3)
    runs: list[Any] = []
    charge = declare(app, runs, mode="until_executed")
    for n in range(5):
        charge.delay(f"ORD-{n}")
    assert len(eager_results._results) == 3
