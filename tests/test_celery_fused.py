"""``taskdedup.celery:RedisTransport``: the reservation rides in the broker's push (one Lua
script, one round trip), on a real Redis and with a real worker."""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import pytest
import redis
from celery import Celery

from taskdedup import DuplicateTaskError, IdempotencyKeyMismatch, Policy, StoreUnavailableError
from taskdedup.celery import DedupTask, RedisTransport, get_deduplicator
from taskdedup.celery.config import fuses as _fuses
from taskdedup.stores.redis import SCRIPTS
from taskdedup.testing import wait_for
from tests.counting import CommandCounter
from tests.effects import released
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


def test_the_transport_is_used_only_when_the_locks_live_in_the_broker(redis_url: str) -> None:
    assert _fuses(fused_app(redis_url))
    assert _fuses(fused_app(redis_url, taskdedup_url=redis_url)) is False  # a store of its own
    app = Celery("y", broker=redis_url, set_as_current=False)
    app.conf.broker_transport = RedisTransport
    assert _fuses(app)


def test_the_one_round_trip_publish_is_chosen_for_a_plain_redis_broker_and_logged_once(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SPEC §10: no extra round trip where the broker is the same Redis — by default, without
    rewriting the app's ``broker_transport`` (the choice is logged once)."""
    import logging

    with caplog.at_level(logging.DEBUG, logger="taskdedup"):
        auto = Celery("auto", broker=redis_url, set_as_current=False)
        assert _fuses(auto) and _fuses(auto)
        assert auto.conf.broker_transport is None
    said = [r for r in caplog.records if "Celery app 'auto'" in r.getMessage()]
    # #24 stumble 6: what it means for the user at INFO, in plain words; the how at DEBUG
    assert [r.levelno for r in said] == [logging.INFO, logging.DEBUG]
    assert said[0].getMessage() == (
        "taskdedup: Celery app 'auto': each deduplicated call is checked for duplicates in the "
        "same Redis call that queues it: no extra round trip")
    assert "inside the broker's push" in said[1].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="taskdedup"):
        apart = Celery("apart", broker=redis_url, set_as_current=False)
        apart.conf.taskdedup_url = redis_url
        assert _fuses(apart) is False
    assert [r.getMessage() for r in caplog.records if "'apart'" in r.getMessage()] == [
        "taskdedup: Celery app 'apart': each deduplicated call is checked for duplicates in a "
        "Redis call of its own before it is queued: one extra round trip"]
    kept: list[tuple[dict[str, Any], Any]] = [
        ({"taskdedup_fused_publish": False}, None),  # opted out
        ({"taskdedup_url": redis_url}, None),  # the locks live elsewhere
        ({"broker_transport": "redis"}, "redis"),  # the user chose a transport
        ({"broker_write_url": redis_url + "1"}, None),  # a separate write broker
    ]
    for conf, transport in kept:
        app = Celery("kept", broker=redis_url, set_as_current=False)
        app.conf.update(conf)
        assert _fuses(app) is False, conf
        assert app.conf.broker_transport == transport, conf
    amqp = Celery("amqp", broker="amqp://guest@127.0.0.1//", set_as_current=False)
    assert _fuses(amqp) is False and amqp.conf.broker_transport is None


def realistic_app(redis_url: str, queue: str) -> tuple[Celery, Any, Any]:
    """One app, default configuration, broker = the lock Redis, a plain task and a gated one
    (SPEC §10's realistic app)."""
    app = Celery("realistic", broker=redis_url, set_as_current=False)
    app.conf.update(task_default_queue=queue, task_ignore_result=True, taskdedup_stats=False)

    def identity(x: int) -> int:
        return x

    plain = app.task(name="realistic.plain", shared=False)(identity)
    return app, plain, declare(app, "realistic.gated")


def test_a_plain_task_published_first_does_not_cost_the_gated_ones_a_round_trip(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #10 item 3: the producer pool of an earlier plain publish holds kombu's
    transport; the gated publishes still reserve inside the push, one round trip, whatever
    was published first."""
    queue = f"late-{uuid.uuid4().hex[:8]}"
    app, plain, task = realistic_app(redis_url, queue)
    try:
        plain.delay(0)  # the app's producer pool is made now, with kombu's own transport
        task.delay(0)  # connects taskdedup's producers, loads the script
        counter = CommandCounter(monkeypatch)
        first = task.delay(1)
        assert counter.commands == ["EVALSHA"]
        counter.commands.clear()
        assert task.delay(1).id == first.id
        assert counter.commands == ["EVALSHA"]
        counter.commands.clear()
        plain.delay(1)
        assert counter.commands == ["LPUSH"]  # plain tasks keep kombu's own push
        assert app.conf.broker_transport is None  # nothing rewritten
        queued = [json.loads(m)["headers"]["id"] for m in redis_client.lrange(queue, 0, -1)]
        assert len(queued) == 4 and queued.count(first.id) == 1
    finally:
        redis_client.delete(queue)
        app.close()


@pytest.mark.parametrize("setup", ["default", "transport", "apart", "announced"])
def test_a_gated_publish_declares_its_queue_once_per_connection(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, setup: str
) -> None:
    """Celery asks every publish to declare its queue; kombu binds, ensures, and only then
    finds it declared (~25 µs a publish). taskdedup's producers look in kombu's cache first:
    the first gated publish to a queue declares it (its messages are routed), the next ones
    do not go through kombu's declare, and a queue new to the connection is declared. So on
    a default app, one whose ``broker_transport`` is ours, one whose locks live apart, and
    one whose publishes are announced (a ``before_task_publish`` receiver: the gate first,
    then Celery's publish)."""
    import kombu.messaging

    queue, other = f"declared-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    from celery.signals import before_task_publish

    def receiver(**_: Any) -> None:
        pass

    app, plain, task = realistic_app(redis_url, queue)
    if setup == "transport":
        app.conf.broker_transport = "taskdedup.celery:RedisTransport"
    elif setup == "apart":
        app.conf.taskdedup_url = redis_url  # a store of its own: the gate's own round trip
    elif setup == "announced":
        before_task_publish.connect(receiver, weak=False)
    declared: list[str] = []
    kombus = kombu.messaging.maybe_declare

    def counting(entity: Any, *args: Any, **kwargs: Any) -> Any:
        declared.append(getattr(entity, "name", ""))
        return kombus(entity, *args, **kwargs)

    monkeypatch.setattr(kombu.messaging, "maybe_declare", counting)
    try:
        for x in range(3):
            task.delay(x)
        task.apply_async((9,), queue=other)
        assert declared.count(queue) == 1 and declared.count(other) == 1
        assert redis_client.llen(queue) == 3 and redis_client.llen(other) == 1
        plain.delay(0)  # plain Celery keeps kombu's producer: kombu's declare, every time
        plain.delay(1)
        assert declared.count(queue) == 3
    finally:
        before_task_publish.disconnect(receiver)  # connected or not
        redis_client.delete(queue, other)
        app.close()


def test_a_declared_producer_on_a_closed_channel_declares_as_kombu_does(redis_url: str) -> None:
    """A channel closed since the last declare is kombu's case: its error, not ours."""
    from kombu import Connection, Producer, Queue

    from taskdedup.celery.producers import DeclaredProducer

    with Connection(redis_url, transport=RedisTransport) as conn:
        ours, kombus = DeclaredProducer(conn), Producer(conn)
        queue = Queue(f"closed-{uuid.uuid4().hex[:8]}")
        assert ours.maybe_declare(queue) is True  # declared now
        assert ours.maybe_declare(queue) is False  # cached
        assert ours.channel is kombus.channel
        channel = ours.channel
        transport, channel.connection = channel.connection, None
        try:
            with pytest.raises(Exception) as kombu_error:
                kombus.maybe_declare(queue)
            with pytest.raises(kombu_error.type):
                ours.maybe_declare(queue)
        finally:
            channel.connection = transport


def test_a_fresh_app_on_a_redis_broker_publishes_gated_tasks_in_one_round_trip(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = f"auto-{uuid.uuid4().hex[:8]}"
    app = Celery("auto", broker=redis_url, set_as_current=False)
    app.conf.update(task_default_queue=queue, task_ignore_result=True, taskdedup_stats=False)
    task = declare(app, "auto.gated")
    try:
        task.delay(0)  # connects
        counter = CommandCounter(monkeypatch)
        first = task.delay(1)
        assert counter.commands == ["EVALSHA"]
        assert task.delay(1).id == first.id
        assert redis_client.llen(queue) == 2
    finally:
        redis_client.delete(queue)
        app.close()


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


def test_a_global_key_prefix_applies_to_the_fused_push(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """kombu's ``global_keyprefix`` is applied by its client to the commands it knows, not
    inside a script: the fused push must prefix the queue itself, or the message would land
    where no worker looks."""
    queue = f"prefixed-{uuid.uuid4().hex[:8]}"
    app = fused_app(redis_url, task_default_queue=queue, task_ignore_result=True,
                    broker_transport_options={"global_keyprefix": "pfx:"})
    task = declare(app, "fused.prefixed")
    try:
        first = task.delay(1)
        assert task.delay(1).id == first.id
        assert redis_client.llen(f"pfx:{queue}") == 1
        assert redis_client.exists(queue) == 0
        with app.connection_for_read() as conn:  # what a worker reads: kombu's own prefix
            message = conn.SimpleQueue(queue, no_ack=True).get(timeout=5)
        assert message.headers["id"] == first.id
    finally:
        redis_client.delete(f"pfx:{queue}", queue)
        app.close()


def test_a_broker_user_without_script_permission_follows_on_store_error(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis refuses the script (an ACL without EVALSHA/EVAL) but the broker works: nothing
    ran, so ``on_store_error`` decides — ``raise`` sends nothing, ``allow`` publishes with
    kombu's own push and a warning."""
    import logging

    user = f"noscript-{uuid.uuid4().hex[:6]}"
    redis_client.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"],
                             channels=["*"], commands=["+@all", "-evalsha", "-eval"])
    url = redis_url.replace("redis://", f"redis://{user}:pw@")
    queue = f"noscript-{uuid.uuid4().hex[:8]}"
    try:
        for on_store_error, published in (("raise", 0), ("allow", 1)):
            app = fused_app(url, task_default_queue=queue, task_ignore_result=True,
                            taskdedup_stats=False)
            task = declare(app, f"fused.noscript-{on_store_error}",
                           on_store_error=on_store_error)
            try:
                if on_store_error == "raise":
                    with pytest.raises(StoreUnavailableError, match="lacks a permission"):
                        task.delay(1)
                else:
                    with caplog.at_level(logging.WARNING, logger="taskdedup"):
                        task.delay(1)
                    assert "WITHOUT dedup" in caplog.text
                assert redis_client.llen(queue) == published
            finally:
                app.close()
    finally:
        redis_client.delete(queue)
        redis_client.acl_deluser(user)


def test_a_task_whose_recent_calls_are_mostly_duplicates_checks_before_building_a_message(
    app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the transport a duplicate costs a whole message build; once most recent calls
    of a task were duplicates, the gate checks first (no message is built for a duplicate),
    and it goes back to the one-round-trip publish as accepted calls come back."""
    task = declare(app, "fused.mostly-duplicates")
    redis_client.script_load(SCRIPTS["reserve"])  # what checking first runs: loaded already
    built: list[str] = []
    send = app.amqp.send_task_message  # not a publish signal: a receiver makes it check first

    def count(producer: Any, name: str, message: Any, **options: Any) -> Any:
        built.append(str(message.headers.get("id")))
        return send(producer, name, message, **options)

    monkeypatch.setattr(app.amqp, "send_task_message", count)
    original = task.delay("hot")
    duplicates = 0
    while task._dedup_duplicate_rate <= 0.5:
        assert task.delay("hot").id == original.id
        duplicates += 1
    assert duplicates == 7  # 1 - 0.9 ** 7 > 0.5: about the last ten calls decide
    assert len(built) == 1 + duplicates  # each built its message before the script said no
    counter = CommandCounter(monkeypatch)
    assert task.delay("hot").id == original.id
    assert len(built) == 1 + duplicates  # checked first: no message built
    assert counter.commands == ["EVALSHA"]
    counter.commands.clear()
    fresh = []
    while task._dedup_duplicate_rate >= 0.5:
        fresh.append(task.delay(f"cold-{len(fresh)}"))  # accepted: reserve, then LPUSH
    assert counter.commands == ["EVALSHA", "LPUSH"] * len(fresh)
    assert 1 <= len(fresh) <= 3
    counter.commands.clear()
    task.delay("cold-again")
    assert counter.commands == ["EVALSHA"]  # one round trip again
    queued = {json.loads(m)["headers"]["id"] for m in redis_client.lrange("fused", 0, -1)}
    assert {original.id, *(f.id for f in fresh)} <= queued


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




class PushWatch:
    """Who pushes to a queue, seen with MONITOR: kombu's own ``LPUSH`` or one run inside a
    script (``enqueue.lua``)."""

    def __init__(self, url: str, queue: str) -> None:
        self.queue = queue
        self.pushes: list[str] = []  # "lua" or "client" per LPUSH to the queue
        self._client = redis.Redis.from_url(url)
        self._done = f"pushwatch-{uuid.uuid4().hex}"
        self._monitor = self._client.monitor().__enter__()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            event = self._monitor.next_command()
            command = str(event.get("command", ""))
            if self._done in command:
                return
            if command.startswith("LPUSH") and self.queue in command:
                self.pushes.append("lua" if event.get("client_type") == "lua" else "client")

    def stop(self) -> list[str]:
        self._client.echo(self._done)
        self._thread.join(timeout=10)
        self._monitor.__exit__(None, None, None)
        self._client.close()
        return self.pushes


def test_a_default_app_worker_retries_through_the_one_round_trip_publish(
    redis_url: str,
) -> None:
    """The realistic app on both sides (default configuration, broker = the lock Redis, a
    plain task published first): the worker's ``self.retry`` republishes from a pool process
    through taskdedup's own producers; the retry runs, and a third party's duplicate during
    the countdown is suppressed."""
    from tests import celery_app

    queue = f"it-auto-{uuid.uuid4().hex[:6]}"
    app = Celery("auto-worker", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.update(task_default_queue=queue, taskdedup_stats=False)
    assert _fuses(app) and app.conf.broker_transport is None
    plain = app.task(name=celery_app.plain.name, shared=False)(celery_app.plain.run)
    retry_once = app.task(base=DedupTask, name=celery_app.retry_once.name, bind=True,
                          dedup=Policy(mode="until_executed", ttl=60), max_retries=3,
                          shared=False)(celery_app.retry_once.run.__func__)
    client = redis.Redis.from_url(redis_url)
    name = uuid.uuid4().hex[:12]
    worker = CeleryWorker(redis_url, queue=queue, env={"TASKDEDUP_TEST_LOCK_URL": ""}).start()
    watch = PushWatch(redis_url, queue)
    try:
        plain.delay(f"{name}-plain").get(timeout=30)
        first = retry_once.apply_async((name,), {"countdown": 3})
        key = get_deduplicator(app).identity(retry_once.name, retry_once._dedup_policy,
                                             (name,), {"countdown": 3},
                                             func=retry_once._func()).key
        wait_for(lambda: client.get(f"attempts:{name}") == b"1", timeout=30,
                 what="first attempt ran and asked for a retry")
        assert retry_once.apply_async((name,), {"countdown": 3}).id == first.id
        assert first.get(timeout=30) == name
        assert client.lrange(f"effects:{name}", 0, -1) == [b"1", b"2"]
        wait_for(lambda: released(client, key), timeout=10, what="released after success")
        # kombu's own LPUSH for the plain task only; the gated publish and the worker's retry
        # pushed inside the script
        assert sorted(watch.stop()) == ["client", "lua", "lua"]
    finally:
        worker.stop()
        client.close()
        app.close()



def test_with_sent_events_on_a_duplicate_is_checked_before_any_message_is_built(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``task_send_sent_event`` (Flower's ``task-sent``): the gate decides first, so no
    ``task-sent`` announces a duplicate that is never sent; an accepted call is a reserve,
    then the push."""
    app = fused_app(redis_url, task_send_sent_event=True, task_default_queue="fused-sent")
    task = declare(app, "fused.sent-events")
    built: list[str] = []
    send = app.amqp.send_task_message

    def count(producer: Any, name: str, message: Any, **options: Any) -> Any:
        built.append(str(message.headers.get("id")))
        return send(producer, name, message, **options)

    monkeypatch.setattr(app.amqp, "send_task_message", count)
    value = int(uuid.uuid4().int % 10**9)
    counter = CommandCounter(monkeypatch)
    first = task.delay(value)
    assert counter.commands[:1] == ["EVALSHA"] and "LPUSH" in counter.commands
    counter.commands.clear()
    assert task.delay(value).id == first.id
    assert counter.commands == ["EVALSHA"]  # the gate said duplicate: nothing was built
    assert built == [first.id]
