"""The claim sent ahead (``taskdedup.celery.ahead``) against the deduplicator that reads it, in
process, on a real Redis: the threads of a threads pool share one deduplicator even when
their first tasks ask for it at once, and a claim sent by a deduplicator the app has replaced
since is read before the body claims, never taken for a copy of the same call.

Found by a threads-pool worker (``tests/test_celery_solo.py``): its two threads built two
deduplicators on their first tasks, one body's claim went out on the one that lost, and
``before_start`` claimed again on the other: the lock it had just taken answered as a copy of
the same id running elsewhere, and the call was put off until the lease lapsed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery, signals

import taskdedup.celery.config
import taskdedup.rq.config
from taskdedup import Policy, running
from taskdedup.celery import HEADER, DedupTask, get_deduplicator
from taskdedup.celery import ahead as claimed_ahead
from taskdedup.core import Deduplicator
from taskdedup.pids import ForkSafeLock
from taskdedup.testing import wait_for
from tests.effects import released
from tests.forking import child_runs_while_held


def make_app(redis_url: str) -> Celery:
    app = Celery("ahead", broker="memory://", backend="cache+memory://")
    app.conf.update(taskdedup_url=redis_url, taskdedup_stats=False)
    app.finalize()
    return app


class SlowDeduplicator(Deduplicator):
    """Takes 50 ms to build, so threads that ask at once all find none built yet."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(0.05)
        super().__init__(*args, **kwargs)


def built_at_once(get: Callable[[], Deduplicator], threads: int = 8) -> set[int]:
    """The ids of what ``get`` returned to ``threads`` threads calling it together."""
    barrier = threading.Barrier(threads)
    seen: list[int] = []

    def ask() -> None:
        barrier.wait()
        seen.append(id(get()))

    workers = [threading.Thread(target=ask) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=30)
    assert len(seen) == threads
    return set(seen)


def test_threads_asking_at_once_share_the_apps_one_deduplicator(
    redis_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(taskdedup.celery.config, "Deduplicator", SlowDeduplicator)
    app = make_app(redis_url)
    assert len(built_at_once(lambda: get_deduplicator(app))) == 1


def test_rq_threads_asking_at_once_share_one_deduplicator_per_connection(
    redis_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(taskdedup.rq.config, "Deduplicator", SlowDeduplicator)
    monkeypatch.delenv("TASKDEDUP_URL", raising=False)
    connection = redis.Redis.from_url(redis_url)
    made = built_at_once(lambda: taskdedup.rq.config.get_deduplicator(connection))
    assert len(made) == 1
    url = f"{redis_url}?ahead-test"
    made = built_at_once(lambda: taskdedup.rq.config.get_deduplicator(connection, url))
    assert len(made) == 1


def test_a_claim_sent_by_a_replaced_deduplicator_is_read_before_the_body_claims(
    redis_url: str, published: list[dict[str, Any]],
) -> None:
    """The app's deduplicator is replaced between the claim sent ahead and ``before_start``
    (two threads built one each, or the app was configured anew): the body still runs, once,
    with the lock running by its id — not put off as a copy of itself."""
    app = make_app(redis_url)
    ran: list[int] = []

    @app.task(base=DedupTask, shared=False, dedup=Policy(mode="until_executed", ttl=60))
    def charge(n: int) -> int:
        ran.append(n)
        return n

    client = redis.Redis.from_url(redis_url)
    handle = charge.apply_async((7,))
    headers = published[-1]
    key = headers[HEADER]["key"]
    assert client.get(key).startswith(b"Q|")  # reserved by the publish
    sent = claimed_ahead.send_ahead(charge, handle.id, headers)
    assert sent is not None
    app.__dict__.pop("_taskdedup")  # the app's deduplicator replaced
    assert get_deduplicator(app) is not claimed_ahead._ahead[handle.id][2]
    charge.push_request(id=handle.id, headers=headers, args=(7,), kwargs={},
                        delivery_info={}, is_eager=False)
    try:
        charge.before_start(handle.id, (7,), {})  # was: Ignore, put off as a copy
        value = client.get(key)
        assert value is not None and value.startswith(b"R|"), value
        assert value.decode().endswith(handle.id)
        assert charge(7) == 7
    finally:  # as Celery's tracer ends a task: the body's identity is left here
        signals.task_postrun.send(sender=charge, task_id=handle.id, task=charge, args=(7,),
                                  kwargs={}, retval=7, state="SUCCESS")
        charge.pop_request()
    assert running.current() is None
    assert ran == [7]
    assert handle.id not in claimed_ahead._ahead
    wait_for(lambda: released(client, key), timeout=10, what="the lock completed")


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_fork_while_another_thread_builds_leaves_the_child_free_to_build() -> None:
    """The build lock held by a thread at a fork (Celery's prefork pool forks its children
    from a main process whose other threads may be asking): the child, where that thread does
    not exist, takes it at once."""
    lock = ForkSafeLock()

    def take() -> bool:
        with lock:
            return True

    assert child_runs_while_held(lock, take)
