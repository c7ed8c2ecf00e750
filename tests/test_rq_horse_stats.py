"""A forking ``DedupWorker``'s work-horse starts no stats thread of its own (#25): its counts
go to the worker at its end, and a job still running when the first flush is due has them
flushed from the horse's heartbeat thread, on the same cadence (``stats.hold_threads``). And
the horse inherits the worker's objects frozen for its collector (``gc.freeze``)."""

from __future__ import annotations

import gc
import uuid
from collections.abc import Iterator

import pytest
import redis
from rq.job import Job

from taskdedup import Policy
from taskdedup.rq import DedupQueue
from taskdedup.rq.worker import _frozen_for_fork
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


def test_the_horse_inherits_the_workers_objects_frozen(worker: RqWorker, rc: redis.Redis) -> None:
    """The horse's collections leave the objects it inherits alone (no copy-on-write fault
    for each page they are on): they are frozen when RQ forks it (#25)."""
    name = uuid.uuid4().hex[:12]
    q = DedupQueue(QUEUE, connection=rc, dedup=Policy(ttl=60))
    job = q.enqueue(rq_jobs.freeze_count, name)
    assert job is not None
    wait_for(lambda: rc.llen(f"effects:{name}") == 1, timeout=30, what="the job to run")
    assert int(rc.lrange(f"effects:{name}", 0, -1)[0]) > 10_000  # the worker's objects


@pytest.fixture
def thawed() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_worker_thaws_after_the_fork_and_collected_its_young_objects_first(
    thawed: None,
) -> None:
    seen: list[tuple[int, int]] = []
    young = gc.get_stats()[1]["collections"]
    with _frozen_for_fork():
        seen.append((gc.get_freeze_count(), gc.get_stats()[1]["collections"]))
    assert seen[0][0] > 1000  # frozen for the fork
    assert seen[0][1] > young  # the young generations collected before it
    assert gc.get_freeze_count() == 0  # this process thaws: its garbage is collected as before


def test_a_process_that_froze_its_objects_itself_is_left_as_it_is(thawed: None) -> None:
    gc.freeze()
    frozen = gc.get_freeze_count()  # frozen objects can still be freed: the count only falls
    junk = [[i] for i in range(1000)]
    with _frozen_for_fork():
        assert gc.get_freeze_count() <= frozen  # its 1,000 new lists not frozen by us
    assert gc.get_freeze_count() > frozen // 2  # nor thawed (a thaw leaves none)
    del junk


def test_collection_turned_off_is_left_off(thawed: None) -> None:
    gc.disable()
    try:
        with _frozen_for_fork():
            assert gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()
