"""``DedupQueue.enqueue_many`` is gated like ``enqueue`` (SPEC §7): the batch's reservations in
one round trip (``gate_many``), the job meta ``enqueue`` sets, duplicates answered per
``on_duplicate`` — another call of the same batch included — and all or nothing when a call is
refused. Real Redis; a real ``rq worker`` runs two identical calls of one batch once."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.connection import Connection
from rq import Queue
from rq.job import Job

from taskdedup import DuplicateTaskError, IdempotencyKeyMismatch, Policy, StoreUnavailableError
from taskdedup.rq import META_KEY, DedupQueue
from taskdedup.rq.meta import meta_entry
from taskdedup.testing import free_port, wait_for
from tests import rq_jobs
from tests.workers import RqWorker

QUEUE = f"rq-many-{os.getpid()}"


def label() -> str:
    return uuid.uuid4().hex[:12]


def effects(rc: redis.Redis, name: str) -> list[str]:
    return [x.decode() for x in rc.lrange(f"effects:{name}", 0, -1)]


def key_of(queue: DedupQueue, *args: Any, policy: Policy | None = None) -> str:
    return queue.dedup.identity("tests.rq_jobs.record", policy or Policy(), args,
                                func=rq_jobs.record).key


def lock(rc: redis.Redis, key: str) -> str:
    return (rc.get(key) or b"").decode()


@pytest.fixture
def idle(rc: redis.Redis) -> Iterator[DedupQueue]:
    """A queue no worker listens on: jobs stay queued."""
    queue = DedupQueue(f"rq-many-idle-{label()}", connection=rc, dedup=Policy(ttl=60))
    yield queue
    queue.empty()


def test_two_identical_calls_in_one_batch_are_one_job_that_a_real_worker_runs_once(
    rc: redis.Redis, redis_url: str
) -> None:
    q = DedupQueue(QUEUE, connection=rc, dedup=Policy(ttl=60))
    name = label()
    jobs = q.enqueue_many([q.prepare_data(rq_jobs.record, (name,)),
                           q.prepare_data(rq_jobs.record, (name,)),
                           q.prepare_data(rq_jobs.record, (), {"label": name, "n": 0})])
    assert len(jobs) == 3 and all(job is not None for job in jobs)
    assert len({job.id for job in jobs if job is not None}) == 1
    assert q.count == 1
    worker = RqWorker(redis_url, [QUEUE], scheduler=False).start()
    try:
        first = jobs[0]
        assert first is not None
        wait_for(lambda: first.get_status() in ("finished", "failed"), timeout=30,
                 what="the batch's job ran")
        assert first.get_status() == "finished"
        assert effects(rc, name) == ["0"]
        assert lock(rc, key_of(q, name)) == f"D||{first.id}"
    finally:
        worker.stop()


def test_a_batch_sets_the_job_meta_enqueue_sets_and_answers_a_queued_original(
    idle: DedupQueue, rc: redis.Redis
) -> None:
    name, other = label(), label()
    original = idle.enqueue(rq_jobs.record, name)
    assert original is not None
    jobs = idle.enqueue_many([
        idle.prepare_data(rq_jobs.record, (name,)),  # a duplicate of a job outside the batch
        idle.prepare_data(rq_jobs.record, (other,), meta={"mine": 1}),
    ])
    assert jobs[0] is not None and jobs[0].id == original.id
    assert jobs[0].args == (name,)  # the original's job, read back
    new = jobs[1]
    assert new is not None
    stored = Job.fetch(new.id, connection=rc)
    assert stored.meta == {"mine": 1, META_KEY: meta_entry(
        "tests.rq_jobs.record", key_of(idle, other), Policy(ttl=60))}
    assert original.meta[META_KEY]["key"] == key_of(idle, name)
    assert lock(rc, key_of(idle, other)) == f"Q||{new.id}"
    assert idle.count == 2


def test_on_duplicate_drop_gives_none_and_raise_refuses_the_whole_batch(
    idle: DedupQueue, rc: redis.Redis
) -> None:
    name, fresh = label(), label()
    dropped = idle.enqueue_many([
        idle.prepare_data(rq_jobs.record, (name,), dedup={"on_duplicate": "drop"}),
        idle.prepare_data(rq_jobs.record, (name,), dedup={"on_duplicate": "drop"}),
    ])
    assert dropped[0] is not None and dropped[1] is None and idle.count == 1
    with pytest.raises(DuplicateTaskError) as refused:
        idle.enqueue_many([
            idle.prepare_data(rq_jobs.record, (fresh,)),
            idle.prepare_data(rq_jobs.record, (name,), dedup={"on_duplicate": "raise"}),
        ])
    assert refused.value.existing_id == dropped[0].id
    assert idle.count == 1  # nothing of the refused batch was enqueued
    assert not rc.exists(key_of(idle, fresh))  # and its reservation was taken back


def test_a_duplicate_carrying_depends_on_raises_and_a_mismatched_dedup_key_refuses(
    idle: DedupQueue, rc: redis.Redis
) -> None:
    name = label()
    first = idle.enqueue(rq_jobs.record, name)
    assert first is not None
    with pytest.raises(DuplicateTaskError, match="depends_on"):
        idle.enqueue_many([idle.prepare_data(rq_jobs.record, (name,), depends_on=first)])
    ref = f"ORD-{label()}"
    keyed = idle.enqueue_many([idle.prepare_data(rq_jobs.record, (name, 1), dedup_key=ref),
                               idle.prepare_data(rq_jobs.record, (name, 1), dedup_key=ref)])
    assert keyed[0] is not None and keyed[1] is not None and keyed[0].id == keyed[1].id
    with pytest.raises(IdempotencyKeyMismatch):
        idle.enqueue_many([idle.prepare_data(rq_jobs.record, (name, 2), dedup_key=ref)])
    assert idle.count == 2


def test_dedup_false_and_an_ungated_queue_enqueue_every_call(
    idle: DedupQueue, rc: redis.Redis
) -> None:
    name = label()
    jobs = idle.enqueue_many([idle.prepare_data(rq_jobs.record, (name,), dedup=False)] * 2)
    assert len({job.id for job in jobs if job is not None}) == 2
    assert all(job is not None and job.meta[META_KEY] == {"off": True} for job in jobs)
    assert not rc.exists(key_of(idle, name))
    off = DedupQueue(f"rq-many-off-{label()}", connection=rc, dedup=False)
    try:
        plain = off.enqueue_many([Queue.prepare_data(rq_jobs.record, (name,))] * 2)
        assert len({job.id for job in plain if job is not None}) == 2
    finally:
        off.empty()


def test_the_batch_reserves_in_one_round_trip_whatever_its_size(
    rc: redis.Redis, redis_url: str
) -> None:
    sends = []

    class Counting(Connection):
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            if threading.current_thread() is threading.main_thread():
                sends.append(1)
            super().send_packed_command(command, check_health)

    client = redis.Redis.from_url(redis_url, connection_class=Counting)
    q = DedupQueue(f"rq-many-rt-{label()}", connection=client, dedup=Policy(ttl=60))
    try:
        q.enqueue(rq_jobs.record, label())  # the first use loads scripts and checks the server

        def round_trips(n: int) -> int:
            before = len(sends)
            jobs = q.enqueue_many([q.prepare_data(rq_jobs.record, (label(),))
                                   for _ in range(n)])
            assert len({job.id for job in jobs if job is not None}) == n
            return len(sends) - before

        assert round_trips(2) == round_trips(40) == 2  # the reservations, RQ's own pipeline
    finally:
        q.empty()
        client.close()


def test_a_stale_lock_of_a_vanished_job_heals_and_the_batch_call_is_enqueued(
    idle: DedupQueue, rc: redis.Redis
) -> None:
    name = label()
    key = key_of(idle, name)
    rc.set(key, "Q||vanished-job", px=60_000)  # its job was deleted by plain RQ
    idle.heal_grace = 0.05
    jobs = idle.enqueue_many([idle.prepare_data(rq_jobs.record, (name,))])
    assert jobs[0] is not None and jobs[0].id != "vanished-job"
    assert lock(rc, key) == f"Q||{jobs[0].id}"


def test_a_live_explicit_job_id_is_a_duplicate_of_itself_and_repeats_are_refused(
    idle: DedupQueue, rc: redis.Redis
) -> None:
    name, job_id = label(), f"job-{label()}"
    first = idle.enqueue_many([idle.prepare_data(rq_jobs.record, (name,), job_id=job_id)])
    again = idle.enqueue_many([idle.prepare_data(rq_jobs.record, (name,), job_id=job_id)])
    assert first[0] is not None and again[0] is not None and again[0].id == job_id
    assert idle.count == 1
    with pytest.raises(ValueError, match="more than once"):
        idle.enqueue_many([idle.prepare_data(rq_jobs.record, (label(),), job_id="twice"),
                           idle.prepare_data(rq_jobs.record, (label(),), job_id="twice")])


def test_a_pipeline_is_refused_with_the_gate_and_the_store_down_refuses_the_batch(
    idle: DedupQueue, rc: redis.Redis
) -> None:
    with rc.pipeline() as pipe, pytest.raises(ValueError, match="pipeline="):
        idle.enqueue_many([idle.prepare_data(rq_jobs.record, (label(),))], pipeline=pipe)
    down = DedupQueue(idle.name, connection=rc, dedup=Policy(ttl=60),
                      dedup_store=f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(StoreUnavailableError):
        down.enqueue_many([down.prepare_data(rq_jobs.record, (label(),))])
    assert idle.count == 0


def test_replace_in_one_batch_keeps_the_last_call(idle: DedupQueue, rc: redis.Redis) -> None:
    name = label()
    policy = {"on_duplicate": "replace"}
    jobs = idle.enqueue_many([idle.prepare_data(rq_jobs.record, (name,), dedup=policy),
                              idle.prepare_data(rq_jobs.record, (name,), dedup=policy)])
    assert jobs[0] is not None and jobs[1] is not None and jobs[0].id == jobs[1].id
    assert idle.count == 1 and idle.job_ids == [jobs[1].id]
    assert lock(rc, key_of(idle, name)) == f"Q||{jobs[1].id}"
