"""What RQ's one-round-trip enqueue relies on is checked when a DedupQueue is declared: on
every RQ release the matrix runs it holds for enqueue (one round trip), and where it does not
(RQ 2.x's schedule, an RQ that pushes through its own script or no longer writes into the
caller's pipeline) that path takes the public way — reserve, then RQ's own enqueue — says why
in one INFO line, and still dedups, with a real ``rq worker`` running the job once. A worker
on an RQ whose hooks changed shape refuses to start rather than run jobs unguarded."""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlparse

import pytest
import redis
from redis.connection import Connection
from rq.queue import Queue
from rq.worker import Worker

from taskdedup import ConfigurationError, Policy
from taskdedup.rq import DedupQueue, DedupWorker, _compat
from taskdedup.testing import free_port, wait_for
from tests import rq_jobs
from tests.proxy import Proxy
from tests.workers import RqWorker

PUBLIC_PATH = "DedupQueue reserves in its own round trip"


def label() -> str:
    return uuid.uuid4().hex[:12]


class CountingConnection(Connection):
    """A connection that counts what the test's thread sends (not the stats flusher's): one
    packed send is one round trip (a pipeline sends all its commands at once)."""

    sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if threading.current_thread() is threading.main_thread():
            type(self).sends += 1
        super().send_packed_command(command, check_health)


@pytest.fixture
def counting(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, connection_class=CountingConnection)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def fresh_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget this process's earlier checks, as a fresh process would start."""
    monkeypatch.setattr(_compat, "_checked", {})
    monkeypatch.setattr(_compat, "_said", set())


def round_trips(call: Callable[[], Any]) -> int:
    before = CountingConnection.sends
    call()
    return CountingConnection.sends - before


# -- what a future RQ could do instead of plain writes into the caller's pipeline -------------


def push_by_script(monkeypatch: pytest.MonkeyPatch) -> str:
    """RQ pushes the job id through a Lua script of its own (as RQ 3.0 already does for
    ``unique=True`` and rate-limited jobs): a script cannot call EVAL."""
    def push_job_id(self: Queue, job_id: str, pipeline: Any = None,
                    at_front: bool = False) -> None:
        target = pipeline if pipeline is not None else self.connection
        target.eval("return redis.call(ARGV[1], KEYS[1], ARGV[2])", 1, self.key,
                    "LPUSH" if at_front else "RPUSH", job_id)

    monkeypatch.setattr(Queue, "push_job_id", push_job_id)
    return "EVAL"


def enqueue_on_its_own(monkeypatch: pytest.MonkeyPatch) -> str:
    """RQ's ``enqueue_job`` no longer writes into the pipeline it is given (it runs its own):
    a capture would see nothing and the job would be queued before the reservation."""
    enqueue_job = Queue.enqueue_job

    def own_pipeline(self: Queue, job: Any, pipeline: Any = None, **options: Any) -> Any:
        return enqueue_job(self, job, **options)

    monkeypatch.setattr(Queue, "enqueue_job", own_pipeline)
    return "executes a pipeline of its own"


CHANGES = [push_by_script, enqueue_on_its_own]


# -- tests ----------------------------------------------------------------------------------


def rq_schedules_into_the_pipeline(rc: redis.Redis) -> bool:
    """Whether this RQ's ``ScheduledJobRegistry.schedule`` writes into the pipeline it is given
    (RQ 3.0) or straight to Redis (RQ 2.x ignores the pipeline there)."""
    q = Queue(f"rq-oracle-{label()}", connection=rc)
    job = q.create_job(rq_jobs.record, args=("x",))
    key = q.scheduled_job_registry.key
    with rc.pipeline() as pipe:
        q.scheduled_job_registry.schedule(job, datetime.now(UTC), pipeline=pipe)
        written_at_once = bool(rc.zcard(key))
        pipe.reset()
    rc.delete(key)
    return not written_at_once


def public_path_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if PUBLIC_PATH in r.getMessage()]


def test_this_rq_release_takes_the_one_round_trip_enqueue(
    counting: redis.Redis, fresh_checks: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The releases the matrix runs (RQ 2.6 to 3.x, redis-py 5 to 8) pass the check: a gated
    enqueue is one round trip, a duplicate too, and nothing is logged about its path."""
    with caplog.at_level(logging.INFO, logger="taskdedup"):
        q = DedupQueue(f"rq-compat-{label()}", connection=counting, dedup=Policy(ttl=60))
    try:
        q.enqueue(rq_jobs.record, label())  # warm-up: the script is loaded once per server
        name = label()
        assert round_trips(lambda: q.enqueue(rq_jobs.record, name)) == 1
        assert round_trips(lambda: q.enqueue(rq_jobs.record, name)) == 1  # the duplicate
        assert q.count == 2
        assert not [r for r in public_path_lines(caplog) if "RQ's enqueue " in r.getMessage()]
    finally:
        q.empty()


def test_enqueue_in_rides_in_the_script_only_where_rq_schedules_into_the_pipeline(
    counting: redis.Redis, rc: redis.Redis, fresh_checks: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """RQ 2.x writes the scheduled-registry entry straight to Redis, not into the pipeline it
    is given: there ``enqueue_in``/``enqueue_at`` reserve in their own round trip (one INFO line
    says so) and a duplicate leaves no stray entry a scheduler would trip over; where RQ
    schedules into the pipeline (3.0) it is one round trip."""
    into_pipeline = rq_schedules_into_the_pipeline(rc)
    name = f"rq-compat-{label()}"
    with caplog.at_level(logging.INFO, logger="taskdedup"):
        q = DedupQueue(name, connection=counting, dedup=Policy(ttl=60))
        plain = Queue(f"{name}-plain", connection=counting)
        later = timedelta(hours=1)
        q.enqueue_in(later, rq_jobs.record, label())  # warm-up: the script is loaded
        call = label()
        trips = round_trips(lambda: q.enqueue_in(later, rq_jobs.record, call))
        plain_trips = round_trips(lambda: plain.enqueue_in(later, rq_jobs.record, call))
        again = [q.enqueue_in(later, rq_jobs.record, call) for _ in range(3)]
    try:
        assert trips == (1 if into_pipeline else plain_trips + 1)
        assert len({job.id for job in again if job is not None}) == 1 and None not in again
        assert rc.zcard(q.scheduled_job_registry.key) == 2  # the warm-up and the call
        said = [r.getMessage() for r in public_path_lines(caplog)]
        assert said == ([] if into_pipeline else [said[0]])
        assert into_pipeline or "schedule" in said[0]
    finally:
        for queue in (q, plain):
            rc.delete(queue.scheduled_job_registry.key)


def test_a_queue_declared_while_its_redis_is_down_is_checked_once_redis_answers(
    redis_url: str, fresh_checks: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The check needs the server (RQ asks its version): a queue declared while Redis is down
    neither fails nor gives up the one round trip; its first enqueue checks again."""
    with Proxy(("127.0.0.1", free_port())) as proxy:  # nothing listens there: Redis is down
        client = redis.Redis.from_url(proxy.url, connection_class=CountingConnection)
        with caplog.at_level(logging.INFO, logger="taskdedup"):
            q = DedupQueue(f"rq-compat-{label()}", connection=client, dedup=Policy(ttl=60))
            parsed = urlparse(redis_url)
            proxy.target = (parsed.hostname or "127.0.0.1", parsed.port or 6379)  # Redis is up
            try:
                q.enqueue(rq_jobs.record, label())  # checks, then loads the script
                assert round_trips(lambda: q.enqueue(rq_jobs.record, label())) == 1
            finally:
                q.empty()
                client.close()
    assert not [r for r in public_path_lines(caplog) if "RQ's enqueue " in r.getMessage()]


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: c.__name__)
def test_an_rq_enqueue_that_cannot_ride_in_the_script_takes_the_public_path_and_says_so_once(
    change: Callable[[pytest.MonkeyPatch], str], counting: redis.Redis, rc: redis.Redis,
    fresh_checks: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The check at declaration finds the change: the queue reserves in its own round trip,
    then enqueues with RQ's own code; every call works and dedups (no error, nothing queued
    twice), and one INFO line says why — once per process, not per queue or call."""
    why = change(monkeypatch)
    name = f"rq-compat-{label()}"
    with caplog.at_level(logging.INFO, logger="taskdedup"):
        q = DedupQueue(name, connection=counting, dedup=Policy(ttl=60))
        call = label()
        first = q.enqueue(rq_jobs.record, call)
        second = q.enqueue(rq_jobs.record, call)
        other = DedupQueue(name, connection=counting, dedup=Policy(ttl=60))
        third = other.enqueue(rq_jobs.record, call)
        fresh = label()
        trips = round_trips(lambda: other.enqueue(rq_jobs.record, fresh))
    plain = Queue(f"{name}-plain", connection=counting)
    plain_trips = round_trips(lambda: plain.enqueue(rq_jobs.record, fresh))
    try:
        assert first is not None and second is not None and third is not None
        assert first.id == second.id == third.id
        key = q.dedup.identity("tests.rq_jobs.record", Policy(), (call,), {},
                               func=rq_jobs.record).key
        assert rc.get(key) == f"Q||{first.id}".encode()
        assert q.job_ids.count(first.id) == 1 and q.count == 2
        assert trips == plain_trips + 1  # reserve, then RQ's own enqueue
        said = [r for r in public_path_lines(caplog) if "RQ's enqueue " in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.INFO
        assert why in said[0].getMessage()
    finally:
        q.empty()
        plain.empty()


@pytest.mark.slow
@pytest.mark.parametrize("change", CHANGES, ids=lambda c: c.__name__)
def test_on_the_public_path_a_real_rq_worker_runs_the_call_once(
    change: Callable[[pytest.MonkeyPatch], str], redis_url: str, rc: redis.Redis,
    fresh_checks: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the same change in the producer, duplicates sent before and while a real
    ``rq worker`` (DedupWorker) runs the job give one job and one execution."""
    change(monkeypatch)
    name = f"rq-compat-{os.getpid()}-{label()}"
    q = DedupQueue(name, connection=rc, dedup=Policy(ttl=60))
    call = label()
    jobs = [q.enqueue(rq_jobs.record, call, 3) for _ in range(3)]
    worker = RqWorker(redis_url, [name], scheduler=False).start()
    try:
        jobs.append(q.enqueue(rq_jobs.record, call, 3))
        ids = {job.id for job in jobs if job is not None}
        assert len(ids) == 1 and None not in jobs
        first = jobs[0]
        assert first is not None
        wait_for(lambda: first.get_status() == "finished", timeout=30, what="job finished")
        assert [x.decode() for x in rc.lrange(f"effects:{call}", 0, -1)] == ["3"]
        assert q.count == 0 and len(q.finished_job_registry) == 1
        again = q.enqueue(rq_jobs.record, call, 3)  # until_expired: still the original
        assert again is not None and again.id == first.id
    finally:
        worker.stop()
        q.empty()


def test_a_worker_refuses_to_start_on_an_rq_whose_hooks_it_does_not_know(
    rc: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard runs in RQ's ``perform_job`` and ``handle_job_*``: on an RQ where one of them
    changed shape, RQ would never call the guard and jobs would run unguarded, so the worker
    refuses to start and says what is missing."""
    def perform_job(self: Worker, queued: Any, origin: Any) -> bool:
        return True

    DedupWorker([f"rq-compat-{label()}"], connection=rc)  # this RQ: fine
    monkeypatch.setattr(Worker, "perform_job", perform_job)
    with pytest.raises(ConfigurationError, match="perform_job"):
        DedupWorker([f"rq-compat-{label()}"], connection=rc)


def test_worker_stops_its_pubsub_thread_when_the_unsubscribe_reply_is_read_first(
        redis_url: str) -> None:
    """RQ 3.0 sends UNSUBSCRIBE, then stops its pub/sub thread. Here the thread reads the
    reply first, every time: on redis-py 8.2 it then waited 60 s in its next get_message and
    ``stop()`` joined it without a limit (the worker took a minute to exit); on 8.1 it was
    left running. DedupWorker tells the thread to stop before the UNSUBSCRIBE goes out."""
    client = redis.Redis.from_url(redis_url)
    worker = DedupWorker([Queue(f"exit-{label()}", connection=client)], connection=client)
    worker.subscribe()
    thread = worker.pubsub_thread
    assert thread is not None
    pubsub = worker.pubsub
    wait_for(lambda: pubsub.subscribed, timeout=5)
    unsubscribe = pubsub.unsubscribe

    def reply_read_first(*args: Any) -> Any:
        sent = unsubscribe(*args)
        wait_for(lambda: not pubsub.subscribed, timeout=5)  # the thread has read the reply
        return sent

    pubsub.unsubscribe = reply_read_first  # type: ignore[method-assign]
    ended = threading.Event()
    stopper = threading.Thread(target=lambda: (worker.unsubscribe(), ended.set()), daemon=True)
    stopper.start()
    try:
        # the hang this guards against lasts 60 s; 15 s leaves room for the 5 s the patched
        # unsubscribe may wait on a loaded machine (CI, 2026-12-08: 5 s was missed once)
        assert ended.wait(15), "the worker's unsubscribe still waits for its pub/sub thread"
        thread.join(15)
        assert not thread.is_alive()
    finally:
        pubsub.close()
        client.close()
