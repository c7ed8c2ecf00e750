"""A forking ``DedupWorker`` claims a job's lock before it forks the work-horse, and its own
heartbeat thread renews the lease while the horse runs: the horse starts no thread (#25, the
RQ worker row). The horse settles the lock itself, and renews the lease itself once its worker
is gone (:mod:`taskdedup.forklease`): never a second run beside a horse that outlives its
worker. The hand-over itself is tested in-process in ``test_forklease.py``."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable

import pytest
import redis
from rq.job import Job

from taskdedup import Policy
from taskdedup.rq import DedupQueue, DedupWorker
from taskdedup.rq.worker import _forks_its_horse
from taskdedup.testing import wait_for
from tests import rq_jobs
from tests.effects import holds_for, recorded
from tests.workers import RqWorker

pytestmark = pytest.mark.slow

LEASE = 1.5


def label() -> str:
    return uuid.uuid4().hex[:12]


def queue_of(rc: redis.Redis, policy: Policy) -> DedupQueue:
    return DedupQueue(f"rq-ahead-{label()}", connection=rc, dedup=policy)


def finished(job: Job, timeout: float = 30) -> str:
    return wait_for(lambda: (s := job.get_status()) in ("finished", "failed") and s,
                    timeout=timeout, what=f"job {job.id} ended")


def started(rc: redis.Redis, q: DedupQueue, name: str) -> tuple[Job, str, int, str]:
    """Enqueue a long job and wait for its body: the job, its lock key, the horse's pid and
    the names of the horse's threads."""
    job = q.enqueue(rq_jobs.threads_then_wait, name)
    assert job is not None
    key = q.dedup.identity("tests.rq_jobs.threads_then_wait", Policy(), (name,), {},
                           func=rq_jobs.threads_then_wait).key
    first = wait_for(lambda: recorded(rc, name), timeout=30, what="the body started")[0]
    _, horse, threads = first.split(":", 2)
    return job, key, int(horse), threads


def still_running(rc: redis.Redis, job: Job, key: str) -> Callable[[], None]:
    def check() -> None:
        assert rc.get(key) == f"R||{job.id}".encode()
    return check


def test_the_worker_renews_the_lease_and_the_horse_starts_no_thread(
    redis_url: str, rc: redis.Redis
) -> None:
    q = queue_of(rc, Policy(mode="until_executed", lease=LEASE))
    name = label()
    with_worker = RqWorker(redis_url, [q.name], scheduler=False).start()
    try:
        job, key, horse, threads = started(rc, q, name)
        assert horse != with_worker.process.pid  # type: ignore[union-attr]
        assert "taskdedup-heartbeat" not in threads.split(","), threads
        assert "taskdedup-stats" not in threads.split(","), threads
        holds_for(3 * LEASE, still_running(rc, job, key))  # renewed by the worker
        rc.set(f"go:{name}", 1, ex=60)
        assert finished(job) == "finished"
        assert recorded(rc, name)[-1] == "end"
        # completed by the horse: the finished tombstone (gone itself after a lease)
        assert rc.get(key) in (f"F||{job.id}".encode(), None)
        assert "lost its lock" not in with_worker.output()
    finally:
        with_worker.stop()
        q.empty()


def test_a_horse_whose_worker_is_killed_renews_its_own_lease_and_completes(
    redis_url: str, rc: redis.Redis
) -> None:
    q = queue_of(rc, Policy(mode="until_executed", lease=LEASE))
    name = label()
    doomed = RqWorker(redis_url, [q.name], scheduler=False).start()
    try:
        job, key, horse, _ = started(rc, q, name)
        doomed.kill()  # the worker's process group: the horse, in a session of its own, runs on
        os.kill(horse, 0)  # still alive
        # no worker any more: the horse renews it itself, past its lease
        holds_for(3 * LEASE, still_running(rc, job, key))
        rc.set(f"go:{name}", 1, ex=60)
        wait_for(lambda: recorded(rc, name)[-1] == "end", timeout=30, what="the body ended")
        wait_for(lambda: rc.get(key) in (f"F||{job.id}".encode(), None), timeout=30,
                 what="the horse completed its lock")
        assert recorded(rc, name)[0].startswith(f"start:{horse}:")
        assert len(recorded(rc, name)) == 2  # ran once
    finally:
        doomed.kill()
        rc.delete(f"rq:worker:{doomed.name}")
        q.empty()


def test_the_horse_of_a_spawning_worker_claims_for_itself_and_runs_at_once(
    redis_url: str, rc: redis.Redis
) -> None:
    """``SpawnWorker`` composed after ``DedupWorker`` starts each horse afresh
    (``posix_spawn``): it inherits no claim, so the worker claims nothing before it (else the
    horse would find its own lock running and put itself off as a copy, a quarter of the
    lease later: 15 s here)."""
    assert _forks_its_horse(DedupWorker)
    assert not _forks_its_horse(rq_jobs.DedupSpawnWorker)
    q = queue_of(rc, Policy(mode="until_executed"))
    name = label()
    spawning = RqWorker(redis_url, [q.name], scheduler=False,
                        worker_class="tests.rq_jobs.DedupSpawnWorker").start()
    try:
        job = q.enqueue(rq_jobs.record, name)
        assert job is not None
        assert finished(job, timeout=10) == "finished"
        assert recorded(rc, name) == ["0"]
        assert "another copy" not in spawning.output()
    finally:
        spawning.stop()
        q.empty()
