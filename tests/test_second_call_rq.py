"""The second call waits instead of being skipped, with real RQ ``DedupWorker``s (two of
them, one with the scheduler; SPEC §15, issue #22).

- ``on_busy="wait"``: a job that finds its identity running is scheduled again (same job id,
  not a retry, not failed) and runs once the other has finished, with its own arguments,
  never beside another run of its identity.
- ``busy_timeout``: a job that has waited that long ends FAILED with
  :class:`taskdedup.BusyTimeoutError` naming the holder, without running.
- A SIGKILLed holder (its work-horse and its worker): its lock lapses within its lease and
  the waiting jobs then run, one at a time, never beside it.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import redis
from rq.job import Job

from taskdedup import Policy
from taskdedup.rq import DedupQueue
from taskdedup.testing import wait_for
from tests import second_call_jobs
from tests.effects import recorded
from tests.pairs import rq_pair
from tests.workers import RqWorker

pytestmark = pytest.mark.slow

QUEUE = f"rq-second-call-{os.getpid()}"


def label() -> str:
    return uuid.uuid4().hex[:12]


workers = rq_pair(QUEUE)


def queue(rc: redis.Redis, **policy: object) -> DedupQueue:
    return DedupQueue(QUEUE, connection=rc, dedup=Policy(
        mode="while_executing", lease=8, include=["label"], on_busy="wait", **policy))


def final(job: Job) -> bool:
    return job.get_status() in ("finished", "failed")


def test_every_waiting_job_runs_once_after_the_other_never_beside_it(
    workers: list[RqWorker], rc: redis.Redis
) -> None:
    """Four jobs of one identity: the first holds the body, the three others find it running,
    are scheduled again (not failed, not retries), then run one at a time, each with its own
    argument and result."""
    q = queue(rc)
    name = label()
    first = q.enqueue(second_call_jobs.hold, name, 0, True)
    wait_for(lambda: "start0" in recorded(rc, name), timeout=30, what="the first job runs")
    waiting = [q.enqueue(second_call_jobs.hold, name, n) for n in range(1, 4)]
    wait_for(lambda: all(j.get_status() == "scheduled" for j in waiting), timeout=30,
             interval=0.1, what="the three jobs scheduled again")
    for job in waiting:
        assert job.retries_left is None and job.id not in q.failed_job_registry.get_job_ids()
    assert recorded(rc, name) == ["start0"]
    rc.set(f"go:{name}", 1)
    for job in [first, *waiting]:
        wait_for(lambda job=job: final(job), timeout=60, what=f"job {job.id} ended")
    assert [job.get_status() for job in [first, *waiting]] == ["finished"] * 4
    assert [job.return_value() for job in [first, *waiting]] == [0, 1, 2, 3]
    runs = recorded(rc, name)
    assert "overlap" not in runs
    assert sorted(runs) == sorted([f"start{n}" for n in range(4)] + [f"end{n}" for n in range(4)])
    for i in range(0, len(runs), 2):  # one at a time: each start followed by its own end
        assert runs[i + 1] == "end" + runs[i].removeprefix("start")


def test_a_wait_past_busy_timeout_fails_clearly_and_never_runs(
    workers: list[RqWorker], rc: redis.Redis
) -> None:
    """busy_timeout=3: the holder runs until the test opens its gate; the waiting job ends
    FAILED with BusyTimeoutError naming the holder within ~2 s of its timeout, never run."""
    q = queue(rc, busy_timeout=3)
    name = label()
    holder = q.enqueue(second_call_jobs.hold, name, 0, True)
    wait_for(lambda: "start0" in recorded(rc, name), timeout=30, what="the holder runs")
    sent = time.monotonic()
    waiter = q.enqueue(second_call_jobs.hold, name, 1)
    wait_for(lambda: final(waiter), timeout=30, interval=0.1, what="the waiter ended")
    took = time.monotonic() - sent
    assert 3 <= took <= 6, took
    assert waiter.get_status() == "failed"
    result = waiter.latest_result()
    error = (result.exc_string if result is not None else None) or ""
    assert "BusyTimeoutError" in error and holder.id in error and "waited" in error
    assert recorded(rc, name) == ["start0"]
    rc.set(f"go:{name}", 1)
    wait_for(lambda: final(holder), timeout=30, what="the holder ended")
    assert holder.return_value() == 0 and "start1" not in recorded(rc, name)


def test_a_killed_holder_frees_its_waiting_jobs_within_its_lease(
    workers: list[RqWorker], rc: redis.Redis, redis_url: str
) -> None:
    """The holder runs on a worker of its own queue; its work-horse and that worker are
    SIGKILLed mid-body: its running lock is no longer renewed and lapses within its lease
    (8 s); the two jobs waiting for it (on the shared workers) then run, one at a time: the
    first within the lease plus a put-off (lease / 4) and RQ's scheduler (once a second) of
    the kill, the other within one more put-off and scheduler's second of it."""
    own = f"{QUEUE}-holder-{label()}"
    victim = RqWorker(redis_url, [own], scheduler=False).start()
    try:
        name = label()
        holder = DedupQueue(own, connection=rc, dedup=queue(rc).dedup_policy)  # same policy
        holder.enqueue(second_call_jobs.hold, name, 0, True)
        wait_for(lambda: "start0" in recorded(rc, name), timeout=30, what="the holder runs")
        q = queue(rc)
        waiting = [q.enqueue(second_call_jobs.hold, name, n) for n in (1, 2)]
        wait_for(lambda: all(j.get_status() == "scheduled" for j in waiting), timeout=30,
                 interval=0.1, what="the two jobs scheduled again")
        horse = int(rc.get(f"pid:{name}:0") or 0)
        assert horse > 0
        os.kill(horse, signal.SIGKILL)
        victim.kill()
        killed = time.monotonic()
        rc.decr(f"busy:{name}")  # the killed body's own decrement, which it never made
        # the first within the lease, a put-off (lease / 4), the scheduler's second and 2 s
        # of slack; the other, put off again while the first ran, one put-off and second later
        wait_for(lambda: any(final(job) for job in waiting), timeout=30, what="a job ended")
        first = time.monotonic() - killed
        assert first <= 8 + 2 + 1 + 2
        for job in waiting:
            wait_for(lambda job=job: final(job), timeout=30, what=f"job {job.id} ended")
        assert time.monotonic() - killed <= first + 2 + 1 + 2
        assert [job.get_status() for job in waiting] == ["finished"] * 2
        assert [job.return_value() for job in waiting] == [1, 2]
        runs = recorded(rc, name)
        assert runs[0] == "start0" and "end0" not in runs and "overlap" not in runs, runs
        rest = runs[1:]
        assert sorted(rest) == ["end1", "end2", "start1", "start2"], runs
        for i in range(0, len(rest), 2):  # one at a time: each start followed by its own end
            assert rest[i + 1] == "end" + rest[i].removeprefix("start"), runs
    finally:
        victim.kill()
