"""Coalesce and debounce with real RQ ``DedupWorker``s (two of them, with the scheduler;
SPEC §15, issue #22 parts 2-3).

- coalesce: a duplicate of a queued job gets the original job; duplicates of a running job
  become one follow-up job (one id, not the running one) that runs once after it with the
  latest call's arguments and FINISHES with its result.
- debounce: a burst runs once, ``wait`` after its last call, with that call's arguments; the
  others FINISH with the superseded marker; ``max_wait`` runs a long burst at least every
  ``max_wait``; the success window does not stop the next burst; a worker restarted (warm)
  while the burst's jobs are scheduled resurrects none of the superseded ones.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import pytest
import redis
from rq.job import Job

from taskdedup import Debounce, Policy
from taskdedup.flow import superseded_of
from taskdedup.rq import DedupQueue
from taskdedup.stats import read_stats
from taskdedup.testing import wait_for
from tests import flow_jobs
from tests.effects import recorded
from tests.pairs import rq_pair
from tests.workers import RqWorker

pytestmark = pytest.mark.slow

QUEUE = f"rq-flow-{os.getpid()}"


def label() -> str:
    return uuid.uuid4().hex[:12]


workers = rq_pair(QUEUE)


def superseded(rc: redis.Redis) -> int:
    """``skipped:superseded`` of the jobs' function, as the workers flushed it (~5 s)."""
    found = read_stats(rc, task="tests.flow_jobs.run")
    return sum(s.get("skipped:superseded") for s in found.values())


def final(job: Job) -> bool:
    return job.get_status() in ("finished", "failed")


def ended(*jobs: Job, timeout: float = 60) -> None:
    for job in jobs:
        wait_for(lambda job=job: final(job), timeout=timeout, interval=0.1,
                 what=f"job {job.id} ended")


def coalescing(rc: redis.Redis, mode: str = "until_executed") -> DedupQueue:
    return DedupQueue(QUEUE, connection=rc, dedup=Policy(
        mode=mode, ttl=300, lease=8, include=["label"], on_duplicate="coalesce"))


def debouncing(rc: redis.Redis, debounce: Debounce, mode: str = "until_expired") -> DedupQueue:
    return DedupQueue(QUEUE, connection=rc, dedup=Policy(
        mode=mode, ttl=300, lease=8, include=["label"], debounce=debounce))


@pytest.mark.parametrize("mode", ["until_executed", "until_expired"])
def test_duplicates_of_a_running_job_become_one_follow_up_with_the_latest_arguments(
    workers: list[RqWorker], rc: redis.Redis, mode: str
) -> None:
    """Five duplicates while the first runs: one follow-up job (a new id), FINISHED with the
    last call's argument, run once after the first (through until_expired's window too)."""
    q = coalescing(rc, mode)
    name = label()
    first = q.enqueue(flow_jobs.run, name, 0, name)
    wait_for(lambda: "start0" in recorded(rc, name), timeout=30, what="the first job runs")
    follow = [q.enqueue(flow_jobs.run, name, n) for n in range(1, 6)]
    assert len({j.id for j in follow if j is not None}) == 1
    assert follow[0] is not None and follow[0].id != first.id
    rc.set(f"go:{name}", 1)
    ended(first, follow[0])
    assert first.return_value() == 0
    assert follow[0].get_status() == "finished" and follow[0].return_value() == 5
    time.sleep(0.5)  # a second pass of the follow-up's id, if any, has ended without a run
    assert recorded(rc, name) == ["start0", "end0", "start5", "end5"]


def test_a_duplicate_of_a_queued_job_gets_the_original(
    workers: list[RqWorker], rc: redis.Redis
) -> None:
    """Queued (scheduled 2 s on): a duplicate gets that job, nothing is added."""
    q = coalescing(rc)
    name = label()
    held = label()
    blocker = q.enqueue(flow_jobs.run, held, 0, held)  # another identity, running meanwhile
    first = q.enqueue_in(timedelta(seconds=2), flow_jobs.run, name, 0)  # queued (scheduled)
    again = q.enqueue(flow_jobs.run, name, 1)
    assert first is not None and again is not None and again.id == first.id
    rc.set(f"go:{held}", 1)
    ended(blocker, first)
    assert recorded(rc, name) == ["start0", "end0"]


def test_a_burst_runs_once_after_wait_with_the_last_arguments(
    workers: list[RqWorker], rc: redis.Redis
) -> None:
    """Five jobs 0.2 s apart (wait=1.5): one run with the last argument, not before 1.5 s
    after the last call; the others FINISHED with the superseded marker; then the next burst
    runs again although until_expired keeps the identity done for 300 s."""
    q = debouncing(rc, Debounce(1.5))
    name = label()
    before = superseded(rc)
    jobs = []
    for n in range(5):
        if n:
            time.sleep(0.2)
        last_sent = time.monotonic()
        jobs.append(q.enqueue(flow_jobs.run, name, n))
    ended(*jobs)
    assert time.monotonic() - last_sent >= 1.5
    assert jobs[-1].return_value() == 4
    for job in jobs[:-1]:
        assert job.get_status() == "finished"
        assert superseded_of(job.return_value()) is not None
    assert recorded(rc, name) == ["start4", "end4"]
    wait_for(lambda: superseded(rc) >= before + 4, timeout=20, interval=0.5,
             what="the superseded jobs counted by the workers")
    # the next burst runs again, through until_expired's window
    nxt = q.enqueue(flow_jobs.run, name, 9)
    assert nxt is not None
    ended(nxt)
    assert nxt.return_value() == 9
    assert recorded(rc, name) == ["start4", "end4", "start9", "end9"]


def test_a_long_burst_runs_at_least_every_max_wait(
    workers: list[RqWorker], rc: redis.Redis
) -> None:
    """wait=1, max_wait=2.5, a job every 0.3 s for 6 s: the first run starts within max_wait
    (+ RQ's scheduler, which looks once a second) of the first call, mid-burst; the last
    call runs after the burst; never two at once."""
    q = debouncing(rc, Debounce(1.0, max_wait=2.5), mode="until_executed")
    name = label()
    jobs = []
    n = 0
    first_run: float | None = None
    first_sent = time.monotonic()
    while time.monotonic() - first_sent < 6.0:
        jobs.append(q.enqueue(flow_jobs.run, name, n))
        n += 1
        if first_run is None and recorded(rc, name):
            first_run = time.monotonic()
        time.sleep(0.3)
    assert first_run is not None and first_run - first_sent <= 2.5 + 2.0
    ended(*jobs)
    runs = [r for r in recorded(rc, name) if r.startswith("start")]
    assert "overlap" not in recorded(rc, name)
    assert 2 <= len(runs) <= 5, runs
    assert runs[-1] == f"start{n - 1}"
    assert jobs[-1].return_value() == n - 1


def test_a_restarted_worker_resurrects_no_superseded_job(
    rc: redis.Redis, redis_url: str
) -> None:
    """The burst's jobs wait scheduled; the only worker of their queue is stopped and a new
    one started (nothing in memory): only the last job runs."""
    own_queue = f"{QUEUE}-restart"
    q = DedupQueue(own_queue, connection=rc, dedup=Policy(
        mode="until_expired", ttl=300, lease=8, include=["label"], debounce=Debounce(1.5)))
    name = label()
    own = RqWorker(redis_url, [own_queue], scheduler=True).start()
    try:
        jobs = [q.enqueue(flow_jobs.run, name, n) for n in range(4)]
        own.stop()
        assert recorded(rc, name) == []
        own = RqWorker(redis_url, [own_queue], scheduler=True).start()
        ended(*jobs)
        assert jobs[-1].return_value() == 3
        assert all(superseded_of(j.return_value()) for j in jobs[:-1])
        assert recorded(rc, name) == ["start3", "end3"]
    finally:
        own.stop()
