"""Copies of one message, and executions inside executions, with real Celery workers
(SPEC §5, §11; issue #19 A1, A3, A4).

- kombu's Redis transport restores every unacked message each ``visibility_timeout``, and a
  worker holds an ETA/countdown message unacked until it is due: a countdown beyond the
  visibility timeout exists in several copies at its ETA, each held by some worker, all with
  one task id. Whatever the number of copies, one body runs.
- A message redelivered after its own success (a worker killed after the body, before the
  ack) ends without a new outcome: no second result, no errback, nothing to its chain.
- A task run inside another (``.apply()``, a direct in-process call) runs under its own
  identity, and the enclosing one is restored when it returns.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from taskdedup.celery import HEADER
from taskdedup.testing import wait_for
from tests.effects import recorded
from tests.workers import CeleryWorker

pytestmark = pytest.mark.slow

QUEUE = "it-copies"
VISIBILITY = 2.0  # seconds: countdowns of 6 s outlive it three times over
COPIES_ENV = {"TASKDEDUP_TEST_VISIBILITY": str(VISIBILITY)}


@pytest.fixture(scope="module")
def workers(redis_url: str) -> Iterator[list[CeleryWorker]]:
    started: list[CeleryWorker] = []
    try:
        for _ in range(2):
            started.append(CeleryWorker(redis_url, queue=QUEUE, concurrency=2,
                                        env=COPIES_ENV).start())
        yield started
    finally:
        for worker in started:
            worker.kill()


@pytest.fixture(scope="module")
def capp(redis_url: str, workers: list[CeleryWorker]) -> Iterator[Any]:
    from tests import celery_app

    celery_app.configure(redis_url, QUEUE)
    options = celery_app.app.conf.broker_transport_options
    celery_app.app.conf.broker_transport_options = {**options, "visibility_timeout": VISIBILITY}
    try:
        yield celery_app
    finally:  # the app is shared with the modules that follow
        celery_app.app.conf.broker_transport_options = options


def label() -> str:
    return uuid.uuid4().hex[:12]


def logs(workers: list[CeleryWorker]) -> str:
    return "".join(w.output() for w in workers)


def restore_unacked(capp: Any) -> None:
    """What kombu's own timer does every visibility_timeout on 5.7 (older kombu looks only
    every ~100 s): put unacked messages past their visibility timeout back in their queue."""
    with capp.app.connection_for_write() as conn:
        conn.default_channel.qos.restore_visible(num=100, interval=1)


def quiet_for(rc: redis.Redis, capp: Any, seconds: float) -> Any:
    """A condition: no message of the queue is queued or held unacked, and it has stayed so
    for ``seconds`` (a copy put off is republished before its predecessor is acked)."""
    since: list[float] = []

    def check() -> bool:
        restore_unacked(capp)
        if rc.llen(QUEUE) or rc.hlen("unacked"):
            since.clear()
            return False
        since.append(time.monotonic())
        return since[-1] - since[0] >= seconds

    return check


@pytest.mark.parametrize("task_name", ["slow_once", "slow_once_expiring", "slow_once_tracked"])
def test_a_countdown_beyond_the_visibility_timeout_runs_once_across_two_workers(
    capp: Any, rc: redis.Redis, workers: list[CeleryWorker], task_name: str
) -> None:
    """SPEC §5 / #19 A1: countdown 6 s under a 2 s visibility timeout, two workers of two
    processes each: kombu restores each held message about three times before its ETA, so
    copies claim while the first runs (deferred: the lock is this id's, RUNNING) and after it
    finished (ended: done, or the finished tombstone of until_executed). One body per call,
    each call SUCCESS with its body's result."""
    task = getattr(capp, task_name)
    names = [label() for _ in range(3)]
    sent = [task.apply_async((name, 1.5), countdown=6) for name in names]

    def all_ready() -> bool:  # restoring meanwhile, as kombu 5.7's own timer does
        restore_unacked(capp)
        return all(handle.ready() for handle in sent)

    wait_for(all_ready, timeout=60, interval=0.5, what="every call ended")
    for handle, name in zip(sent, names, strict=True):
        assert handle.get(timeout=60) == name
    wait_for(quiet_for(rc, capp, 3 * VISIBILITY), timeout=90, interval=0.3,
             what="every copy ended")
    assert {name: len(recorded(rc, name)) for name in names} == {name: 1 for name in names}
    for handle, name in zip(sent, names, strict=True):
        assert (handle.state, handle.result) == ("SUCCESS", name)
    output = logs(workers)
    # The case is exercised: copies existed and were put off or ended, never run.
    assert "runs in another copy of its message" in output or (
        "already succeeded: this redelivered copy ends" in output), output[-3000:]


@pytest.mark.parametrize("task_name", ["record", "record_tracked"])
def test_a_redelivery_after_success_ends_without_a_new_outcome(
    capp: Any, rc: redis.Redis, workers: list[CeleryWorker], task_name: str
) -> None:
    """SPEC §5 / #19 A4: the message of a step that succeeded comes back (a worker killed
    after the body, before the ack) with its callbacks: it ends without a new outcome — its
    result stays the first run's (with task_track_started too: STARTED is written only by an
    execution that runs), the next step is not sent again, no errback runs."""
    name = label()
    task = getattr(capp, task_name)
    first = task.apply_async((name,))
    assert first.get(timeout=30) == f"{name}:0"
    key = capp.lock_key(task, name)
    # task_success (the completion) follows the result's write: wait for the done lock
    wait_for(lambda: rc.get(key) == f"D||{first.id}".encode(), timeout=10, what="done")
    seen = logs(workers).count("already succeeded: this redelivered copy ends")
    # The very message again, as kombu restores it: same id, same header, with a chain's
    # next step and an errback attached.
    capp.app.send_task(
        task.name, (name,), task_id=first.id,
        headers={HEADER: {"task": task.name, "key": key}},
        link=capp.plain.si(f"{name}-next"), link_error=capp.plain.si(f"{name}-errback"),
    )
    wait_for(lambda: logs(workers).count("already succeeded: this redelivered copy ends")
             > seen or recorded(rc, f"{name}-errback") or recorded(rc, f"{name}-next")
             or capp.app.AsyncResult(first.id).state != "SUCCESS",
             timeout=30, what="the redelivered copy ended")
    wait_for(quiet_for(rc, capp, 1.0), timeout=30, interval=0.2, what="nothing left to run")
    assert recorded(rc, name) == ["0"]
    assert recorded(rc, f"{name}-next") == [] and recorded(rc, f"{name}-errback") == []
    again = capp.app.AsyncResult(first.id)
    assert (again.state, again.result) == ("SUCCESS", f"{name}:0")
    assert rc.get(key) == f"D||{first.id}".encode()  # the window is kept, not released


def test_an_execution_inside_an_execution_has_its_own_identity(
    capp: Any, rc: redis.Redis
) -> None:
    """SPEC §11 / #19 A3: a gated task runs a plain task with .apply(), a gated one with
    .apply() and another directly in-process. Each inner one runs under its own key; the
    outer one has its own before and after (0.1 lost it after .apply() and gave the direct
    call the caller's)."""
    name = label()
    assert capp.nests.delay(name).get(timeout=30) == name
    outer = capp.lock_key(capp.nests, name)
    assert recorded(rc, name) == [outer, outer]
    applied = recorded(rc, f"{name}-applied")
    direct = recorded(rc, f"{name}-direct")
    assert applied == [capp.lock_key(capp.report_identity, f"{name}-applied")]
    assert direct == [capp.lock_key(capp.report_identity, f"{name}-direct")]
    assert outer not in applied + direct
