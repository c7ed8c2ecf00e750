"""A forking ``DedupWorker``'s work-horse starts no stats thread of its own (#25): its counts
go to the worker at its end, and a job still running when the first flush is due has them
flushed from the horse's heartbeat thread, on the same cadence (``stats.hold_threads``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from rq.job import Job

from taskdedup import Policy
from taskdedup.rq import DedupQueue
from taskdedup.stats import DEFAULT_INTERVAL
from taskdedup.testing import wait_for
from tests import rq_jobs
from tests.workers import RqWorker

QUEUE = f"rq-horse-stats-{uuid.uuid4().hex[:8]}"
KEY = "taskdedup:stats:tests.rq_jobs.gated"


@pytest.fixture(scope="module")
def worker(redis_url: str, rc: redis.Redis) -> Iterator[RqWorker]:
    yield from RqWorker(redis_url, [QUEUE], scheduler=False).running()


def counts(rc: redis.Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in rc.hgetall(KEY).items()}


@pytest.mark.slow
def test_a_long_jobs_counts_reach_redis_while_it_runs_and_are_counted_once(
    worker: RqWorker, rc: redis.Redis
) -> None:
    name = uuid.uuid4().hex[:12]
    before = counts(rc)
    q = DedupQueue(QUEUE, connection=rc, dedup=Policy(ttl=60))
    job = q.enqueue(rq_jobs.gated, name)
    assert job is not None
    try:
        wait_for(lambda: rc.lrange(f"effects:{name}", 0, -1) == [b"start"], timeout=30,
                 what="the body to start")
        # the horse's claim is flushed by the horse itself, about DEFAULT_INTERVAL after it
        wait_for(lambda: counts(rc).get("claimed", 0) == before.get("claimed", 0) + 1,
                 timeout=DEFAULT_INTERVAL + 20, what="the running horse's counts in Redis")
        assert Job.fetch(job.id, connection=rc).get_status() == "started"  # still running
    finally:
        rc.set(f"go:{name}", 1, ex=60)
    wait_for(lambda: Job.fetch(job.id, connection=rc).get_status() == "finished", timeout=30,
             what="the job to finish")
    # the rest goes over the pipe to the worker, which flushes it with its own
    wait_for(lambda: counts(rc).get("completed", 0) == before.get("completed", 0) + 1,
             timeout=DEFAULT_INTERVAL + 20, what="the completion's count")
    assert counts(rc).get("claimed", 0) == before.get("claimed", 0) + 1  # not twice
