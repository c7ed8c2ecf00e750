"""A job's meta is input the worker does not trust (SPEC §8): the lock key it names is used only
when it is one the worker's deduplicator could have made for the job's own function
(``Deduplicator.trusted_key``); anything else is ignored with a WARNING that names no key and no
argument, and the identity is recomputed from the job's arguments. A claim Redis refuses for
what it is (NOPERM: the ACL user's key pattern) fails the job with a pointer to ``taskdedup
doctor``, never re-queued every few seconds forever. Real Redis (with an ACL user allowed only
``~taskdedup:*``) and real ``rq worker`` processes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import redis
from rq import Queue
from rq.job import Job

from taskdedup import Policy
from taskdedup.rq import META_KEY, DedupQueue
from taskdedup.rq.meta import meta_entry
from taskdedup.testing import wait_for
from tests import rq_jobs
from tests.workers import RqWorker

QUEUE = f"rq-trust-{os.getpid()}"
ACL_QUEUE = f"rq-trust-acl-{os.getpid()}"
OTHER_QUEUE = f"rq-trust-other-{os.getpid()}"
TERMINAL = ("finished", "failed", "canceled", "stopped")
WARNING = "carries a lock key in its meta that is not one of this task's"


def label() -> str:
    return uuid.uuid4().hex[:12]


def effects(rc: redis.Redis, name: str) -> list[str]:
    return [x.decode() for x in rc.lrange(f"effects:{name}", 0, -1)]


def own_key(rc: redis.Redis, name: str, prefix: str | None = None) -> str:
    queue = DedupQueue("keys", connection=rc, dedup_prefix=prefix)
    return queue.dedup.identity("tests.rq_jobs.record", Policy(), (name,),
                                func=rq_jobs.record).key


def lock(rc: redis.Redis, key: str) -> str:
    return (rc.get(key) or b"").decode()


def ended(job: Job, timeout: float = 30) -> str:
    return wait_for(lambda: (s := job.get_status()) in TERMINAL and s, timeout=timeout,
                    what=f"job {job.id} ended")


def ours(worker: RqWorker) -> str:
    """taskdedup's lines in the worker's output (RQ's own lines show job descriptions)."""
    return "\n".join(line for line in worker.output().splitlines() if " taskdedup: " in line)


def forged(rc: redis.Redis, queue: str, name: str, key: Any) -> Job:
    """A job of ``record(name)`` whose meta names ``key`` (enqueued by a plain Queue, as any
    client that can write jobs could)."""
    entry = meta_entry("tests.rq_jobs.record", "placeholder", Policy())
    entry["key"] = key
    return Queue(queue, connection=rc).enqueue(rq_jobs.record, name, meta={META_KEY: entry})


@pytest.fixture(scope="module")
def worker(redis_url: str, rc: redis.Redis) -> Iterator[RqWorker]:
    yield from RqWorker(redis_url, [QUEUE], scheduler=False).running()


@pytest.fixture(scope="module")
def acl_url(redis_url: str, rc: redis.Redis) -> Iterator[str]:
    """A Redis user allowed every command but only the keys ``taskdedup:*``."""
    user = f"td-trust-{label()}"
    rc.acl_setuser(user, reset=True, enabled=True, passwords=["+s3cret"],
                   keys=["taskdedup:*"], commands=["+@all"])
    address = urlparse(redis_url)
    try:
        yield f"redis://{user}:s3cret@{address.hostname}:{address.port}/0"
    finally:
        rc.acl_deluser(user)


def test_a_forged_key_of_another_task_is_ignored_and_the_job_runs_under_its_own(
    worker: RqWorker, rc: redis.Redis
) -> None:
    name, victim = label(), f"taskdedup:tests.rq_jobs.gated:{uuid.uuid4().hex}"
    rc.set(victim, "Q||victim-job", px=60_000)  # another task's queued call
    job = forged(rc, QUEUE, name, victim)
    assert ended(job) == "finished"
    assert effects(rc, name) == ["0"]  # ran (was: skipped as a duplicate of victim-job)
    assert lock(rc, victim) == "Q||victim-job"  # untouched
    assert lock(rc, own_key(rc, name)) == f"D||{job.id}"  # guarded under its own identity
    log = ours(worker)
    assert f"taskdedup: job {job.id} (tests.rq_jobs.record) {WARNING}" in log
    assert victim not in log and name not in log  # neither the key nor an argument


@pytest.mark.parametrize("carried", [12345, ["taskdedup", "x"], ""], ids=repr)
def test_a_key_that_is_not_a_str_is_recomputed_not_run_unguarded(
    worker: RqWorker, rc: redis.Redis, carried: Any
) -> None:
    name = label()
    job = forged(rc, QUEUE, name, carried)
    assert ended(job) == "finished" and effects(rc, name) == ["0"]
    assert lock(rc, own_key(rc, name)) == f"D||{job.id}"  # was: no lock at all
    assert f"{job.id} (tests.rq_jobs.record) {WARNING}" in worker.output()


def test_a_10_mb_key_never_reaches_redis(worker: RqWorker, rc: redis.Redis) -> None:
    name = label()
    huge = "taskdedup:tests.rq_jobs.record:" + "a" * (10 * 1024 * 1024)
    job = forged(rc, QUEUE, name, huge)
    assert ended(job) == "finished" and effects(rc, name) == ["0"]
    assert not rc.exists(huge)  # was: the claim wrote a 10 MB lock key
    assert lock(rc, own_key(rc, name)) == f"D||{job.id}"
    log = ours(worker)
    assert f"{job.id} (tests.rq_jobs.record) {WARNING} (a str of {len(huge)} characters)" in log
    assert "aaaaaaaaaa" not in worker.output()


def test_a_key_outside_the_prefix_is_ignored_under_an_acl_user_limited_to_the_prefix(
    redis_url: str, rc: redis.Redis, acl_url: str
) -> None:
    name = label()
    outside = own_key(rc, name, prefix="elsewhere")  # a well-formed key, another prefix
    worker = RqWorker(redis_url, [ACL_QUEUE], scheduler=False,
                      env={"TASKDEDUP_URL": acl_url}).start()
    try:
        job = forged(rc, ACL_QUEUE, name, outside)
        assert ended(job) == "finished"  # was: NOPERM, re-queued every 5 s forever
        assert effects(rc, name) == ["0"]
        assert lock(rc, own_key(rc, name)) == f"D||{job.id}"
        assert not rc.exists(outside)
    finally:
        worker.stop()
    assert WARNING in worker.output()


def test_a_claim_the_acl_refuses_fails_the_job_pointing_at_doctor_never_requeued_forever(
    redis_url: str, rc: redis.Redis, acl_url: str
) -> None:
    """Queue and worker agree on the prefix ``other``, which the worker's Redis user may not
    touch (``~taskdedup:*``): a configuration error, so the job fails — once, not run."""
    name = label()
    queue = DedupQueue(OTHER_QUEUE, connection=rc, dedup_prefix="other")
    worker = RqWorker(redis_url, [OTHER_QUEUE], scheduler=False,
                      env={"TASKDEDUP_URL": acl_url, "TASKDEDUP_PREFIX": "other"}).start()
    try:
        job = queue.enqueue(rq_jobs.record, name)
        assert job is not None
        assert ended(job) == "failed"  # was: "store unavailable", re-queued every 5 s
        failure = job.latest_result()
        assert failure is not None and "taskdedup doctor" in (failure.exc_string or "")
        assert "configuration error" in (failure.exc_string or "")
        assert effects(rc, name) == []  # never run unguarded
        assert queue.count == 0 and job.id in queue.failed_job_registry.get_job_ids()
    finally:
        worker.stop()
        rc.delete(own_key(rc, name, prefix="other"))
