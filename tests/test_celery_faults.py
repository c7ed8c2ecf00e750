"""Faults with a real Celery worker: SIGKILL mid-task with acks_late."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from taskdedup.testing import wait_for
from tests.effects import recorded, released
from tests.workers import CeleryWorker

pytestmark = pytest.mark.slow

# Short visibility so kombu restores the killed worker's unacked message within seconds.
FAST_RESTORE = {"TASKDEDUP_TEST_VISIBILITY": "4"}


@pytest.fixture(scope="module")
def capp(redis_url: str) -> Iterator[Any]:
    from tests import celery_app

    celery_app.configure(redis_url, "it-faults")
    yield celery_app


def test_sigkill_mid_task_lock_frees_within_lease_and_redelivery_runs(
    capp: Any, redis_url: str
) -> None:
    rc = redis.Redis.from_url(redis_url)
    name = uuid.uuid4().hex[:12]
    worker = CeleryWorker(redis_url, queue="it-faults", env=FAST_RESTORE).start()
    try:
        res = capp.long_running.delay(name)
        from taskdedup.celery import get_deduplicator

        key = get_deduplicator(capp.app).identity(
            capp.long_running.name, capp.long_running._dedup_policy, (name,), {},
            func=capp.long_running._func(),
        ).key
        wait_for(lambda: rc.lrange(f"effects:{name}", 0, -1), timeout=30, what="task started")
        assert rc.get(key).decode() == f"R||{res.id}"
        worker.kill()
        # Nobody renews the lease any more: the lock frees itself within lease (1.5 s).
        assert 0 < rc.pttl(key) <= 1500
        wait_for(lambda: not rc.exists(key), timeout=5, what="lock expired after SIGKILL")
    finally:
        worker.kill()

    # A new worker: kombu restores the unacked message; the same task id runs it again. kombu
    # before 5.7 tries to restore on the first poll and then only every tenth 10-second tick:
    # start the worker once the message is past its visibility timeout, so that first poll
    # restores it.
    visibility = float(FAST_RESTORE["TASKDEDUP_TEST_VISIBILITY"])
    wait_for(lambda: rc.zrangebyscore("unacked_index", 0, time.time() - visibility - 0.5),
             timeout=30, what="the killed task's message past its visibility timeout")
    rc.set(f"go:{name}", 1)
    worker = CeleryWorker(redis_url, queue="it-faults", env=FAST_RESTORE).start()
    try:
        assert res.get(timeout=60) == name
        starts = [e for e in rc.lrange(f"effects:{name}", 0, -1) if e.startswith(b"start")]
        assert len(starts) == 2  # at-least-once: the killed body had started
        assert rc.lrange(f"effects:{name}", 0, -1)[-1] == b"end"
        wait_for(lambda: released(rc, key), timeout=10, what="released after success")
    finally:
        worker.stop()


def test_store_down_on_the_worker_retries_later_never_runs_unguarded_never_drops(
    capp: Any, redis_url: str
) -> None:
    """A worker whose lock store is unreachable republishes the task instead of running it
    (on_store_error='raise'); a worker with a reachable store then runs it exactly once.
    With on_store_error='allow' the body runs unguarded."""
    from taskdedup.testing import free_port

    rc = redis.Redis.from_url(redis_url)
    strict, lenient = uuid.uuid4().hex[:12], uuid.uuid4().hex[:12]
    dead = f"redis://127.0.0.1:{free_port()}/0"
    bad = CeleryWorker(
        redis_url, queue="it-storedown", env={"TASKDEDUP_TEST_LOCK_URL": dead}
    ).start()
    try:
        res = capp.record.apply_async((strict,), queue="it-storedown")
        wait_for(lambda: rc.get(f"state:{res.id}") == b"RETRY", timeout=30,
                 what="worker asked to retry while its store is down")
        assert rc.lrange(f"effects:{strict}", 0, -1) == []  # never run unguarded
        allowed = capp.lenient.apply_async((lenient,), queue="it-storedown")
        assert allowed.get(timeout=30) == lenient  # fail open: ran without dedup
        assert "proceeding WITHOUT dedup" in bad.output()
    finally:
        bad.stop()  # warm shutdown gives the republished message back to the queue
    good = CeleryWorker(redis_url, queue="it-storedown").start()
    try:
        assert res.get(timeout=60) == f"{strict}:0"
        assert rc.lrange(f"effects:{strict}", 0, -1) == [b"0"]
    finally:
        good.stop()


def test_pool_child_killed_with_acks_late_is_redelivered_and_runs(
    capp: Any, redis_url: str
) -> None:
    """SIGKILL of the pool process only: the main process sees WorkerLostError, requeues the
    message (reject_on_worker_lost) and the same task id claims its own lock again."""
    rc = redis.Redis.from_url(redis_url)
    name = uuid.uuid4().hex[:12]
    worker = CeleryWorker(redis_url, queue="it-faults").start()
    try:
        res = capp.long_running.delay(name)
        first = wait_for(lambda: rc.lrange(f"effects:{name}", 0, -1), timeout=30)
        child = int(first[0].decode().split(":")[1])
        os.kill(child, signal.SIGKILL)
        rc.set(f"go:{name}", 1)  # only the redelivered run can see the gate open
        assert res.get(timeout=60) == name
        effects = [e.decode() for e in rc.lrange(f"effects:{name}", 0, -1)]
        assert [e for e in effects if e.startswith("start")][1:]  # ran again after the kill
        assert effects[-1] == "end" and effects.count("end") == 1
    finally:
        worker.stop()


@pytest.mark.parametrize("where", ["this worker", "another worker"])
def test_a_pool_process_killed_holding_only_a_copy_leaves_the_running_lock(
    capp: Any, redis_url: str, where: str
) -> None:
    """Two copies of one message (kombu restores an unacked message: SPEC §5): the first runs
    and holds the lock, the second is being put off in another pool process — of the same
    worker, or of another worker — when that process is SIGKILLed. Its worker's main process
    stores WorkerLostError for the id (Celery's own doing) but must not release the lock by
    that id: the first copy still runs under it, and a new call of the same identity must not
    run beside it. (Both failed before the fix; "another worker" failed with the first fix,
    which only looked for another copy active on the same worker.)"""
    from kombu.utils.json import dumps, loads

    rc = redis.Redis.from_url(redis_url)
    name = uuid.uuid4().hex[:12]
    queue = f"it-faults-copy-{name}"
    copies = queue if where == "this worker" else f"{queue}-b"
    key = capp.lock_key(capp.held_with_copy, name)
    worker = CeleryWorker(redis_url, queue=queue, concurrency=2).start()
    other = CeleryWorker(redis_url, queue=copies, concurrency=2).start() \
        if copies != queue else worker
    try:
        res = capp.held_with_copy.apply_async((name,), queue=queue)
        wait_for(lambda: any(e.startswith("start:") for e in recorded(rc, name)), timeout=30,
                 what="the first copy runs")
        # kombu's restore, as it copies an unacked message back to a queue
        entry = wait_for(lambda: next((loads(v) for v in rc.hvals("unacked")
                                       if loads(v)[0]["headers"]["id"] == res.id), None),
                         timeout=10, what="the message recorded unacked")
        rc.lpush(copies, dumps(entry[0]))
        copy = wait_for(lambda: next((e for e in recorded(rc, name) if e.startswith("copy:")),
                                     None), timeout=30, what="the copy is being put off")
        os.kill(int(copy.split(":")[1]), signal.SIGKILL)
        wait_for(lambda: "WorkerLostError" in other.output()[other.log_start:], timeout=30,
                 interval=0.1, what="the main process reports the lost process")
        # the main process ran its task_failure handlers (the log line comes after them):
        # the lock is still the first copy's
        value = rc.get(key)
        assert value is not None and value.decode().startswith("R|") and \
            value.decode().endswith(res.id), value
        assert capp.held_with_copy.apply_async((name,), queue=queue).id == res.id  # dropped
        rc.set(f"go:{name}", 1)
        wait_for(lambda: "end" in recorded(rc, name), timeout=30, what="the first copy ends")
        starts = [e for e in recorded(rc, name) if e.startswith("start:")]
        assert len(starts) == 1, recorded(rc, name)
    finally:
        worker.stop()
        if other is not worker:
            other.stop()


def test_a_pool_process_killed_holding_the_lock_has_it_released_at_once(
    capp: Any, redis_url: str
) -> None:
    """The other side of the rule above: the pool process that holds the lock is SIGKILLed
    (no ``reject_on_worker_lost``: Celery records a FAILURE), and its main process releases
    the lock at once — long before its 30 s lease would lapse — so the next call runs."""
    rc = redis.Redis.from_url(redis_url)
    name = uuid.uuid4().hex[:12]
    queue = f"it-faults-holder-{name}"
    key = capp.lock_key(capp.held_with_copy, name)
    worker = CeleryWorker(redis_url, queue=queue, concurrency=2).start()
    try:
        first = capp.held_with_copy.apply_async((name,), queue=queue)
        start = wait_for(lambda: next((e for e in recorded(rc, name)
                                       if e.startswith("start:")), None),
                         timeout=30, what="the body runs")
        os.kill(int(start.split(":")[1]), signal.SIGKILL)
        wait_for(lambda: not rc.exists(key), timeout=10, what="the lock released")
        rc.set(f"go:{name}", 1)
        again = capp.held_with_copy.apply_async((name,), queue=queue)
        assert again.id != first.id
        assert again.get(timeout=30) == name
    finally:
        worker.stop()
