"""What taskdedup relies on in kombu is checked when the app is configured; without it the
app takes the public path. And a publish that kombu retries after a lost reply: never an
error after publishing, never a second copy."""

from __future__ import annotations

import json
import logging
import shutil
import ssl
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu.transport import redis as kombu_redis

from taskdedup import Policy
from taskdedup.celery import DedupTask, RedisTransport, _compat, get_deduplicator
from tests.counting import CommandCounter
from tests.proxy import Proxy
from tests.tls import self_signed_certificate

RENAMED = "_queue_for_priority"


def make_app(url: str, queue: str, **conf: Any) -> Celery:
    app = Celery("compat", broker=url, set_as_current=False)
    app.conf.update(task_default_queue=queue, task_ignore_result=True, taskdedup_stats=False,
                    **conf)
    return app


def declare(app: Celery, name: str) -> Any:
    def body(x: Any) -> Any:
        return x

    return app.task(base=DedupTask, name=name, dedup=Policy(ttl=60), shared=False)(body)


def queued(client: redis.Redis, queue: str) -> list[str]:
    return [json.loads(m)["headers"]["id"] for m in client.lrange(queue, 0, -1)]


@pytest.fixture
def renamed_internal(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A kombu release that renamed ``Channel._q_for_pri`` (its own ``_put``/``_size``
    follow)."""
    original = kombu_redis.Channel._q_for_pri

    def _put(self: Any, queue: str, message: Any, **kwargs: Any) -> None:
        priority = self._get_message_priority(message, reverse=False)
        with self.conn_or_acquire() as client:
            client.lpush(getattr(self, RENAMED)(queue, priority), json.dumps(message))

    def _size(self: Any, queue: str) -> int:
        with self.conn_or_acquire() as client:
            return sum(client.llen(getattr(self, RENAMED)(queue, pri))
                       for pri in self.priority_steps)

    monkeypatch.setattr(kombu_redis.Channel, RENAMED, original, raising=False)
    monkeypatch.setattr(kombu_redis.Channel, "_size", _size)
    monkeypatch.delattr(kombu_redis.Channel, "_q_for_pri")
    monkeypatch.setattr(kombu_redis.Channel, "_put", _put)
    yield


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_a_missing_kombu_internal_takes_the_public_path_with_one_info_line(
    redis_url: str, redis_client: redis.Redis, renamed_internal: None,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, checked: bool,
) -> None:
    """Issue #10 item 2: with ``_q_for_pri`` gone the fused push cannot name the queue; the
    check made when the task is bound sends the app down the public path (reserve, then
    kombu's own publish): ``delay()`` works and dedups, one INFO line says why. Unchecked
    (the control), the same call fails."""
    if not checked:
        monkeypatch.setattr(_compat, "fused_push_missing", lambda channel=None: None)
    queue = f"compat-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_url, queue)
    task = declare(app, "compat.renamed")
    try:
        with caplog.at_level(logging.INFO, logger="taskdedup"):
            if not checked:
                with pytest.raises(AttributeError, match="_q_for_pri"):
                    task.delay(1)
                return
            first = task.delay(1)
            again = task.delay(1)
            other = task.delay(2)
        assert again.id == first.id and other.id != first.id
        assert sorted(queued(redis_client, queue)) == sorted([first.id, other.id])
        why = [r for r in caplog.records if "has no _q_for_pri" in r.getMessage()]
        assert len(why) == 1 and why[0].levelno == logging.INFO
    finally:
        redis_client.delete(queue)
        app.close()


def test_the_check_finds_what_this_kombu_has() -> None:
    assert _compat.fused_push_missing(kombu_redis.Channel) is None
    assert _compat.fused_push_missing(RedisTransport.Channel) is None


def test_a_publish_retried_after_a_lost_reply_pushes_the_message_once(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery's ``task_publish_retry``: the script ran but its reply was lost (the connection
    broke). kombu retries the publish as it would a plain one; the resent script finds this
    owner's queued lock and pushes nothing again: one message, the caller gets its handle."""
    queue = f"compat-retry-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_url, queue)
    task = declare(app, "compat.retry")
    original = redis.Redis.execute_command
    lost: list[str] = []

    def lose_first_reply(client: redis.Redis, *args: Any, **options: Any) -> Any:
        reply = original(client, *args, **options)
        if str(args[0]).upper() in ("EVALSHA", "EVAL") and not lost:
            lost.append(str(args[0]))
            raise redis.ConnectionError("connection lost after the command ran (test)")
        return reply

    try:
        task.delay(0)  # connects, loads the script
        monkeypatch.setattr(redis.Redis, "execute_command", lose_first_reply)
        handle = task.delay(1)
        monkeypatch.undo()
        assert lost == ["EVALSHA"]
        assert queued(redis_client, queue).count(handle.id) == 1
        assert len(queued(redis_client, queue)) == 2
        key = get_deduplicator(app).identity("compat.retry", task._dedup_policy, (1,), {},
                                             func=task._func()).key
        assert redis_client.get(key) == f"Q||{handle.id}".encode()
        assert task.delay(1).id == handle.id
    finally:
        redis_client.delete(queue)
        app.close()


def test_a_broadcast_queue_is_gated_inside_the_script(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """SPEC §6: a fanout (broadcast) publish is gated like any other, inside the script, and
    never raises after publishing: the original is broadcast once, its duplicate not at all."""
    from kombu.common import Broadcast

    name = f"compat-bcast-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_url, "compat-default", task_queues=(Broadcast(name),))
    task = declare(app, "compat.bcast")
    listener = redis_client.pubsub()
    listener.psubscribe(f"*{name}*")
    try:
        queue = Broadcast(name)
        # Celery does not declare a Broadcast queue when it publishes; this producer does, so
        # kombu knows the exchange is a fanout (a worker consuming it declares it too).
        first = task.apply_async((1,), queue=queue, declare=[queue])
        again = task.apply_async((1,), queue=queue, declare=[queue])
        assert again.id == first.id
        got: list[str] = []
        while (message := listener.get_message(timeout=0.5)) is not None:
            if message["type"] == "pmessage":
                got.append(json.loads(message["data"])["headers"]["id"])
        assert got == [first.id]
    finally:
        listener.close()
        app.close()


@pytest.fixture
def tls_proxy(redis_url: str) -> Iterator[tuple[str, Path]]:
    """A TLS terminator in front of the test server (``rediss://`` only) and its CA file."""
    folder = Path(tempfile.mkdtemp(prefix="taskdedup-celery-tls-"))
    cert, key = self_signed_certificate(folder)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    host, port = redis_url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)
    try:
        with Proxy((host, int(port)), ssl_context=context) as proxy:
            yield proxy.url, cert
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("options", ["ca", "none", "explicit"])
def test_rediss_keeps_tls_on_the_one_round_trip_publish(
    tls_proxy: tuple[str, Path], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    options: str,
) -> None:
    """A ``rediss://`` broker (the proxy speaks only TLS): the gated publish goes through
    RedisTransport in one round trip and over TLS — with the URL's ``ssl_*`` options, and
    without them (kombu's ``rediss`` default), with RedisTransport chosen by taskdedup or
    named in ``broker_transport``."""
    url, cert = tls_proxy
    if options == "ca":
        url += f"?ssl_cert_reqs=required&ssl_ca_certs={cert}"
    queue = f"compat-tls-{uuid.uuid4().hex[:8]}"
    app = make_app(url, queue)
    if options == "explicit":
        app.conf.broker_transport = "taskdedup.celery:RedisTransport"
    task = declare(app, f"compat.tls-{options}")
    try:
        task.delay(0)  # connects, loads the script
        counter = CommandCounter(monkeypatch)
        first = task.delay(1)
        assert task.delay(1).id == first.id
        monkeypatch.undo()
        assert counter.commands == ["EVALSHA", "EVALSHA"]
        assert sorted(queued(redis_client, queue)) != [] and queued(redis_client, queue).count(
            first.id) == 1
    finally:
        redis_client.delete(queue)
        app.close()


def test_a_gated_publish_inside_a_kombu_publish_batch_keeps_the_order(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """kombu 5.7's ``producer.batch()`` buffers pushes until the block ends; a gated message
    cannot wait (its caller needs the gate's answer), so the buffered messages go first, then
    the script: call order kept, a duplicate pushes nothing."""
    from kombu import Producer

    if not hasattr(Producer, "batch"):
        pytest.skip("this kombu has no producer.batch()")
    queue = f"compat-pbatch-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_url, queue, broker_transport="taskdedup.celery:RedisTransport")
    task = declare(app, "compat.pbatch")

    def plain(x: Any) -> Any:
        return x

    untouched = app.task(name="compat.pbatch-plain", shared=False)(plain)
    try:
        with app.producer_or_acquire() as producer, producer.batch():
            before = untouched.apply_async((0,), producer=producer)
            gated = task.apply_async((1,), producer=producer)
            again = task.apply_async((1,), producer=producer)
            after = untouched.apply_async((2,), producer=producer)
        assert again.id == gated.id
        oldest_first = list(reversed(queued(redis_client, queue)))
        assert oldest_first == [before.id, gated.id, after.id]
    finally:
        redis_client.delete(queue)
        app.close()


def test_a_message_routed_to_two_queues_is_pushed_to_both_once(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """kombu's Redis transport delivers a message bound to two queues with two pushes of one
    publish: the first reserves, the second (the same owner) pushes too; a duplicate pushes
    to neither."""
    from kombu import Exchange, Queue

    run = uuid.uuid4().hex[:8]
    exchange = Exchange(f"compat-ex-{run}", "direct")
    queues = [Queue(f"compat-q{i}-{run}", exchange, routing_key="rk") for i in (1, 2)]
    app = make_app(redis_url, "compat-default")
    task = declare(app, "compat.two-queues")
    try:
        with app.connection_for_write() as connection:
            for queue in queues:
                queue(connection.default_channel).declare()
        first = task.apply_async((1,), exchange=exchange, routing_key="rk")
        again = task.apply_async((1,), exchange=exchange, routing_key="rk")
        assert again.id == first.id
        assert [queued(redis_client, q.name) for q in queues] == [[first.id], [first.id]]
    finally:
        redis_client.delete(*(q.name for q in queues))
        app.close()


def test_queue_expiry_is_refreshed_inside_the_script_where_kombu_has_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """kombu 5.7 expires a queue declared with ``x-expires`` and refreshes it on every push;
    the fused push does the same inside its script. kombu 5.3 to 5.6 have no queue expiry (no
    ``Channel._expires``): the publish works and sets none (it raised AttributeError after
    pushing, issue #10)."""
    from kombu import Queue

    name = f"compat-expiring-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_url, name,
                   task_queues=(Queue(name, queue_arguments={"x-expires": 60_000}),))
    task = declare(app, "compat.expiring")
    try:
        first = task.delay(1)
        assert task.delay(1).id == first.id
        assert queued(redis_client, name) == [first.id]
        ttl = redis_client.pttl(name)
        if hasattr(kombu_redis.Channel, "_get_queue_expire"):
            assert 0 < ttl <= 60_000
        else:
            assert ttl == -1
    finally:
        redis_client.delete(name)
        app.close()
