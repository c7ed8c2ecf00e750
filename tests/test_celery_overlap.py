"""The gated publish with the locks apart from the broker (``taskdedup_url``): the reservation
is sent first, Celery builds the message meanwhile, and its reply is read just before the
broker publish (``Deduplicator.gate_send``, ``_compat.GatedProducer``). Same outcomes as
reserving first: a duplicate is never published, a failed publish releases its reservation,
store errors follow ``on_store_error``, one lock round trip per call, and the lock's
connection never goes back to its pool with a reply unread.

The broker is the session's Redis (its list shows what was published; no worker runs); the
locks are on another client of it (db 1), or on a dead port.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, signals
from kombu import Producer
from kombu.exceptions import OperationalError

from benchmarks.harness import RoundTripCounter
from taskdedup import (
    DuplicateTaskError,
    Event,
    IdempotencyKeyMismatch,
    Policy,
    StoreUnavailableError,
)
from taskdedup.celery import DedupTask, get_deduplicator
from taskdedup.core import Deduplicator
from taskdedup.stores.base import LockState
from taskdedup.stores.redis import SCRIPTS
from taskdedup.testing import free_port

RESERVE_SHA = hashlib.sha1(SCRIPTS["reserve"].encode()).hexdigest()


def _locks_url(redis_url: str) -> str:
    return redis_url.rsplit("/", 1)[0] + "/1"


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    app = Celery("overlap", broker=redis_url, set_as_current=False)
    app.conf.update(task_default_queue=f"overlap-{uuid.uuid4().hex[:8]}",
                    task_ignore_result=True, taskdedup_url=_locks_url(redis_url),
                    taskdedup_stats=False)
    yield app
    redis.Redis.from_url(redis_url).delete(app.conf.task_default_queue)
    app.close()


@pytest.fixture
def gate_not_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """The overlapped path is the one taken: the reserve-then-publish gate is never asked."""

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("Deduplicator.gate called: the reservation did not overlap")

    monkeypatch.setattr(Deduplicator, "gate", refuse)


def declare(app: Celery, **policy: Any) -> Any:
    def body(x: Any) -> Any:
        return x

    name = f"overlap.{uuid.uuid4().hex[:8]}"
    return app.task(base=DedupTask, name=name, dedup=Policy(**policy), shared=False)(body)


def queued_ids(client: redis.Redis, app: Celery) -> list[str]:
    raw = client.lrange(app.conf.task_default_queue, 0, -1)
    return [json.loads(m)["headers"]["id"] for m in reversed(raw)]  # LPUSH: oldest last


def lock_of(app: Celery, task: Any, x: Any) -> tuple[LockState, str | None] | None:
    dedup = get_deduplicator(app)
    key = dedup.identity(task.name, task._dedup_policy, (x,), {}, func=task._func()).key
    info = dedup.store.get(key)
    return None if info is None else (info.state, info.owner)


def idle(app: Celery) -> None:
    """Every connection of the lock store is back in its pool, and none holds a reply."""
    pool = get_deduplicator(app).store.client.connection_pool
    assert not pool._in_use_connections
    for conn in pool._available_connections:
        assert conn._sock is None or not conn.can_read(), "a reply was left unread"


def test_one_lock_round_trip_and_a_duplicate_is_not_published(
    app: Celery, redis_client: redis.Redis, gate_not_called: None
) -> None:
    task = declare(app, ttl=60)

    def body(x: Any) -> Any:
        return x

    plain = app.task(name=f"overlap.plain.{uuid.uuid4().hex[:8]}", shared=False)(body)
    plain.delay("warm")
    task.delay("warm")
    with RoundTripCounter() as plain_sent:
        plain.delay(1)
    with RoundTripCounter() as sent:
        first = task.delay(1)
    with RoundTripCounter() as again_sent:
        again = task.delay(1)

    assert sent.commands - plain_sent.commands == Counter({"EVALSHA": 1})
    assert sent.round_trips == plain_sent.round_trips + 1
    assert sent.shas == [RESERVE_SHA]
    assert again.id == first.id
    assert again_sent.commands == Counter({"EVALSHA": 1})  # no LPUSH: never published
    assert queued_ids(redis_client, app)[3:] == [first.id]
    assert lock_of(app, task, 1) == (LockState.QUEUED, first.id)
    assert get_deduplicator(app).counters.get(Event.DUPLICATE, task.name) == 1
    idle(app)


def test_a_failed_publish_releases_the_reservation_before_the_error(
    app: Celery, redis_client: redis.Redis, gate_not_called: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    task = declare(app, ttl=60)
    task.delay("warm")
    real = Producer.publish
    failures = iter([OperationalError("broker down")])

    def flaky(self: Producer, *args: Any, **kwargs: Any) -> Any:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Producer, "publish", flaky)
    with pytest.raises(OperationalError, match="broker down"):
        task.delay(1)
    assert lock_of(app, task, 1) is None
    assert get_deduplicator(app).counters.get(Event.RELEASED, task.name) == 1
    handle = task.delay(1)  # nothing was suppressed
    assert queued_ids(redis_client, app)[1:] == [handle.id]
    assert lock_of(app, task, 1) == (LockState.QUEUED, handle.id)
    idle(app)


def test_celery_failing_before_its_publish_reads_the_reply_and_releases(
    app: Celery, redis_client: redis.Redis, gate_not_called: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error between the send and the broker publish (here Celery building the message)
    reaches the caller; the reply is read (the connection goes back clean) and the
    reservation it made is taken back."""
    task = declare(app, ttl=60)
    task.delay("warm")

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("cannot build the message")

    monkeypatch.setattr(app.amqp, "create_task_message", broken)
    with pytest.raises(RuntimeError, match="cannot build"):
        task.delay(1)
    idle(app)
    assert lock_of(app, task, 1) is None
    monkeypatch.undo()
    handle = task.delay(1)
    assert queued_ids(redis_client, app)[1:] == [handle.id]


def test_the_stores_error_follows_on_store_error(
    redis_url: str, redis_client: redis.Redis
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    for on_store_error, published in (("raise", 0), ("allow", 2)):
        app = Celery("overlap-down", broker=redis_url, set_as_current=False)
        queue = f"overlap-down-{uuid.uuid4().hex[:8]}"
        app.conf.update(task_default_queue=queue, task_ignore_result=True,
                        taskdedup_url=dead, taskdedup_stats=False)
        task = declare(app, ttl=60, on_store_error=on_store_error)
        try:
            for n in range(2):
                if on_store_error == "raise":
                    with pytest.raises(StoreUnavailableError, match="unreachable"):
                        task.delay(n)
                else:
                    task.delay(n)
            assert redis_client.llen(queue) == published
        finally:
            redis_client.delete(queue)
            app.close()


def test_an_error_the_store_answers_is_a_store_error_and_the_connection_stays_clean(
    app: Celery, redis_client: redis.Redis, gate_not_called: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    task = declare(app, ttl=60)
    task.delay("warm")
    connection_class = get_deduplicator(app).store.client.connection_pool.connection_class
    real = connection_class.read_response

    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        real(self, *args, **kwargs)  # the reply is consumed, as with an error reply
        raise redis.ResponseError("NOPERM this user has no permissions to run 'evalsha'")

    monkeypatch.setattr(connection_class, "read_response", refused)
    with pytest.raises(StoreUnavailableError, match="NOPERM"):
        task.delay(1)
    monkeypatch.undo()
    assert queued_ids(redis_client, app)[1:] == []
    idle(app)
    assert task.delay(2).id in queued_ids(redis_client, app)


def test_an_explicit_key_held_with_other_arguments_raises_and_publishes_nothing(
    app: Celery, redis_client: redis.Redis, gate_not_called: None
) -> None:
    task = declare(app, ttl=60)
    first = task.apply_async((1,), dedup_key="ORD-1")
    with pytest.raises(IdempotencyKeyMismatch):
        task.apply_async((2,), dedup_key="ORD-1")
    assert queued_ids(redis_client, app) == [first.id]
    idle(app)


def test_a_script_the_server_lost_is_loaded_again(
    app: Celery, redis_client: redis.Redis, gate_not_called: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    task = declare(app, ttl=60)
    task.delay("warm")
    store = get_deduplicator(app).store
    # a script the server does not have (SCRIPT FLUSH would reach the other tests' calls)
    monkeypatch.setattr(store, "_reserve", store.client.register_script(
        SCRIPTS["reserve"] + f"\n-- {uuid.uuid4().hex}"))
    with RoundTripCounter() as sent:
        handle = task.delay(1)
    assert sent.commands["EVALSHA"] == 1 and sent.commands["EVAL"] == 1  # NOSCRIPT, then EVAL
    assert queued_ids(redis_client, app)[1:] == [handle.id]
    assert lock_of(app, task, 1) == (LockState.QUEUED, handle.id)
    idle(app)



def lose_next_reply(monkeypatch: pytest.MonkeyPatch, connection_class: Any) -> None:
    """The next reply read on ``connection_class`` is read, then its connection breaks."""
    real = connection_class.read_response
    broken = iter([True])

    def lose(self: Any, *args: Any, **kwargs: Any) -> Any:
        reply = real(self, *args, **kwargs)
        if next(broken, False):
            raise redis.ConnectionError("connection reset")
        return reply

    monkeypatch.setattr(connection_class, "read_response", lose)


def test_a_reply_lost_with_its_connection_is_asked_again_and_published_once(
    app: Celery, redis_client: redis.Redis, gate_not_called: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The connection breaks after the reservation ran, on a client that retries that error
    (``retry_on_error``): the call is made again through the client, as its own call would
    be, and this call's own reservation lets it through."""
    task = declare(app, ttl=60)
    task.delay("warm")
    pool = get_deduplicator(app).store.client.connection_pool
    monkeypatch.setitem(pool.connection_kwargs, "retry_on_error", [redis.ConnectionError])
    pool.reset()  # new connections take the setting
    connection_class = pool.connection_class
    lose_next_reply(monkeypatch, connection_class)
    handle = task.delay(1)
    assert queued_ids(redis_client, app)[1:] == [handle.id]
    assert lock_of(app, task, 1) == (LockState.QUEUED, handle.id)
    idle(app)


def test_a_reply_lost_on_a_client_that_does_not_retry_raises_and_sends_nothing(
    app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default client retries no command: a lost reply is the caller's
    StoreUnavailableError (on_store_error='raise'), nothing is published, and the
    reservation is taken back, so the caller's retry goes through."""
    task = declare(app, ttl=60)
    task.delay("warm")
    connection_class = get_deduplicator(app).store.client.connection_pool.connection_class
    lose_next_reply(monkeypatch, connection_class)
    with pytest.raises(StoreUnavailableError):
        task.delay(1)
    assert queued_ids(redis_client, app)[1:] == []
    retry = task.delay(1)
    assert queued_ids(redis_client, app)[1:] == [retry.id]
    idle(app)


def test_replace_revokes_the_queued_original_and_publishes_the_new_call(
    app: Celery, redis_client: redis.Redis, gate_not_called: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    task = declare(app, ttl=60, on_duplicate="replace")
    revoked: list[str] = []
    monkeypatch.setattr(app.control, "revoke", lambda task_id, **_: revoked.append(task_id))
    first = task.delay(1)
    second = task.delay(1)
    assert second.id != first.id and revoked == [first.id]
    assert queued_ids(redis_client, app) == [first.id, second.id]
    assert lock_of(app, task, 1) == (LockState.QUEUED, second.id)


def test_on_duplicate_raise_and_a_duplicate_with_a_link_publish_nothing(
    app: Celery, redis_client: redis.Redis, gate_not_called: None
) -> None:
    task = declare(app, ttl=60, on_duplicate="raise")
    first = task.delay(1)
    with pytest.raises(DuplicateTaskError) as info:
        task.delay(1)
    assert info.value.existing_id == first.id
    linked = declare(app, ttl=60)
    original = linked.delay(1)
    with pytest.raises(DuplicateTaskError, match="link"):
        linked.apply_async((1,), link=task.s())
    assert queued_ids(redis_client, app) == [first.id, original.id]
    idle(app)


def test_with_a_publish_signal_receiver_the_gate_goes_first(
    app: Celery, redis_client: redis.Redis
) -> None:
    """A ``before_task_publish`` receiver must never hear of a duplicate: then the
    reservation is read before Celery's publish starts (the path before this one)."""
    task = declare(app, ttl=60)
    heard: list[str] = []

    def hear(headers: Any = None, **_: Any) -> None:
        heard.append(headers["id"])

    signals.before_task_publish.connect(hear, weak=False)
    try:
        first = task.delay(1)
        again = task.delay(1)
    finally:
        signals.before_task_publish.disconnect(hear)
    assert again.id == first.id and heard == [first.id]
    assert queued_ids(redis_client, app) == [first.id]


def test_threads_publishing_the_same_calls_publish_each_once(
    app: Celery, redis_client: redis.Redis
) -> None:
    task = declare(app, ttl=60)
    task.delay("warm")
    handles: list[Any] = []
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def publish() -> None:
        start.wait()
        try:
            handles.extend(task.delay(n % 10) for n in range(40))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=publish) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    queued = queued_ids(redis_client, app)[1:]
    assert len(queued) == 10 and len(set(queued)) == 10
    assert {h.id for h in handles} == set(queued)
    idle(app)


def test_a_publish_on_a_connection_of_the_callers_is_gated_first(
    app: Celery, redis_client: redis.Redis
) -> None:
    """``connection=``: Celery publishes with a producer of its own on that connection, which
    the gate cannot stand in front of; the reply is read before the publish instead."""
    task = declare(app, ttl=60)
    with app.connection_for_write() as conn:
        first = task.apply_async((1,), connection=conn)
        again = task.apply_async((1,), connection=conn)
    assert again.id == first.id
    assert queued_ids(redis_client, app) == [first.id]
    idle(app)


def test_no_producer_to_be_had_reads_the_reply_and_takes_the_reservation_back(
    app: Celery, redis_client: redis.Redis, gate_not_called: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker's producer pool fails after the reservation was sent: the error reaches
    the caller, the reply is read (its connection back in the pool) and the reservation
    released."""
    task = declare(app, ttl=60)
    task.delay("warm")

    def exhausted(*_: Any, **__: Any) -> Any:
        raise OperationalError("no producer")

    monkeypatch.setattr(app, "producer_or_acquire", exhausted)
    with pytest.raises(OperationalError, match="no producer"):
        task.delay(1)
    monkeypatch.undo()
    idle(app)
    assert lock_of(app, task, 1) is None
    assert get_deduplicator(app).counters.get(Event.RELEASED, task.name) == 1
