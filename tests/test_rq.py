"""RQ integration against a real Redis and real ``rq worker`` subprocesses (DedupWorker)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
import rq.exceptions
from redis.connection import AbstractConnection
from rq import Callback, Queue, Repeat
from rq.job import Job, Retry, cancel_job

from taskdedup import (
    ConfigurationError,
    DuplicateTaskError,
    IdempotencyKeyMismatch,
    Policy,
    StoreUnavailableError,
)
from taskdedup.rq import DedupJob, DedupQueue, skipped_info
from taskdedup.testing import free_port, wait_for
from tests import rq_jobs
from tests.effects import released
from tests.workers import RqWorker

QUEUE = f"rq-main-{os.getpid()}"
TERMINAL = ("finished", "failed", "canceled", "stopped")


@pytest.fixture(scope="module")
def workers(redis_url: str, rc: redis.Redis) -> Iterator[list[RqWorker]]:
    """Two workers (so one job can run while a duplicate is executed), one scheduler."""
    started = [RqWorker(redis_url, [QUEUE]).start()]
    try:
        started.append(RqWorker(redis_url, [QUEUE]).start())
        yield started
    finally:
        for w in started:
            w.stop()


@pytest.fixture
def q(rc: redis.Redis) -> DedupQueue:
    return DedupQueue(QUEUE, connection=rc, dedup=Policy(ttl=60))


@pytest.fixture
def idle(rc: redis.Redis) -> Iterator[DedupQueue]:
    """A queue no worker listens on: jobs stay queued."""
    queue = DedupQueue(f"rq-idle-{uuid.uuid4().hex[:8]}", connection=rc, dedup=Policy(ttl=60))
    yield queue
    queue.empty()


def label() -> str:
    return uuid.uuid4().hex[:12]


def effects(rc: redis.Redis, name: str) -> list[str]:
    return [x.decode() for x in rc.lrange(f"effects:{name}", 0, -1)]


def key_of(queue: DedupQueue, func: Callable[..., Any], *args: Any,
           policy: Policy | None = None, **kwargs: Any) -> str:
    name = f"{func.__module__}.{func.__qualname__}"
    return queue.dedup.identity(name, policy or Policy(), args, kwargs, func=func).key


def lock(rc: redis.Redis, key: str) -> str:
    return (rc.get(key) or b"").decode()


def lock_keys(rc: redis.Redis, func: Callable[..., Any]) -> list[bytes]:
    return list(rc.scan_iter(match=f"taskdedup:{func.__module__}.{func.__qualname__}:*"))


def ended(job: Job | None, timeout: float = 30) -> str:
    assert job is not None
    return wait_for(lambda: (s := job.get_status()) in TERMINAL and s, timeout=timeout,
                    what=f"job {job.id} ended")


# -- the enqueue gate and one execution ------------------------------------------------------


@pytest.mark.slow
def test_duplicate_enqueue_returns_the_original_job_and_runs_once(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    name = label()
    jobs = [q.enqueue(rq_jobs.record, name) for _ in range(3)]
    jobs.append(q.enqueue(rq_jobs.record, label=name, n=0))  # bound: the same call
    assert len({j.id for j in jobs if j is not None}) == 1
    first = jobs[0]
    assert ended(first) == "finished"
    assert first is not None and first.return_value() == f"{name}:0"
    assert effects(rc, name) == ["0"]
    key = key_of(q, rq_jobs.record, name)
    assert lock(rc, key) == f"D||{first.id}"  # until_expired: kept for ttl after success
    again = q.enqueue(rq_jobs.record, name)
    assert again is not None and again.id == first.id


def test_work_horses_hand_their_counts_to_the_worker_process_which_flushes_them(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    """A forked horse ends with os._exit; its counters travel to the worker over a pipe and
    reach Redis with the worker's periodic flush (no stats round trip per job)."""
    jobs = [q.enqueue(rq_jobs.counted, label()) for _ in range(3)]
    assert all(job is not None and ended(job) == "finished" for job in jobs)
    key = "taskdedup:stats:tests.rq_jobs.counted"

    def counts() -> dict[str, int]:
        return {k.decode(): int(v) for k, v in rc.hgetall(key).items()}

    wait_for(lambda: counts().get("completed") == 3, timeout=30,
             what="the workers' flush of their horses' counts")
    assert counts()["claimed"] == 3


def _enqueue_same(url: str, queue: str, name: str, barrier: Any, out: Any) -> None:
    client = redis.Redis.from_url(url)
    dq = DedupQueue(queue, connection=client, dedup=Policy(ttl=60))
    barrier.wait(timeout=30)
    job = dq.enqueue(rq_jobs.record, name, 7)
    out.put(job.id if job is not None else None)


@pytest.mark.slow
def test_concurrent_enqueues_from_processes_give_one_job_id_and_one_execution(
    workers: list[RqWorker], rc: redis.Redis, redis_url: str
) -> None:
    name = label()
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(6), ctx.Queue()
    procs = [ctx.Process(target=_enqueue_same, args=(redis_url, QUEUE, name, barrier, out))
             for _ in range(6)]
    for p in procs:
        p.start()
    ids = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert len(set(ids)) == 1 and ids[0] is not None
    assert ended(Job.fetch(ids[0], connection=rc)) == "finished"
    assert effects(rc, name) == ["7"]


@pytest.mark.slow
def test_failure_releases_the_lock_so_the_same_call_runs_again(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    name = label()
    first = q.enqueue(rq_jobs.fail_first, name)
    assert ended(first) == "failed"
    key = key_of(q, rq_jobs.fail_first, name)
    wait_for(lambda: not rc.exists(key), timeout=10, what="lock released after failure")
    second = q.enqueue(rq_jobs.fail_first, name)
    assert second is not None and first is not None and second.id != first.id
    assert ended(second) == "finished"
    assert effects(rc, name) == ["1", "2"]


@pytest.mark.parametrize("outcome", ["success", "failure"])
def test_a_callback_that_enqueues_the_same_call_again_has_it_run(
    workers: list[RqWorker], rc: redis.Redis, outcome: str
) -> None:
    """until_executed: the job's own ``on_success`` / ``on_failure`` callback enqueues the
    same call again; the lock is completed (released) as the function returns (raises), before
    RQ runs the callback, so that call runs — it is not dropped as a duplicate of the job
    that has just executed."""
    name = label()
    queue = DedupQueue(QUEUE, connection=rc, dedup=Policy(mode="until_executed", ttl=60))
    func = rq_jobs.record if outcome == "success" else rq_jobs.fail_first
    callback = {f"on_{outcome}": Callback(rq_jobs.enqueue_again_once)}
    first = queue.enqueue(func, name, **callback)
    assert first is not None
    again = wait_for(lambda: rc.lrange(f"again-id:{name}", 0, -1), timeout=30,
                     what="the callback enqueued the call again")
    assert again[0].decode() != first.id
    wait_for(lambda: len(effects(rc, name)) == 2, timeout=30, what="the call ran again")


@pytest.mark.slow
def test_retry_runs_and_a_third_party_duplicate_during_its_interval_is_suppressed(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    name = label()
    first = q.enqueue(rq_jobs.fail_first, name, retry=Retry(max=1, interval=2))
    assert first is not None
    wait_for(lambda: first.get_status() == "scheduled" and effects(rc, name) == ["1"],
             timeout=30, what="first attempt failed, retry scheduled")
    key = key_of(q, rq_jobs.fail_first, name)
    assert lock(rc, key) == f"Q||{first.id}"  # re-reserved for the same job id
    assert rc.pttl(key) > 60_000  # ttl (60 s) + the retry interval (2 s), minus a moment
    third_party = q.enqueue(rq_jobs.fail_first, name)
    assert third_party is not None and third_party.id == first.id
    assert ended(first) == "finished"  # the retry ran: never swallowed
    assert effects(rc, name) == ["1", "2"]
    assert lock(rc, key) == f"D||{first.id}"


def test_stats_count_a_retry_as_a_retry_not_as_an_accepted_enqueue(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    """#24 stumble 7: the retry's re-reservation of its own lock is a retry, not a second
    accepted enqueue."""
    from tests.effects import enqueue_figures, flush_counts

    task = f"{rq_jobs.fail_first_counted.__module__}.{rq_jobs.fail_first_counted.__name__}"

    def figures() -> tuple[int, int, int]:
        return enqueue_figures(rc, task)

    before = figures()
    name = label()
    first = q.enqueue(rq_jobs.fail_first_counted, name, retry=Retry(max=1, interval=1))
    assert first is not None
    duplicate = q.enqueue(rq_jobs.fail_first_counted, name, retry=Retry(max=1, interval=1))
    assert duplicate is not None and duplicate.id == first.id
    assert ended(first) == "finished" and effects(rc, name) == ["1", "2"]
    assert flush_counts(q.dedup)
    wait_for(lambda: figures()[2] > before[2], timeout=30, what="the worker's retry counted")
    assert tuple(now - then for now, then in zip(figures(), before, strict=True)) == (1, 1, 1)


@pytest.mark.slow
def test_a_returned_retry_runs_and_keeps_the_lock_for_its_interval(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    name = label()
    first = q.enqueue(rq_jobs.return_retry_first, name)
    assert first is not None
    wait_for(lambda: first.get_status() == "scheduled", timeout=30, what="retry scheduled")
    key = key_of(q, rq_jobs.return_retry_first, name)
    assert lock(rc, key) == f"Q||{first.id}"
    duplicate = q.enqueue(rq_jobs.return_retry_first, name)
    assert duplicate is not None and duplicate.id == first.id
    assert ended(first) == "finished"
    assert first.return_value() == name
    assert effects(rc, name) == ["1", "2"]


@pytest.mark.slow
def test_until_expired_window_suppresses_then_lets_the_call_run_again(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    name, short = label(), {"ttl": 2}
    first = q.enqueue(rq_jobs.record, name, dedup=short)
    assert first is not None and ended(first) == "finished"
    key = key_of(q, rq_jobs.record, name)
    assert lock(rc, key) == f"D||{first.id}"
    duplicate = q.enqueue(rq_jobs.record, name, dedup=short)
    assert duplicate is not None and duplicate.id == first.id
    wait_for(lambda: not rc.exists(key), timeout=10, what="window (ttl=2s) over")
    second = q.enqueue(rq_jobs.record, name, dedup=short)
    assert second is not None and second.id != first.id
    assert ended(second) == "finished"
    assert effects(rc, name) == ["0", "0"]


@pytest.mark.slow
def test_enqueue_in_reserves_ttl_plus_the_delay_and_the_scheduler_runs_it_once(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    name, short = label(), {"ttl": 2}
    job = q.enqueue_in(timedelta(seconds=3), rq_jobs.record, name, dedup=short)
    assert job is not None and job.get_status() == "scheduled"
    key = key_of(q, rq_jobs.record, name)
    assert rc.pttl(key) > 4_500  # ttl 2 s + delay 3 s: the bare ttl would end before it runs
    duplicate = q.enqueue(rq_jobs.record, name, dedup=short)
    assert duplicate is not None and duplicate.id == job.id
    assert ended(job) == "finished"
    assert effects(rc, name) == ["0"]


@pytest.mark.slow
def test_enqueue_at_reserves_ttl_plus_the_delay_and_runs_once(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    name = label()
    when = datetime.now(UTC) + timedelta(seconds=2)
    job = q.enqueue_at(when, rq_jobs.record, name, 5)
    key = key_of(q, rq_jobs.record, name, 5)
    assert rc.pttl(key) > 61_000  # ttl 60 s + delay 2 s
    duplicate = q.enqueue_at(when, rq_jobs.record, name, n=5)
    assert job is not None and duplicate is not None and duplicate.id == job.id
    assert ended(job) == "finished"
    assert effects(rc, name) == ["5"]


@pytest.mark.slow
def test_heartbeat_keeps_the_lock_of_a_job_longer_than_its_lease(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    name, policy = label(), {"mode": "until_executed", "lease": 1}
    job = q.enqueue(rq_jobs.long_running, name, dedup=policy)
    assert job is not None
    key = key_of(q, rq_jobs.long_running, name)
    wait_for(lambda: effects(rc, name), timeout=30, what="job started")
    started = time.monotonic()
    try:
        while time.monotonic() - started < 3.0:  # three leases of 1 s
            assert lock(rc, key) == f"R||{job.id}", "running lock lost"
            duplicate = q.enqueue(rq_jobs.long_running, name, dedup=policy)
            assert duplicate is not None and duplicate.id == job.id
            time.sleep(0.1)
    finally:
        rc.set(f"go:{name}", 1)
    assert ended(job) == "finished"
    wait_for(lambda: released(rc, key), timeout=10, what="released after success")


@pytest.mark.slow
def test_a_repeating_job_keeps_its_lock_between_runs_and_every_repeat_runs(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    name = label()
    job = q.enqueue(rq_jobs.record, name, repeat=Repeat(times=2, interval=0))
    assert job is not None
    wait_for(lambda: effects(rc, name) == ["0", "0", "0"], timeout=30, what="three runs")
    assert ended(job) == "finished"
    key = key_of(q, rq_jobs.record, name)
    wait_for(lambda: lock(rc, key) == f"D||{job.id}", timeout=10, what="done after the last")
    duplicate = q.enqueue(rq_jobs.record, name)
    assert duplicate is not None and duplicate.id == job.id


# -- modes -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_until_executing_releases_the_lock_when_the_job_starts(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    name, policy = label(), {"mode": "until_executing"}
    first = q.enqueue(rq_jobs.gated, name, dedup=policy)
    try:
        wait_for(lambda: effects(rc, name) == ["start"], timeout=30, what="first started")
        second = q.enqueue(rq_jobs.gated, name, dedup=policy)  # first has started: accepted
        assert first is not None and second is not None and second.id != first.id
    finally:
        rc.set(f"go:{name}", 1)
    assert ended(first) == "finished" and ended(second) == "finished"
    assert effects(rc, name).count("start") == 2


@pytest.mark.slow
def test_while_executing_skips_a_concurrent_duplicate_as_finished_not_failed_without_callbacks(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    name, policy = label(), {"mode": "while_executing"}
    callback = Callback(rq_jobs.on_success_cb)
    one = q.enqueue(rq_jobs.gated, name, dedup=policy, on_success=callback)
    assert one is not None
    try:
        wait_for(lambda: effects(rc, name) == ["start"], timeout=30, what="first started")
        two = q.enqueue(rq_jobs.gated, name, dedup=policy, on_success=callback)
        assert two is not None and two.id != one.id  # not gated at enqueue...
        assert ended(two) == "finished"  # ...but skipped at execution, not failed
        assert skipped_info(Job.fetch(two.id, connection=rc)) == {
            "existing_id": one.id, "state": "running"
        }
        assert two.return_value() == {"SKIPPED": f"duplicate of {one.id} (running)",
                                      "taskdedup": "skipped duplicate",
                                      "existing_id": one.id, "state": "running"}
        assert two.id not in q.failed_job_registry
        assert rc.lrange(f"callbacks:{two.id}", 0, -1) == []  # the body did not run
    finally:
        rc.set(f"go:{name}", 1)
    assert ended(one) == "finished"
    assert effects(rc, name) == ["start", "end"]
    wait_for(lambda: rc.lrange(f"callbacks:{one.id}", 0, -1) == [b"success"], timeout=10)
    three = q.enqueue(rq_jobs.gated, name, dedup=policy)  # released when finished: runs
    assert ended(three) == "finished"
    assert effects(rc, name) == ["start", "end", "start", "end"]


@pytest.mark.slow
def test_replace_cancels_the_queued_original_and_takes_its_place(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    name = label()
    policy = {"mode": "until_executed", "include": ["label"], "on_duplicate": "replace"}
    old = q.enqueue_in(timedelta(seconds=30), rq_jobs.record, name, 1, dedup=policy)
    new = q.enqueue(rq_jobs.record, name, 2, dedup=policy)
    assert old is not None and new is not None and new.id != old.id
    assert old.get_status() == "canceled"
    assert ended(new) == "finished"
    assert effects(rc, name) == ["2"]


@pytest.mark.slow
def test_replace_of_a_started_original_raises_duplicate_task_error(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    name, policy = label(), {"mode": "until_executed", "on_duplicate": "replace"}
    original = q.enqueue(rq_jobs.gated, name, dedup=policy)
    assert original is not None
    try:
        wait_for(lambda: effects(rc, name) == ["start"], timeout=30, what="original started")
        with pytest.raises(DuplicateTaskError, match="already started") as info:
            q.enqueue(rq_jobs.gated, name, dedup=policy)
        assert info.value.existing_id == original.id
    finally:
        rc.set(f"go:{name}", 1)
    assert ended(original) == "finished"


def test_on_duplicate_raise_and_drop(
    idle: DedupQueue, rc: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    name = label()
    first = idle.enqueue(rq_jobs.record, name, dedup={"on_duplicate": "raise"})
    assert first is not None
    with pytest.raises(DuplicateTaskError) as info:
        idle.enqueue(rq_jobs.record, name, dedup={"on_duplicate": "raise"})
    assert info.value.existing_id == first.id
    assert info.value.key.startswith("taskdedup:tests.rq_jobs.record:")
    with caplog.at_level(logging.DEBUG, logger="taskdedup"):
        assert idle.enqueue(rq_jobs.record, name, dedup={"on_duplicate": "drop"}) is None
    assert any("dropped duplicate" in r.getMessage() and r.levelno == logging.DEBUG
               for r in caplog.records)
    assert idle.count == 1


# -- per-call options ------------------------------------------------------------------------


@pytest.mark.slow
def test_dedup_false_bypasses_the_gate_and_the_worker_guard(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    name = label()
    a = q.enqueue(rq_jobs.record, name, dedup=False)
    b = q.enqueue(rq_jobs.record, name, dedup=False)
    assert a is not None and b is not None and a.id != b.id
    assert a.meta["taskdedup"] == {"off": True}
    assert ended(a) == "finished" and ended(b) == "finished"
    assert effects(rc, name) == ["0", "0"]
    assert not rc.exists(key_of(q, rq_jobs.record, name))


@pytest.mark.slow
def test_dedup_key_dedups_and_a_reuse_with_other_arguments_raises_idempotency_key_mismatch(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    name, key = label(), f"ORD-{label()}"
    a = q.enqueue(rq_jobs.record, name, 1, dedup_key=key)
    b = q.enqueue(rq_jobs.record, name, 1, dedup_key=key)
    assert a is not None and b is not None and a.id == b.id
    with pytest.raises(IdempotencyKeyMismatch) as info:
        q.enqueue(rq_jobs.record, name, 2, dedup_key=key)
    assert info.value.existing_id == a.id
    assert ended(a) == "finished"
    assert effects(rc, name) == ["1"]


@pytest.mark.slow
def test_dedup_kwargs_never_reach_the_function(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    a, b, c = label(), label(), label()
    jobs = [
        q.enqueue(rq_jobs.echo_kwargs, a, x=1, dedup={"ttl": 30}, dedup_key=a),
        q.enqueue_call(rq_jobs.echo_kwargs, args=(b,), kwargs={"y": 2}, dedup={"ttl": 30},
                       dedup_key=b),
        q.enqueue_in(timedelta(seconds=0), rq_jobs.echo_kwargs, c, dedup={"ttl": 30},
                     dedup_key=c),
    ]
    assert [ended(j) for j in jobs] == ["finished"] * 3
    assert (effects(rc, a), effects(rc, b), effects(rc, c)) == (["x"], ["y"], ["-"])


def test_a_duplicate_carrying_callbacks_or_depends_on_raises_and_enqueues_nothing(
    idle: DedupQueue,
) -> None:
    name = label()
    first = idle.enqueue(rq_jobs.record, name)
    assert first is not None
    workflows: list[dict[str, Any]] = [
        {"on_success": Callback(rq_jobs.on_success_cb)},
        {"on_failure": Callback(rq_jobs.on_success_cb)},
        {"on_stopped": Callback(rq_jobs.on_success_cb)},
        {"depends_on": first.id},
    ]
    for options in workflows:
        with pytest.raises(DuplicateTaskError, match=next(iter(options))) as info:
            idle.enqueue(rq_jobs.record, name, **options)
        assert info.value.existing_id == first.id
    assert idle.count == 1


def test_unserializable_arguments_are_refused_with_nothing_enqueued(
    idle: DedupQueue, rc: redis.Redis
) -> None:
    locks = len(lock_keys(rc, rq_jobs.record))
    with pytest.raises(TypeError, match=r"kwargs\['n'\]"):
        idle.enqueue(rq_jobs.record, "x", n=object())
    with pytest.raises(TypeError, match=r"kwargs\['label'\]"):
        idle.enqueue(rq_jobs.record, lambda: 1)
    with pytest.raises(TypeError, match=r"kwargs\['n'\]"):
        idle.enqueue_in(timedelta(seconds=5), rq_jobs.record, "x", n=float("nan"))
    assert idle.count == 0
    assert idle.scheduled_job_registry.count == 0
    assert len(lock_keys(rc, rq_jobs.record)) == locks


def test_lock_store_down_raise_refuses_and_allow_enqueues_with_a_warning(
    rc: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    name = f"rq-down-{label()}"
    strict = DedupQueue(name, connection=rc, dedup_store=dead)
    with pytest.raises(StoreUnavailableError, match=r"127\.0\.0\.1"):
        strict.enqueue(rq_jobs.record, "x")
    assert strict.count == 0
    lenient = DedupQueue(name, connection=rc, dedup_store=dead,
                         dedup={"on_store_error": "allow"})
    with caplog.at_level(logging.WARNING, logger="taskdedup"):
        job = lenient.enqueue(rq_jobs.record, "x")
    assert job is not None and lenient.count == 1
    assert any("WITHOUT dedup" in r.getMessage() for r in caplog.records)
    lenient.empty()


def test_a_publish_failure_releases_the_reservation_before_the_error_reaches_the_caller(
    rc: redis.Redis, redis_url: str
) -> None:
    broker_down = redis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")
    q = DedupQueue(f"rq-nobroker-{label()}", connection=broker_down, dedup_store=redis_url)
    name = label()
    with pytest.raises(redis.exceptions.ConnectionError):
        q.enqueue(rq_jobs.record, name)
    assert not rc.exists(key_of(q, rq_jobs.record, name))  # reserved, then released


def test_a_one_round_trip_enqueue_whose_rq_command_fails_leaves_no_lock_and_says_why(
    rc: redis.Redis,
) -> None:
    """Reserve + RQ's job write + push are one script: when one of RQ's commands fails there
    (here the queue's key holds a string), the reservation made by that call is deleted and
    the caller gets the error — no lock left to suppress the retry."""
    q = DedupQueue(f"rq-wrongtype-{label()}", connection=rc, dedup=Policy(ttl=60))
    name = label()
    rc.set(q.key, "not a list")
    try:
        with pytest.raises(StoreUnavailableError, match="WRONGTYPE"):
            q.enqueue(rq_jobs.record, name)
        assert not rc.exists(key_of(q, rq_jobs.record, name))
        rc.delete(q.key)
        job = q.enqueue(rq_jobs.record, name)  # the retry is enqueued
        assert job is not None and q.job_ids == [job.id]
    finally:
        rc.delete(q.key)


def test_a_queue_user_without_script_permission_follows_on_store_error(
    rc: redis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The one-round-trip enqueue refused by Redis (an ACL without EVALSHA/EVAL) ran nothing:
    ``raise`` enqueues nothing, ``allow`` enqueues with RQ's own commands and a warning."""
    user = f"noscript-{label()}"
    rc.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                   commands=["+@all", "-evalsha", "-eval"])
    client = redis.Redis.from_url(redis_url.replace("redis://", f"redis://{user}:pw@"))
    name = f"rq-noscript-{label()}"
    try:
        strict = DedupQueue(name, connection=client)
        with pytest.raises(StoreUnavailableError, match="lacks a permission"):
            strict.enqueue(rq_jobs.record, "x")
        assert strict.count == 0
        lenient = DedupQueue(name, connection=client, dedup={"on_store_error": "allow"})
        with caplog.at_level(logging.WARNING, logger="taskdedup"):
            job = lenient.enqueue(rq_jobs.record, "x")
        assert job is not None and lenient.job_ids == [job.id]
        assert any("WITHOUT dedup" in r.getMessage() for r in caplog.records)
    finally:
        DedupQueue(name, connection=rc).empty()
        client.close()
        rc.acl_deluser(user)


# -- RQ's own job management -----------------------------------------------------------------


def test_cancel_and_delete_of_a_queued_dedup_job_release_its_reservation(
    idle: DedupQueue, rc: redis.Redis
) -> None:
    a, b = label(), label()
    ja = idle.enqueue(rq_jobs.record, a)
    jb = idle.enqueue(rq_jobs.record, b)
    assert isinstance(ja, DedupJob) and isinstance(jb, DedupJob)
    key_a, key_b = key_of(idle, rq_jobs.record, a), key_of(idle, rq_jobs.record, b)
    assert lock(rc, key_a) == f"Q||{ja.id}" and lock(rc, key_b) == f"Q||{jb.id}"
    ja.cancel()
    assert not rc.exists(key_a)
    fetched = DedupJob.fetch(jb.id, connection=rc)  # as the CLI / a dashboard would
    fetched.delete()
    assert not rc.exists(key_b)
    again = idle.enqueue(rq_jobs.record, a)
    assert again is not None and again.id != ja.id


def test_a_stale_lock_whose_job_was_deleted_or_cancelled_by_plain_rq_heals_on_next_enqueue(
    idle: DedupQueue, rc: redis.Redis
) -> None:
    a, b = label(), label()
    ja, jb = idle.enqueue(rq_jobs.record, a), idle.enqueue(rq_jobs.record, b)
    assert ja is not None and jb is not None
    Job.fetch(ja.id, connection=rc).delete()  # plain RQ: the lock is left behind
    cancel_job(jb.id, connection=rc)
    key_a, key_b = key_of(idle, rq_jobs.record, a), key_of(idle, rq_jobs.record, b)
    assert lock(rc, key_a) == f"Q||{ja.id}" and lock(rc, key_b) == f"Q||{jb.id}"
    new_a, new_b = idle.enqueue(rq_jobs.record, a), idle.enqueue(rq_jobs.record, b)
    assert new_a is not None and new_a.id != ja.id and lock(rc, key_a) == f"Q||{new_a.id}"
    assert new_b is not None and new_b.id != jb.id and lock(rc, key_b) == f"Q||{new_b.id}"
    assert idle.count == 2


def test_an_explicit_job_id_works_beside_the_gate(idle: DedupQueue, rc: redis.Redis) -> None:
    name, jid = label(), f"jid-{label()}"
    first = idle.enqueue(rq_jobs.record, name, job_id=jid)
    assert first is not None and first.id == jid
    key = key_of(idle, rq_jobs.record, name)
    assert lock(rc, key) == f"Q||{jid}"
    other = idle.enqueue(rq_jobs.record, name, job_id=f"other-{label()}")
    assert other is not None and other.id == jid  # same identity: the original
    again = idle.enqueue(rq_jobs.record, name, job_id=jid)  # same id, alive: a duplicate
    assert again is not None and again.id == jid
    assert lock(rc, key) == f"Q||{jid}"
    assert idle.count == 1


@pytest.mark.skipif(not hasattr(rq.exceptions, "DuplicateJobError"),
                    reason="RQ < 2.8 has no unique=True")
def test_unique_and_explicit_job_id_work_beside_the_gate(
    idle: DedupQueue, rc: redis.Redis
) -> None:
    name, jid = label(), f"jid-{label()}"
    first = idle.enqueue(rq_jobs.record, name, job_id=jid, unique=True)
    assert first is not None and first.id == jid
    key = key_of(idle, rq_jobs.record, name)
    assert lock(rc, key) == f"Q||{jid}"
    with pytest.raises(rq.exceptions.DuplicateJobError):  # RQ's answer for its unique=True
        idle.enqueue(rq_jobs.record, name, job_id=jid, unique=True)
    other = idle.enqueue(rq_jobs.record, name, job_id=f"other-{label()}", unique=True)
    assert other is not None and other.id == jid  # same identity: the original
    again = idle.enqueue(rq_jobs.record, name, job_id=jid)  # same id, alive: a duplicate
    assert again is not None and again.id == jid
    assert lock(rc, key) == f"Q||{jid}"
    assert idle.count == 1


def redis_sends(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the commands redis-py writes to its sockets from this thread from now on
    (one per round trip: one per command outside a pipeline, one per pipeline)."""
    sent: list[str] = []
    original = AbstractConnection.send_packed_command

    def counting(conn: AbstractConnection, command: Any, check_health: bool = True) -> None:
        if threading.current_thread() is threading.main_thread():
            packed = b"".join(command) if isinstance(command, list) else bytes(command)
            sent.append(packed.split(b"\r\n")[2].decode())
        original(conn, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
    return sent


def test_an_explicit_job_id_enqueue_is_one_round_trip_and_its_live_job_is_checked_in_it(
    idle: DedupQueue, rc: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused enqueue reads an explicit job id's status in its own script: a new job and
    a re-enqueue of a live job id (other arguments: another identity, whose lock is free)
    each cost one EVALSHA, and the latter is answered with the job as it was written."""
    idle.enqueue(rq_jobs.record, label())  # warm up: scripts loaded, the fused path checked
    name, jid = label(), f"jid-{label()}"
    sent = redis_sends(monkeypatch)
    first = idle.enqueue(rq_jobs.record, name, job_id=jid)
    assert first is not None and first.id == jid
    assert sent == ["EVALSHA"]
    sent.clear()
    again = idle.enqueue(rq_jobs.record, f"{name}-other", job_id=jid)
    assert sent == ["EVALSHA"]  # no HGET first, no fetch of the original after
    assert again is not None and again.id == jid and again.args == (name,)
    assert not rc.exists(key_of(idle, rq_jobs.record, f"{name}-other"))  # nothing reserved
    assert lock(rc, key_of(idle, rq_jobs.record, name)) == f"Q||{jid}"
    assert idle.job_ids.count(jid) == 1


@pytest.mark.slow
def test_a_started_job_re_enqueued_under_its_own_id_is_a_duplicate_of_itself_and_runs_once(
    workers: list[RqWorker], q: DedupQueue, rc: redis.Redis
) -> None:
    """until_executing: the lock is gone once the job starts, so only the job's own status
    (read in the fused script) makes the re-enqueue a duplicate of the running job."""
    name, jid, policy = label(), f"jid-{label()}", {"mode": "until_executing"}
    first = q.enqueue(rq_jobs.gated, name, job_id=jid, dedup=policy)
    try:
        wait_for(lambda: effects(rc, name) == ["start"], timeout=30, what="first started")
        assert not rc.exists(key_of(q, rq_jobs.gated, name, policy=Policy(**policy)))
        again = q.enqueue(rq_jobs.gated, name, job_id=jid, dedup=policy)
        assert again is not None and again.id == jid
        assert again.get_status(refresh=False) == "started"
        assert jid not in q.job_ids  # not queued a second time
    finally:
        rc.set(f"go:{name}", 1)
    assert first is not None and ended(first) == "finished"
    assert effects(rc, name) == ["start", "end"]


def test_queue_policy_and_store_are_validated_when_the_queue_is_declared(
    rc: redis.Redis,
) -> None:
    for bad in ({"ttl": 0}, {"bogus": 1}, "yes", {"mode": "while_executing",
                                                  "on_duplicate": "raise"}):
        with pytest.raises(ConfigurationError):
            DedupQueue("rq-bad", connection=rc, dedup=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        DedupQueue("rq-bad", connection=rc, dedup_store=42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        DedupQueue("rq-bad", connection=rc, dedup_prefix="a:b")
    default = DedupQueue("rq-bad", connection=rc)
    assert default.dedup_policy == Policy() and default.job_class is DedupJob
    assert DedupQueue("rq-bad", connection=rc, dedup=False).dedup_policy is None
    with pytest.raises(ConfigurationError):
        default.enqueue(rq_jobs.record, "x", dedup={"ttl": -1})
    assert default.count == 0


def test_a_synchronous_queue_guards_execution_and_releases_on_failure(
    rc: redis.Redis,
) -> None:
    sync = DedupQueue(f"rq-sync-{label()}", connection=rc, is_async=False,
                      dedup=Policy(mode="until_executed", ttl=60))
    name = label()
    first = sync.enqueue(rq_jobs.record, name)
    assert first is not None and first.get_status() == "finished"
    # until_executed: released; a tombstone only this job id's own copies see (SPEC §5)
    assert lock(rc, key_of(sync, rq_jobs.record, name)) == f"F||{first.id}"
    again = sync.enqueue(rq_jobs.record, name)  # free to every other call
    assert again is not None and again.id != first.id and again.get_status() == "finished"
    failing = sync.enqueue(rq_jobs.fail_first, name + "f")
    assert failing is not None and failing.get_status() == "failed"
    assert not rc.exists(key_of(sync, rq_jobs.fail_first, name + "f"))
    retried = sync.enqueue(rq_jobs.fail_first, name + "f")
    assert retried is not None and retried.get_status() == "finished"
    assert effects(rc, name) == ["0", "0"] and effects(rc, name + "f") == ["1", "2"]


def test_a_synchronous_queue_skips_a_duplicate_execution_as_finished(rc: redis.Redis) -> None:
    sync = DedupQueue(f"rq-sync-{label()}", connection=rc, is_async=False,
                      dedup=Policy(mode="while_executing"))
    name = label()
    key = key_of(sync, rq_jobs.record, name)
    rc.set(key, "R||someone-else", px=30_000)  # another worker runs this identity now
    job = sync.enqueue(rq_jobs.record, name, on_success=Callback(rq_jobs.on_success_cb))
    assert job is not None and job.get_status() == "finished"
    assert skipped_info(job) == {"existing_id": "someone-else", "state": "running"}
    assert effects(rc, name) == [] and rc.lrange(f"callbacks:{job.id}", 0, -1) == []
    assert lock(rc, key) == "R||someone-else"  # not ours: untouched
    rc.delete(key)


@pytest.mark.slow
def test_a_job_from_a_plain_queue_is_not_guarded(
    workers: list[RqWorker], rc: redis.Redis
) -> None:
    name = label()
    plain = Queue(QUEUE, connection=rc)
    jobs = [plain.enqueue(rq_jobs.record, name) for _ in range(2)]
    assert [ended(j) for j in jobs] == ["finished", "finished"]
    assert effects(rc, name) == ["0", "0"]
    assert not rc.exists(key_of(DedupQueue(QUEUE, connection=rc), rq_jobs.record, name))


def test_a_queue_given_rq_s_plain_job_class_keeps_dedup_job(rc: redis.Redis) -> None:
    """django-rq passes ``job_class=rq.job.Job`` to every queue unless told otherwise: the
    queue keeps DedupJob, whose cancel and delete release the lock (a plain Job's would not)."""
    for given in (Job, "rq.job.Job"):
        assert DedupQueue(f"rq-jc-{label()}", connection=rc, job_class=given).job_class is DedupJob

    class Custom(Job):
        pass

    assert DedupQueue(f"rq-jc-{label()}", connection=rc, job_class=Custom).job_class is Custom
