"""``taskdedup.celery:RedisTransport``: the reservation rides in the broker's push (one Lua
script, one round trip), on a real Redis and with a real worker."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from celery import Celery

from taskdedup import DuplicateTaskError, IdempotencyKeyMismatch, Policy
from taskdedup.celery import DedupTask, RedisTransport, _fuses, get_deduplicator
from taskdedup.testing import wait_for
from tests.workers import CeleryWorker


def fused_app(url: str, **conf: Any) -> Celery:
    app = Celery("fused", broker=url, set_as_current=False)
    app.conf.update(broker_transport="taskdedup.celery:RedisTransport", **conf)
    return app


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis) -> Celery:
    return fused_app(redis_url, task_default_queue="fused")


def declare(app: Celery, name: str, **policy: Any) -> Any:
    def body(x: int) -> int:
        return x

    return app.task(base=DedupTask, name=name, dedup=Policy(**policy), shared=False)(body)


class CommandCounter:
    """Counts the commands redis-py sends (one per round trip outside pipelines)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.commands: list[str] = []
        original = redis.Redis.execute_command

        def counting(client: redis.Redis, *args: Any, **options: Any) -> Any:
            self.commands.append(str(args[0]).upper())
            return original(client, *args, **options)

        monkeypatch.setattr(redis.Redis, "execute_command", counting)


def test_the_transport_is_used_only_when_the_locks_live_in_the_broker(redis_url: str) -> None:
    assert _fuses(fused_app(redis_url))
    assert _fuses(Celery("x", broker=redis_url, set_as_current=False)) is False
    assert _fuses(fused_app(redis_url, taskdedup_url=redis_url)) is False  # a store of its own
    app = Celery("y", broker=redis_url, set_as_current=False)
    app.conf.broker_transport = RedisTransport
    assert _fuses(app)


def test_a_gated_publish_is_one_round_trip_and_a_duplicate_pushes_nothing(
    app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = declare(app, "fused.one")
    task.delay(0)  # warm up: connection, queue declaration
    counter = CommandCounter(monkeypatch)
    first = task.delay(1)
    assert counter.commands == ["EVALSHA"]
    counter.commands.clear()
    again = task.delay(1)
    assert counter.commands == ["EVALSHA"]
    assert again.id == first.id
    assert redis_client.llen("fused") == 2  # the warm-up and the first; not the duplicate
    key = get_deduplicator(app).identity("fused.one", task._dedup_policy, (1,), {},
                                         func=task._func()).key
    assert redis_client.get(key) == f"Q||{first.id}".encode()


def test_raise_mismatch_and_replace_through_the_transport(
    app: Celery, redis_client: redis.Redis
) -> None:
    strict = declare(app, "fused.strict", on_duplicate="raise")
    first = strict.delay(1)
    with pytest.raises(DuplicateTaskError) as info:
        strict.delay(1)
    assert info.value.existing_id == first.id
    keyed = declare(app, "fused.keyed")
    keyed.apply_async((1,), dedup_key="K")
    with pytest.raises(IdempotencyKeyMismatch):
        keyed.apply_async((2,), dedup_key="K")
    debounced = declare(app, "fused.debounced", mode="until_executed", on_duplicate="replace")
    old = debounced.apply_async((1,), countdown=60)
    new = debounced.apply_async((1,), countdown=60)
    assert new.id != old.id
    assert redis_client.llen("fused") == 4  # strict, keyed, old, new: no duplicate pushed


def test_a_worker_runs_what_the_transport_published_exactly_once(redis_url: str) -> None:
    from tests import celery_app

    app = fused_app(redis_url, task_default_queue="it-fused", result_backend=redis_url)
    record = app.task(base=DedupTask, name=celery_app.record.name, dedup=Policy(ttl=60),
                      shared=False)(celery_app.record.run)
    client = redis.Redis.from_url(redis_url)
    label = uuid.uuid4().hex[:12]
    worker = CeleryWorker(redis_url, queue="it-fused",
                          env={"TASKDEDUP_TEST_TRANSPORT": "taskdedup.celery:RedisTransport"})
    worker.start()
    try:
        results = [record.delay(label) for _ in range(3)]
        assert len({r.id for r in results}) == 1
        assert results[0].get(timeout=30) == f"{label}:0"
        assert client.lrange(f"effects:{label}", 0, -1) == [b"0"]
        key = get_deduplicator(app).identity(record.name, record._dedup_policy, (label,), {},
                                             func=record._func()).key
        wait_for(lambda: client.get(key) == f"D||{results[0].id}".encode(), timeout=10)
    finally:
        worker.stop()


