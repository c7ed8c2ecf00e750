"""Faults with real ``rq worker`` subprocesses: job timeout, a killed work-horse, a worker
killed with SIGKILL, and a lock store that is down on the worker."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from rq.job import Job

from taskdedup import Policy
from taskdedup.rq import DedupQueue
from taskdedup.testing import free_port, wait_for
from tests import rq_jobs
from tests.workers import RqWorker

pytestmark = pytest.mark.slow

TERMINAL = ("finished", "failed", "canceled", "stopped")


@pytest.fixture(scope="module")
def faults_queue() -> str:
    return f"rq-faults-{os.getpid()}"


@pytest.fixture(scope="module")
def worker(redis_url: str, rc: redis.Redis, faults_queue: str) -> Iterator[RqWorker]:
    w = RqWorker(redis_url, [faults_queue], scheduler=False).start()
    try:
        yield w
    finally:
        w.stop()


def label() -> str:
    return uuid.uuid4().hex[:12]


def effects(rc: redis.Redis, name: str) -> list[str]:
    return [x.decode() for x in rc.lrange(f"effects:{name}", 0, -1)]


def key_of(queue: DedupQueue, func: Any, *args: Any) -> str:
    name = f"{func.__module__}.{func.__qualname__}"
    return queue.dedup.identity(name, Policy(), args, {}, func=func).key


def ended(job: Job | None, timeout: float = 30) -> str:
    assert job is not None
    return wait_for(lambda: (s := job.get_status()) in TERMINAL and s, timeout=timeout,
                    what=f"job {job.id} ended")


def horse_pid(rc: redis.Redis, name: str) -> int:
    first = wait_for(lambda: effects(rc, name), timeout=30, what="job started")
    return int(first[0].split(":")[1])


def test_job_timeout_fails_the_job_releases_the_lock_and_a_reenqueue_runs(
    worker: RqWorker, rc: redis.Redis, faults_queue: str
) -> None:
    q = DedupQueue(faults_queue, connection=rc, dedup=Policy(mode="until_executed", lease=30))
    name = label()
    job = q.enqueue(rq_jobs.slow, name, job_timeout=1)
    assert ended(job) == "failed"
    assert job is not None and "JobTimeoutException" in (job.latest_result().exc_string or "")
    key = key_of(q, rq_jobs.slow, name)
    # released by the failure handling, far sooner than the 30 s lease
    wait_for(lambda: not rc.exists(key), timeout=5, what="released after the job timeout")
    again = q.enqueue(rq_jobs.slow, name, job_timeout=1)
    assert again is not None and again.id != job.id
    assert ended(again) == "failed"
    assert effects(rc, name) == ["start", "start"]


def test_a_killed_work_horse_is_released_by_the_worker_and_a_reenqueue_runs(
    worker: RqWorker, rc: redis.Redis, faults_queue: str
) -> None:
    q = DedupQueue(faults_queue, connection=rc, dedup=Policy(mode="until_executed", lease=30))
    name = label()
    job = q.enqueue(rq_jobs.long_running, name)
    assert job is not None
    key = key_of(q, rq_jobs.long_running, name)
    os.kill(horse_pid(rc, name), signal.SIGKILL)  # e.g. the kernel's OOM killer
    assert ended(job) == "failed"
    # the worker's main process ran the failure handling: far sooner than the 30 s lease
    wait_for(lambda: not rc.exists(key), timeout=5, what="released after the horse died")
    rc.set(f"go:{name}", 1)
    again = q.enqueue(rq_jobs.long_running, name)
    assert again is not None and again.id != job.id
    assert ended(again) == "finished"
    assert effects(rc, name)[-1] == "end"


def test_a_worker_killed_with_sigkill_frees_the_lock_within_lease_and_a_reenqueue_runs(
    redis_url: str, rc: redis.Redis
) -> None:
    queue = f"rq-sigkill-{label()}"
    q = DedupQueue(queue, connection=rc, dedup=Policy(mode="until_executed", lease=1.5))
    name = label()
    doomed = RqWorker(redis_url, [queue], scheduler=False).start()
    try:
        job = q.enqueue(rq_jobs.long_running, name)
        assert job is not None
        key = key_of(q, rq_jobs.long_running, name)
        pid = horse_pid(rc, name)
        assert rc.get(key) == f"R||{job.id}".encode()
        doomed.kill()  # the whole machine goes: main process, scheduler and horse
        os.kill(pid, signal.SIGKILL)
        # nobody renews the lease any more: the lock frees itself within lease (1.5 s)
        assert 0 < rc.pttl(key) <= 1500
        wait_for(lambda: not rc.exists(key), timeout=5, what="lock expired after SIGKILL")
    finally:
        doomed.kill()
        # The dead worker's registration lives on in Redis (no death was recorded); a later
        # RqWorker of this process may get the same name (named by id()) and RQ would refuse it.
        rc.delete(f"rq:worker:{doomed.name}")
    rc.set(f"go:{name}", 1)
    fresh = RqWorker(redis_url, [queue], scheduler=False).start()
    try:
        again = q.enqueue(rq_jobs.long_running, name)
        assert again is not None and again.id != job.id
        assert ended(again) == "finished"
        assert effects(rc, name)[-1] == "end"
    finally:
        fresh.stop()
        q.empty()


@pytest.mark.parametrize("scheduler", [False, True], ids=["requeued", "rescheduled"])
def test_store_down_on_the_worker_puts_the_job_back_never_runs_it_unguarded_nor_drops_it(
    redis_url: str, rc: redis.Redis, scheduler: bool
) -> None:
    """A worker whose lock store is unreachable puts the job back instead of running it
    (on_store_error='raise'): re-queued at the back, or rescheduled when a scheduler serves
    the queue. A worker with a reachable store, started beside it, then runs it exactly
    once. With on_store_error='allow' the body runs unguarded, with a warning."""
    queue = f"rq-storedown-{label()}"
    q = DedupQueue(queue, connection=rc, dedup=Policy(ttl=60))
    strict, lenient = label(), label()
    dead = f"redis://127.0.0.1:{free_port()}/0"
    bad = RqWorker(redis_url, [queue], scheduler=scheduler, env={"TASKDEDUP_URL": dead},
                   worker_class="tests.rq_jobs.FastStoreRetryWorker").start()
    put_back = "rescheduled" if scheduler else "re-queued"
    good: RqWorker | None = None
    try:
        job = q.enqueue(rq_jobs.record, strict)
        assert job is not None
        notice = f"store unavailable before tests.rq_jobs.record[{job.id}]; {put_back}"
        wait_for(lambda: bad.output().count(notice) >= 2, timeout=30,
                 what="the job was put back twice")
        assert effects(rc, strict) == []  # never run unguarded
        assert job.get_status() in ("queued", "scheduled", "started")
        assert job.id not in q.failed_job_registry  # not a failure
        allowed = q.enqueue(rq_jobs.record, lenient, dedup={"on_store_error": "allow"})
        assert ended(allowed) == "finished"  # fail open: ran without dedup
        assert "WITHOUT dedup" in bad.output()
        good = RqWorker(redis_url, [queue], scheduler=False).start()
        assert ended(job) == "finished"  # never dropped: the healthy worker got it
        assert effects(rc, strict) == ["0"]
        assert effects(rc, lenient) == ["0"]
    finally:
        for w in (bad, good):
            if w is not None:
                w.stop()
        q.empty()
