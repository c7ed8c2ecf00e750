"""Celery lifecycle paths against a real Redis and a real prefork worker (issue #11): every
release finds the lock by the task id that holds it, a retry is never swallowed, and an
explicit ``task_id`` reused by a fresh call is a duplicate of itself."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from taskdedup.testing import wait_for
from tests.effects import released
from tests.workers import CeleryWorker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker(redis_url: str, rc: redis.Redis) -> Iterator[CeleryWorker]:
    w = CeleryWorker(redis_url, queue="it-lifecycle", concurrency=2).start()
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="module")
def capp(redis_url: str, worker: CeleryWorker) -> Any:
    from tests import celery_app

    celery_app.configure(redis_url, worker.queue)
    return celery_app


def label() -> str:
    return uuid.uuid4().hex[:12]


def effects(rc: redis.Redis, name: str) -> list[str]:
    return [x.decode() for x in rc.lrange(f"effects:{name}", 0, -1)]


def key_of(capp: Any, task: Any, *args: Any, dedup_key: Any = None, **kwargs: Any) -> str:
    from taskdedup.celery import get_deduplicator

    return get_deduplicator(capp.app).identity(
        task.name, task._dedup_policy, args, kwargs, func=task._func(), dedup_key=dedup_key
    ).key


def value(rc: redis.Redis, key: str) -> str:
    return (rc.get(key) or b"").decode()


def final_state(rc: redis.Redis, task_id: str, timeout: float = 30) -> str:
    return wait_for(lambda: (rc.get(f"state:{task_id}") or b"").decode(), timeout=timeout,
                    what=f"task {task_id} finished")


def test_internal_error_path_releases_a_dedup_key_lock(capp: Any, rc: redis.Redis) -> None:
    """A failing ``on_failure`` hook takes Celery's internal-error path: ``task_failure``
    comes after the request was popped. The lock made from a ``dedup_key`` is released (not
    kept running by the heartbeat), so the same key runs again."""
    name, dedup_key = label(), f"ORD-{label()}"
    task = capp.fails_with_flaky_reporter
    first = task.apply_async((name,), dedup_key=dedup_key)
    key = key_of(capp, task, name, dedup_key=dedup_key)
    wait_for(lambda: effects(rc, name), timeout=30, what="body ran")
    # The lease is 3 s and the heartbeat renews it every second: a leaked lock outlives this.
    wait_for(lambda: not rc.exists(key), timeout=8, what=f"{key} released")
    second = task.apply_async((name,), dedup_key=dedup_key)
    assert second.id != first.id
    wait_for(lambda: len(effects(rc, name)) == 2, timeout=30, what="the same key ran again")


def test_hard_time_limit_releases_a_dedup_key_lock_in_the_main_process(
    capp: Any, rc: redis.Redis
) -> None:
    """The main process sends ``task_failure`` with the arguments only: the key comes from
    the message it received, not from the arguments (which would miss a ``dedup_key``)."""
    name, dedup_key = label(), f"ORD-{label()}"
    task = capp.too_slow_long_lease
    res = task.apply_async((name,), dedup_key=dedup_key)
    key = key_of(capp, task, name, dedup_key=dedup_key)
    wait_for(lambda: effects(rc, name), timeout=30, what="body started")
    assert value(rc, key).startswith("R|") and value(rc, key).endswith(res.id)
    with pytest.raises(Exception, match=r"TimeLimitExceeded|Time limit"):
        res.get(timeout=30)
    # The lease is 30 s: only the release frees it this soon.
    wait_for(lambda: not rc.exists(key), timeout=10, what=f"{key} released after time limit")
    assert task.apply_async((name,), dedup_key=dedup_key).id != res.id


def test_revoke_of_a_queued_dedup_key_call_releases_its_lock(capp: Any, rc: redis.Redis) -> None:
    """``task_revoked`` gets a Context: the lock is found by the header / the received
    message, not recomputed from the arguments."""
    name, dedup_key = label(), f"ORD-{label()}"
    task = capp.record_until_executed
    first = task.apply_async((name,), countdown=2, dedup_key=dedup_key)
    key = key_of(capp, task, name, dedup_key=dedup_key)
    assert value(rc, key).endswith(first.id)
    first.revoke()
    wait_for(lambda: not rc.exists(key), timeout=15, what=f"{key} released after revoke")
    again = task.apply_async((name,), dedup_key=dedup_key)
    assert again.id != first.id
    assert again.get(timeout=30) == name
    assert effects(rc, name) == ["0"]


def test_retry_without_throw_then_return_runs_the_retry(capp: Any, rc: redis.Redis) -> None:
    """``self.retry(countdown=..., throw=False)`` then a normal return: the first execution
    is a SUCCESS, its completion leaves the retry's reservation queued, and the retry runs."""
    name = label()
    first = capp.retry_without_throw.apply_async((name,), {"countdown": 1})
    key = key_of(capp, capp.retry_without_throw, name, countdown=1)
    wait_for(lambda: effects(rc, name) == ["1", "2"], timeout=30, what="the retry ran")
    assert final_state(rc, first.id) == "SUCCESS"
    wait_for(lambda: value(rc, key).startswith("D|"), timeout=10, what="done after the retry")
    assert value(rc, key).endswith(first.id)


def test_explicit_task_id_reused_by_a_fresh_call_is_a_duplicate_of_itself(
    capp: Any, rc: redis.Redis
) -> None:
    """Two fresh ``apply_async`` calls with the same ``task_id``: one message, one body."""
    name, task_id = label(), str(uuid.uuid4())
    task = capp.gated
    first = task.apply_async((name,), task_id=task_id)
    key = key_of(capp, task, name)
    wait_for(lambda: effects(rc, name) == ["start"], timeout=30, what="first body started")
    assert value(rc, key) == f"R||{task_id}"
    again = task.apply_async((name,), task_id=task_id)
    assert again.id == task_id
    assert value(rc, key) == f"R||{task_id}", "the running lock was requeued by the second call"
    rc.set(f"go:{name}", 1)
    assert first.get(timeout=30) == name
    wait_for(lambda: released(rc, key), timeout=10, what="released after success")
    # A second message would run now (absent lock): a sentinel on the same worker goes last.
    sentinel = label()
    assert capp.record.apply_async((sentinel,), countdown=1).get(timeout=30) == f"{sentinel}:0"
    assert effects(rc, name) == ["start", "end"]


def test_a_call_sent_again_right_after_its_revoke_runs(capp: Any, rc: redis.Redis) -> None:
    """"Cancel, then send it again": ``revoke()`` on the handle frees the queued call's
    identity at once, before any worker has seen the revoke, so the same call made right
    after it is a new call (not a duplicate of one that will never run). Sent to a queue no
    worker consumes: the revoked message is still there, unseen."""
    name = label()
    queue = f"it-revoke-{label()}"
    task = capp.record_until_executed
    first = task.apply_async((name,), queue=queue)
    key = key_of(capp, task, name)
    assert value(rc, key).endswith(first.id)
    first.revoke()
    again = task.apply_async((name,), queue=queue)
    assert again.id != first.id
    assert value(rc, key).endswith(again.id)
    # a handle of a duplicate stands for the original: its revoke frees that call too
    dup = task.apply_async((name,), queue=queue)
    assert dup.id == again.id
    dup.revoke()
    assert task.apply_async((name,), queue=queue).id not in (first.id, again.id)
    rc.delete(queue)
