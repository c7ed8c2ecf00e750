"""``taskdedup.celery.batch``: the reservations of many calls (a loop over ``delay``, a
``group``) in one pipeline round trip, on a real Redis broker.

The broker's list shows what was published: no worker consumes these queues (a batch run by
a real worker is in test_celery_worker.py).
"""

from __future__ import annotations

import gc
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, group

from benchmarks.harness import RoundTripCounter, command_calls
from taskdedup import DuplicateTaskError, IdempotencyKeyMismatch, Policy, StoreUnavailableError
from taskdedup.celery import DedupTask, batch, get_deduplicator
from taskdedup.testing import free_port


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    app = Celery("batch", broker=redis_url, set_as_current=False)
    # Locks configured apart from the broker: each gated call is its own reservation round
    # trip, which batch() pipelines (with the locks in the broker, RedisTransport is used).
    app.conf.update(task_default_queue=f"batch-{uuid.uuid4().hex[:8]}", task_ignore_result=True,
                    taskdedup_url=redis_url, taskdedup_stats=False)
    yield app
    redis.Redis.from_url(redis_url).delete(app.conf.task_default_queue)
    app.close()


def declare(app: Celery, **policy: Any) -> Any:
    def body(x: Any) -> Any:
        return x

    name = f"batch.{uuid.uuid4().hex[:8]}"
    return app.task(base=DedupTask, name=name, dedup=Policy(**policy), shared=False)(body)


def queued_ids(client: redis.Redis, app: Celery) -> list[str]:
    raw = client.lrange(app.conf.task_default_queue, 0, -1)
    return [json.loads(m)["headers"]["id"] for m in reversed(raw)]  # LPUSH: oldest last


def lock_owner(app: Celery, task: Any, *args: Any) -> str | None:
    key = get_deduplicator(app).identity(task.name, task._dedup_policy, args, {},
                                         func=task._func()).key
    info = get_deduplicator(app).store.get(key)
    return info.owner if info else None


def test_a_loop_over_delay_reserves_in_one_round_trip_and_publishes_in_call_order(
    app: Celery, redis_client: redis.Redis
) -> None:
    task = declare(app, ttl=60)
    task.delay("warm-up")  # connects, declares the queue, loads the reserve script
    before = command_calls(redis_client)
    gc.collect()  # closing earlier tests' kombu channels (an UNSUBSCRIBE) is not our count
    with RoundTripCounter() as sent, batch() as done:
        handles = [task.delay(n) for n in range(20)]
        assert queued_ids(redis_client, app)[1:] == []  # nothing published inside the block
    after = command_calls(redis_client)

    # the server saw them all (server-wide: another test's background thread may add one);
    # this thread sent exactly 20
    assert (after - before)["evalsha"] >= 20
    assert sent.commands["EVALSHA"] == 20
    assert sent.commands["LPUSH"] == 20
    # one pipeline of reservations, then 20 LPUSHes (and this test's own LRANGE)
    # (a connection idle past redis-py's health_check_interval sends a PING first: on a loaded
    # machine, not a cost of the batch)
    own = sent.round_trips - sent.commands["LRANGE"] - sent.commands["PING"]
    assert own == 1 + 20, sent.commands
    assert queued_ids(redis_client, app)[1:] == [h.id for h in handles]
    assert done.results == handles and done.errors == []
    assert all(lock_owner(app, task, n) == handles[n].id for n in range(20))


def test_duplicates_in_a_batch_get_the_original_handle_or_are_dropped(
    app: Celery, redis_client: redis.Redis
) -> None:
    task = declare(app, ttl=60)
    original = task.delay("a")
    with batch() as done:
        again = task.delay("a")  # a duplicate of a call made before the block
        first = task.delay("b")
        second = task.delay("b")  # a duplicate of a call made in the same block
        dropped = task.apply_async(("a",), dedup={"on_duplicate": "drop"})
    assert again.id == original.id
    assert second.id == first.id != original.id
    assert done.results == [again, first, second, None]
    assert dropped.id not in queued_ids(redis_client, app)
    assert queued_ids(redis_client, app) == [original.id, first.id]


def test_errors_of_single_calls_are_raised_at_the_end_after_the_others_were_published(
    app: Celery, redis_client: redis.Redis
) -> None:
    strict = declare(app, ttl=60, on_duplicate="raise")
    strict.delay("held")
    task = declare(app, ttl=60)
    with pytest.raises(DuplicateTaskError) as raised, batch() as done:
        strict.delay("held")
        ok = task.delay("fresh")
        task.apply_async(("x",), dedup_key="K-1")
        task.apply_async(("y",), dedup_key="K-1")  # the key again, other arguments
    assert len(done.errors) == 2 and isinstance(done.errors[1], IdempotencyKeyMismatch)
    assert any("1 more call" in note for note in raised.value.__notes__)
    assert done.results[0] is None and done.results[1] is ok and done.results[3] is None
    assert ok.id in queued_ids(redis_client, app)
    assert len(queued_ids(redis_client, app)) == 3  # "held", "fresh", K-1's first call


def test_an_exception_in_the_block_reserves_and_publishes_nothing(
    app: Celery, redis_client: redis.Redis
) -> None:
    task = declare(app, ttl=60)
    with pytest.raises(RuntimeError), batch():
        task.delay(1)
        raise RuntimeError("the caller's own error")
    assert queued_ids(redis_client, app) == []
    assert lock_owner(app, task, 1) is None
    assert task.delay(1).id in queued_ids(redis_client, app)  # not suppressed afterwards


def test_a_group_in_a_batch_is_reserved_in_one_round_trip_and_nested_blocks_join(
    app: Celery, redis_client: redis.Redis
) -> None:
    task = declare(app, ttl=60)
    task.delay("warm-up")
    before = command_calls(redis_client)
    gc.collect()  # closing earlier tests' kombu channels (an UNSUBSCRIBE) is not our count
    with RoundTripCounter() as sent, batch() as outer:
        with batch() as inner:
            result = group(task.s(n) for n in range(10)).apply_async()
        assert inner is outer
        assert queued_ids(redis_client, app)[1:] == []  # held until the outer block ends
    # the server saw them all (server-wide: another test's heartbeat may add one, as one
    # renewing a lock left by an earlier test did in CI); this thread sent exactly 10
    assert (command_calls(redis_client) - before)["evalsha"] >= 10
    assert sent.commands["EVALSHA"] == 10
    own = sent.round_trips - sent.commands["LRANGE"] - sent.commands["PING"]
    assert own == 1 + 10, sent.commands
    assert queued_ids(redis_client, app)[1:] == [r.id for r in result.results]


def test_store_down_raise_publishes_nothing_and_allow_publishes_everything(
    redis_url: str, redis_client: redis.Redis
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    for on_store_error, published in (("raise", 0), ("allow", 3)):
        app = Celery("batch-down", broker=redis_url, set_as_current=False)
        queue = f"batch-down-{uuid.uuid4().hex[:8]}"
        app.conf.update(task_default_queue=queue, task_ignore_result=True,
                        taskdedup_url=dead, taskdedup_stats=False)
        task = declare(app, ttl=60, on_store_error=on_store_error)
        try:
            if on_store_error == "raise":
                with pytest.raises(StoreUnavailableError, match="unreachable"), batch() as done:
                    for n in range(3):
                        task.delay(n)
                assert len(done.errors) == 3 and done.results == [None] * 3
            else:
                with batch() as done:
                    handles = [task.delay(n) for n in range(3)]
                assert done.results == handles
            assert redis_client.llen(queue) == published
        finally:
            redis_client.delete(queue)
            app.close()
