"""Copies of one RQ job id (SPEC §5, the same-id copy rule) with a real ``rq worker``: a copy
that finds its own id RUNNING with a live lease is neither run nor failed nor counted as a
retry, and comes back a quarter of the lease later through RQ's scheduler; a copy after its
own id's success ends without a new outcome, leaving the job as its first run left it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis
from rq import Callback
from rq.job import Job

from taskdedup import Policy
from taskdedup.rq import DedupQueue, skipped_info
from taskdedup.testing import wait_for
from tests import rq_jobs
from tests.workers import RqWorker

QUEUE = f"rq-copies-{os.getpid()}"


def label() -> str:
    return uuid.uuid4().hex[:12]


def effects(rc: redis.Redis, name: str) -> list[str]:
    return [x.decode() for x in rc.lrange(f"effects:{name}", 0, -1)]


def callbacks(rc: redis.Redis, job: Job) -> list[bytes]:
    return list(rc.lrange(f"callbacks:{job.id}", 0, -1))


@pytest.fixture(scope="module")
def worker(redis_url: str, rc: redis.Redis) -> Iterator[RqWorker]:
    started = RqWorker(redis_url, [QUEUE], scheduler=True).start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def q(rc: redis.Redis) -> DedupQueue:
    return DedupQueue(QUEUE, connection=rc, dedup=Policy(ttl=60, lease=4))


def test_a_copy_of_a_running_job_id_waits_and_ends_without_an_outcome_once_it_succeeded(
    worker: RqWorker, q: DedupQueue, rc: redis.Redis, redis_url: str
) -> None:
    name = label()
    idle = DedupQueue(f"rq-copies-idle-{name}", connection=rc, dedup=q.dedup_policy)
    job = idle.enqueue(rq_jobs.record, name, on_success=Callback(rq_jobs.on_success_cb))
    assert job is not None
    key = job.meta["taskdedup"]["key"]
    rc.set(key, f"R||{job.id}", px=60_000)  # this very id runs elsewhere, its lease live
    # the copy reaches the worker's queue (as RQ re-queues a job it thinks abandoned)
    idle.remove(job.id)
    rc.hset(job.key, "origin", q.name)
    rc.rpush(q.key, job.id)

    def put_back() -> int:
        return ours(worker).count(f"tests.rq_jobs.record[{job.id}] rescheduled in 1.0s")

    wait_for(lambda: put_back() >= 2, timeout=30, what="the copy put back twice")
    assert effects(rc, name) == []  # never run beside the running one
    job.refresh()
    assert job.get_status(refresh=False) not in ("failed", "finished")
    assert job.id not in q.failed_job_registry.get_job_ids()
    assert job.retries_left is None and skipped_info(job) is None  # not a retry, not skipped
    assert rc.get(key) == f"R||{job.id}".encode()  # the running copy's lock untouched

    rc.set(key, f"D||{job.id}", px=60_000)  # the running copy succeeded
    wait_for(lambda: job.get_status() == "finished", timeout=30, what="the copy ended")
    assert effects(rc, name) == [] and callbacks(rc, job) == []
    job.refresh()
    assert job.latest_result() is None and skipped_info(job) is None  # no new outcome
    assert rc.get(key) == f"D||{job.id}".encode()
    assert job.id not in q.scheduled_job_registry.get_job_ids() and q.count == 0


def test_a_copy_after_its_own_success_leaves_the_job_as_its_first_run_left_it(
    worker: RqWorker, q: DedupQueue, rc: redis.Redis
) -> None:
    name = label()
    job = q.enqueue(rq_jobs.record, name, on_success=Callback(rq_jobs.on_success_cb))
    assert job is not None
    wait_for(lambda: job.get_status() == "finished", timeout=30, what="the first run")
    first = job.latest_result()
    assert first is not None and job.return_value() == f"{name}:0"
    key = job.meta["taskdedup"]["key"]
    assert rc.get(key) == f"D||{job.id}".encode()
    # a copy of the finished job comes back (RQ's scheduler writes it as queued)
    rc.hset(job.key, "status", "queued")
    q.push_job_id(job.id)
    wait_for(lambda: q.count == 0 and job.get_status() == "finished", timeout=30,
             what="the copy ended")
    wait_for(lambda: f"tests.rq_jobs.record[{job.id}] already succeeded" in ours(worker),
             timeout=30, what="the copy's verdict in the worker's log")
    assert effects(rc, name) == ["0"]  # ran once
    assert callbacks(rc, job) == [b"success"]  # its callback once
    latest = job.latest_result()
    assert latest is not None and latest.id == first.id  # no second result, no "skipped"
    job.refresh()
    assert job.return_value() == f"{name}:0" and skipped_info(job) is None
    assert rc.get(key) == f"D||{job.id}".encode()


def ours(worker: RqWorker) -> str:
    return "\n".join(line for line in worker.output().splitlines() if " taskdedup: " in line)
