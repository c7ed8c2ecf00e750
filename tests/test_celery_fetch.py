"""The reliable fetch on kombu's channel, against a real server (SPEC §17; issue #21).

kombu connections on taskdedup's transport with ``taskdedup_reliable_fetch``: what a fetch,
an ack, a reject, a close and a dead owner do to the queue, the processing lists and the
registry, and that the order is kombu's. Real workers: tests/test_celery_fetch_workers.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from taskdedup import processing
from taskdedup.celery.fetch import requeue_orphans
from taskdedup.celery.transport import RedisTransport
from taskdedup.testing import wait_for
from tests.workers import ROOT

LEASE = 2.0


@pytest.fixture
def prefix() -> str:
    return f"fx{uuid.uuid4().hex[:6]}"


def reliable(url: str, prefix: str, **options: Any) -> Connection:
    return Connection(url, transport=RedisTransport, transport_options={
        "taskdedup_reliable_fetch": True, "taskdedup_fetch_lease": LEASE,
        "taskdedup_prefix": prefix, **options})


def kombus(url: str, **options: Any) -> Connection:
    return Connection(url, transport_options=options)


def queue(name: str) -> Queue:
    return Queue(name, Exchange(name), name, max_priority=9)


def publish(url: str, name: str, bodies: list[Any], priority: int | None = None,
            **options: Any) -> None:
    with Connection(url, transport_options=options) as conn:
        producer = Producer(conn.default_channel)
        for body in bodies:
            producer.publish(body, exchange=name, routing_key=name, declare=[queue(name)],
                             serializer="json",
                             priority=priority)


class Taker:
    """A consumer that keeps every message it gets (nothing acked)."""

    def __init__(self, conn: Connection, names: list[str], no_ack: bool = False,
                 prefetch: int = 0) -> None:
        self.conn = conn
        self.got: list[Any] = []
        channel = conn.channel()
        if prefetch:
            channel.basic_qos(0, prefetch, False)
        self.consumer = Consumer(channel, [queue(n) for n in names], no_ack=no_ack,
                                 callbacks=[lambda body, message: self.got.append(message)])
        self.consumer.consume()

    def take(self, n: int, timeout: float = 5.0) -> list[Any]:
        deadline = time.monotonic() + timeout
        while len(self.got) < n:
            try:
                self.conn.drain_events(timeout=max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                break
        return self.got


def bodies(rc: redis.Redis, key: str) -> list[Any]:
    """The message bodies of a kombu list, in the order kombu pops them (right first)."""
    import base64
    import json

    out = []
    for raw in reversed(rc.lrange(key, 0, -1)):
        message = json.loads(raw)
        out.append(json.loads(base64.b64decode(message["body"])))
    return out


def lists(rc: redis.Redis, prefix: str) -> dict[str, int]:
    return {h.owner: h.held for h in processing.holders(rc, prefix)}


@pytest.fixture
def rc(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def test_a_message_moves_into_the_owners_processing_list_and_leaves_it_on_ack(
    redis_url: str, rc: redis.Redis, prefix: str
) -> None:
    name = f"q-{uuid.uuid4().hex[:6]}"
    publish(redis_url, name, [1, 2, 3])
    with reliable(redis_url, prefix) as conn:
        taker = Taker(conn, [name])
        got = taker.take(3)
        assert [m.payload for m in got] == [1, 2, 3]
        assert rc.llen(name) == 0
        (holder,) = processing.holders(rc, prefix)
        assert holder.lists == {name: 3} and holder.ttl_ms > 0 and not holder.orphan
        assert holder.pid == os.getpid() and holder.lease_ms == LEASE * 1000
        held = rc.lrange(processing.list_key(prefix, holder.owner, name), 0, -1)
        assert sorted(held) == sorted(m.channel.qos._held[m.delivery_tag].raw for m in got)
        # nothing in kombu's unacked hash: kombu never restores these by time
        assert not rc.exists("unacked", "unacked_index")
        got[1].ack()
        assert lists(rc, prefix) == {holder.owner: 2}
        got[0].ack()
        got[2].ack()
        assert lists(rc, prefix) == {holder.owner: 0}
    assert processing.holders(rc, prefix) == []  # a clean close leaves the registry
    assert not rc.keys(f"{prefix}:*")


def test_reject_with_requeue_puts_the_message_back_at_the_head_marked_redelivered(
    redis_url: str, rc: redis.Redis, prefix: str
) -> None:
    name = f"q-{uuid.uuid4().hex[:6]}"
    publish(redis_url, name, ["a", "b", "c", "d"])
    with reliable(redis_url, prefix) as conn:
        taker = Taker(conn, [name])
        got = list(taker.take(2))
        got[1].reject(requeue=True)
        assert bodies(rc, name) == ["b", "c", "d"]  # b is next out
        got[0].reject(requeue=False)
        assert bodies(rc, name) == ["b", "c", "d"]  # a is gone
        assert lists(rc, prefix) == {got[0].channel._taskdedup_fetcher.owner: 0}
        again = taker.take(3)[2]
        assert again.payload == "b"
        assert again.delivery_info["redelivered"] is True
        assert again.headers["redelivered"] is True
        again.ack()


def test_close_puts_back_what_the_consumer_held_at_the_head_in_order(
    redis_url: str, rc: redis.Redis, prefix: str
) -> None:
    """A warm shutdown: the held messages go back first-taken-next-out, ahead of the queue."""
    name = f"q-{uuid.uuid4().hex[:6]}"
    publish(redis_url, name, list(range(6)))
    conn = reliable(redis_url, prefix)
    got = Taker(conn, [name], prefetch=3).take(3)
    assert [m.payload for m in got] == [0, 1, 2]
    got[1].ack()
    conn.close()
    assert bodies(rc, name) == [0, 2, 3, 4, 5]
    assert processing.holders(rc, prefix) == [] and not rc.keys(f"{prefix}:*")


def test_a_heartbeat_late_for_a_close_does_not_bring_the_owner_back(
    redis_url: str, rc: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heartbeat thread took its list of owners just before the channel closed and renews
    this one after the close left the registry, before kombu's close drops the pool: the late
    renewal writes nothing, so an owner that left does not show in ``taskdedup doctor`` or the
    dashboard (where it stayed a lease, then an orphan); once the pool is gone it does not fail
    either (a WARNING that the lease could not be renewed)."""
    from taskdedup.celery import _compat

    name = f"q-{uuid.uuid4().hex[:6]}"
    publish(redis_url, name, ["a"])
    conn = reliable(redis_url, prefix)
    (message,) = Taker(conn, [name]).take(1)
    fetcher = message.channel._taskdedup_fetcher
    message.ack()
    kombus_close = _compat.Channel.close

    def a_late_beat_then_kombus_close(channel: Any) -> None:
        fetcher.beat()  # the thread, with its list from before the close, renews now
        kombus_close(channel)

    monkeypatch.setattr(_compat.Channel, "close", a_late_beat_then_kombus_close)
    conn.close()
    assert processing.holders(rc, prefix) == [] and not rc.keys(f"{prefix}:*")
    fetcher.beat()  # later still: the channel's pool is gone
    assert not rc.keys(f"{prefix}:*")


def test_a_wait_pending_at_close_leaves_nothing_in_the_processing_list(
    redis_url: str, rc: redis.Redis, prefix: str
) -> None:
    """The consumer waits (BLMOVE pending on the server) when the message arrives and is moved,
    but the reply is not read yet: close reads it and puts the message back (kombu 5.3 to 5.5
    drop a pending BRPOP reply at close: that message is lost)."""
    name = f"q-{uuid.uuid4().hex[:6]}"
    publish(redis_url, name, [])
    conn = reliable(redis_url, prefix, taskdedup_fetch_lease=40, taskdedup_fetch_poll=10)
    taker = Taker(conn, [name])
    assert taker.take(1, timeout=0.3) == []  # now waiting on the server
    publish(redis_url, name, ["late"])
    (owner,) = lists(rc, prefix)
    wait_for(lambda: rc.llen(processing.list_key(prefix, owner, name)) == 1, timeout=5,
             what="the waiting BLMOVE moved the message")
    conn.close()
    assert bodies(rc, name) == ["late"]
    assert processing.holders(rc, prefix) == []


def test_priorities_and_queues_are_taken_in_kombus_order(
    redis_url: str, rc: redis.Redis, prefix: str
) -> None:
    """The same messages, consumed by kombu's fetch and by the reliable fetch, come out in the
    same order: priority lists first (0 highest on Redis), queues round robin."""
    names = [f"o1-{uuid.uuid4().hex[:4]}", f"o2-{uuid.uuid4().hex[:4]}"]  # one order of both

    def order(conn: Connection) -> list[Any]:
        for tag, name in zip("xy", names, strict=True):
            publish(redis_url, name, [f"{tag}0-{i}" for i in range(3)], priority=0)
            publish(redis_url, name, [f"{tag}6-{i}" for i in range(2)], priority=6)
            publish(redis_url, name, [f"{tag}9"], priority=9)
        taker = Taker(conn, names)
        got = taker.take(12)
        for message in got:
            message.ack()
        return [m.payload for m in got]

    with kombus(redis_url) as conn:
        expected = order(conn)
    with reliable(redis_url, prefix) as conn:
        assert order(conn) == expected
    assert expected[:2] == ["x0-0", "y0-0"] or expected[:2] == ["y0-0", "x0-0"]


def test_a_consumer_without_acks_takes_messages_out_of_the_processing_list(
    redis_url: str, rc: redis.Redis, prefix: str
) -> None:
    name, acked = f"n-{uuid.uuid4().hex[:6]}", f"a-{uuid.uuid4().hex[:6]}"
    publish(redis_url, name, [1, 2])
    publish(redis_url, acked, [3])
    with reliable(redis_url, prefix) as conn:
        taker = Taker(conn, [name], no_ack=True)
        assert [m.payload for m in taker.take(2)] == [1, 2]
        assert processing.holders(rc, prefix) == []  # only no_ack consumers: kombu's fetch
        both = Taker(conn, [acked])
        assert [m.payload for m in both.take(1)] == [3]
        assert sum(lists(rc, prefix).values()) == 1


def test_kombus_global_key_prefix_names_the_sources(
    redis_url: str, rc: redis.Redis, prefix: str
) -> None:
    name = f"p-{uuid.uuid4().hex[:6]}"
    publish(redis_url, name, ["a", "b"], global_keyprefix="app1:")
    assert rc.llen(f"app1:{name}") == 2
    with reliable(redis_url, prefix, global_keyprefix="app1:") as conn:
        got = Taker(conn, [name]).take(2)
        assert [m.payload for m in got] == ["a", "b"]
        (holder,) = processing.holders(rc, prefix)
        assert holder.lists == {f"app1:{name}": 2}
        got[0].ack()
    assert bodies(rc, f"app1:{name}") == ["b"]


def test_an_idle_consumer_wakes_at_once_for_its_queue_and_within_the_poll_for_the_others(
    redis_url: str, rc: redis.Redis, prefix: str
) -> None:
    """An idle consumer blocks (BLMOVE) on its first queue's default list: a plain message
    there wakes it at once; a priority message is found by the next look at every list, within
    the poll (3 s here, to tell the two apart on a loaded machine; 0.2 s by default)."""
    name = f"w-{uuid.uuid4().hex[:6]}"
    with reliable(redis_url, prefix, taskdedup_fetch_lease=40, taskdedup_fetch_poll=3) as conn:
        taker = Taker(conn, [name])
        assert taker.take(1, timeout=0.5) == []
        delays = {}
        for priority in (0, 6):
            threading.Timer(0.3, publish, (redis_url, name, [priority]),
                            {"priority": priority}).start()
            start = time.monotonic()
            (message,) = taker.take(len(taker.got) + 1, timeout=10)[-1:]
            delays[priority] = time.monotonic() - start - 0.3
            message.ack()
        assert delays[0] < 1.0, delays  # woken by the BLMOVE
        assert delays[6] < 3.0 + 1.0, delays  # found by the next script, within the poll


def test_a_dead_owners_messages_come_back_within_its_lease(
    redis_url: str, rc: redis.Redis, prefix: str
) -> None:
    """A process takes two messages and is SIGKILLed: its lease lapses, and a live consumer's
    heartbeat puts them back at the head of their queue, marked redelivered; the dead owner
    leaves the registry."""
    name = f"d-{uuid.uuid4().hex[:6]}"
    publish(redis_url, name, ["a", "b", "c"])
    script = (
        "import os, signal, sys\n"
        "sys.path.insert(0, sys.argv[3])\n"
        "from tests.test_celery_fetch import reliable, Taker\n"
        "conn = reliable(sys.argv[1], sys.argv[2])\n"
        "Taker(conn, [sys.argv[4]], prefetch=2).take(2)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, redis_url, prefix, str(ROOT), name],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    (dead,) = processing.holders(rc, prefix)
    assert dead.held == 2 and bodies(rc, name) == ["c"]
    killed = time.monotonic()
    with reliable(redis_url, prefix) as conn:  # a live worker
        taker = Taker(conn, [name])
        got = taker.take(3, timeout=LEASE * 3)
        back = time.monotonic() - killed
        assert sorted(m.payload for m in got) == ["a", "b", "c"]
        assert [m.payload for m in got[-2:]] == ["a", "b"]  # back at the head, in order
        assert all(m.delivery_info.get("redelivered") for m in got[-2:])
        assert back < LEASE + LEASE / 3 + 1.0
        assert [h.owner for h in processing.holders(rc, prefix)] != [dead.owner]
        for message in got:
            message.ack()


def test_two_live_workers_never_requeue_one_orphan_twice(
    redis_url: str, rc: redis.Redis, prefix: str
) -> None:
    """An orphan holding 1,200 messages over two sources, requeued by four workers at once:
    each message comes back exactly once."""
    owner = "dead@host/1/abcdef12"
    sources = {f"s1-{uuid.uuid4().hex[:4]}": 700, f"s2-{uuid.uuid4().hex[:4]}": 500}
    rc.hset(processing.owners_key(prefix), owner, '{"worker": "dead@host", "pid": 1}')
    for source, count in sources.items():
        rc.sadd(processing.sources_key(prefix, owner), source)
        rc.lpush(processing.list_key(prefix, owner, source),
                 *[f'{{"n": {i}}}'.encode() for i in range(count)])
    totals: list[int] = []
    barrier = threading.Barrier(4)

    def reap() -> None:
        client = redis.Redis.from_url(redis_url)
        barrier.wait()
        totals.append(requeue_orphans(client, prefix))

    threads = [threading.Thread(target=reap) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sum(totals) == 1200
    for source, count in sources.items():
        items = rc.lrange(source, 0, -1)
        assert len(items) == count and len(set(items)) == count
        assert items[-1] == b'{"n": 0}'  # the first taken is next out
    assert processing.holders(rc, prefix) == [] and not rc.keys(f"{prefix}:*")


def test_a_live_owners_messages_are_never_restored_whatever_the_visibility_timeout(
    redis_url: str, rc: redis.Redis, prefix: str
) -> None:
    """Held past kombu's visibility timeout (1 s here) by a live owner, with kombu's own
    restore and taskdedup's orphan requeue run again and again: nothing comes back."""
    name = f"v-{uuid.uuid4().hex[:6]}"
    publish(redis_url, name, ["eta"])
    with reliable(redis_url, prefix, visibility_timeout=1) as conn:
        (message,) = Taker(conn, [name]).take(1)
        deadline = time.monotonic() + 2 * LEASE
        while time.monotonic() < deadline:
            message.channel.qos.restore_visible(num=100, interval=1)
            assert requeue_orphans(rc, prefix) == 0
            time.sleep(0.2)
        assert rc.llen(name) == 0 and lists(rc, prefix) == {
            message.channel._taskdedup_fetcher.owner: 1}
        message.ack()


def test_the_operators_tools_leave_the_processing_lists_alone(
    redis_url: str, rc: redis.Redis, prefix: str
) -> None:
    """The fetch's keys live under the prefix beside the locks: ``taskdedup list`` shows no
    lock for them and ``taskdedup clear --all`` deletes locks only, never a held message."""
    from click.testing import CliRunner

    from taskdedup.cli import main

    name = f"c-{uuid.uuid4().hex[:6]}"
    publish(redis_url, name, ["kept"])
    with reliable(redis_url, prefix) as conn:
        (message,) = Taker(conn, [name]).take(1)
        for args in (["list"], ["clear", "--all", "--yes"]):
            done = CliRunner().invoke(main, ["--url", redis_url, "--prefix", prefix, *args])
            assert done.exit_code == 0, done.output
            assert "fetch" not in done.output
        assert lists(rc, prefix) == {message.channel._taskdedup_fetcher.owner: 1}
        message.ack()


# -- the choice, per app ------------------------------------------------------------------------


def fresh_app(broker: str, **settings: Any) -> Any:
    from celery import Celery

    app = Celery(f"choice-{uuid.uuid4().hex[:6]}", broker=broker, set_as_current=False)
    app.conf.update(settings)
    return app


def test_the_fetch_is_chosen_once_per_app_and_applied_only_to_its_workers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Off: nothing said, nothing changed. On with one redis:// (or kombu's own transport
    name): the worker's transport becomes taskdedup's, with the fetch's options, and an INFO
    says so; a bare rediss:// keeps kombu's TLS default; sentinel:// gets the Sentinel
    variant. CELERY_TASKDEDUP_RELIABLE_FETCH from Django settings maps to the setting."""
    from taskdedup.celery.config import fuses, reliable_fetch, use_reliable_fetch
    from taskdedup.celery.transport import SENTINEL_TRANSPORT, TRANSPORT

    caplog.set_level("INFO", logger="taskdedup")
    off = fresh_app("redis://h:1/0")
    assert not use_reliable_fetch(off) and off.conf.broker_transport is None
    assert "fetch" not in caplog.text
    on = fresh_app("redis://h:1/0", taskdedup_reliable_fetch=True, taskdedup_fetch_lease=12,
                   broker_transport_options={"visibility_timeout": 60})
    assert fuses(on) and "producers of their own" in on.__dict__["_taskdedup_fuses_why"]
    assert use_reliable_fetch(on, "w1@host")
    assert on.conf.broker_transport == TRANSPORT
    assert on.conf.broker_transport_options == {
        "visibility_timeout": 60, "taskdedup_reliable_fetch": True,
        "taskdedup_fetch_lease": 12.0, "taskdedup_fetch_poll": 0.2,
        "taskdedup_prefix": "taskdedup", "taskdedup_worker": "w1@host"}
    assert caplog.text.count("consumes through taskdedup's reliable fetch") == 1
    assert reliable_fetch(on) and caplog.text.count("reliable fetch") == 1  # decided once
    assert fuses(on) and on.__dict__["_taskdedup_fuses_why"] == (  # the worker's transport
        "gated publishes reserve inside the broker's push (one round trip)")
    tls = fresh_app("rediss://h:1/0", taskdedup_reliable_fetch=True)
    assert use_reliable_fetch(tls) and tls.conf.broker_use_ssl["ssl_cert_reqs"] == 0
    named = fresh_app("redis://h:1/0", taskdedup_reliable_fetch=True, broker_transport="redis")
    assert use_reliable_fetch(named) and named.conf.broker_transport == TRANSPORT
    sentinel = fresh_app("sentinel://h:26379", taskdedup_reliable_fetch=True)
    assert use_reliable_fetch(sentinel) and sentinel.conf.broker_transport == SENTINEL_TRANSPORT

    class Django:
        CELERY_BROKER_URL = "redis://h:1/0"
        CELERY_TASKDEDUP_RELIABLE_FETCH = True
        CELERY_TASKDEDUP_FETCH_LEASE = 7

    django = fresh_app("redis://h:1/0")
    django.config_from_object(Django, namespace="CELERY")
    assert use_reliable_fetch(django)
    assert django.conf.broker_transport_options["taskdedup_fetch_lease"] == 7.0


@pytest.mark.parametrize(("broker", "settings", "why"), [
    ("amqp://h//", {}, "the broker is not Redis (amqp://)"),
    ("redis://h:1/0", {"broker_transport": "myproject.transport:Mine"},
     "broker_transport is 'myproject.transport:Mine', not taskdedup's"),
    ("redis://h:1/0", {"broker_transport_options": {"ack_emulation": False}},
     "ack_emulation'] is False"),
])
def test_a_worker_that_cannot_use_the_reliable_fetch_keeps_kombus_and_warns(
    caplog: pytest.LogCaptureFixture, broker: str, settings: dict[str, Any], why: str,
) -> None:
    from taskdedup.celery.config import use_reliable_fetch

    app = fresh_app(broker, taskdedup_reliable_fetch=True, **settings)
    transport = app.conf.broker_transport
    assert not use_reliable_fetch(app)
    assert app.conf.broker_transport == transport
    (record,) = [r for r in caplog.records if "fetch" in r.getMessage()]
    assert record.levelname == "WARNING"
    assert "the fetch is not reliable" in record.getMessage() and why in record.getMessage()


def test_a_kombu_that_moved_what_the_fetch_relies_on_keeps_kombus_fetch(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checked when the worker starts: a channel without kombu's _brpop_read (a future
    kombu) is named in the WARNING, and the worker consumes with kombu's own code."""
    from taskdedup.celery import _compat
    from taskdedup.celery.config import use_reliable_fetch

    class Moved(_compat.Channel):  # type: ignore[misc]
        _brpop_read = None

    assert _compat.reliable_fetch_missing(Moved) == (
        "kombu's Redis channel's _brpop_read is not a method")
    monkeypatch.setattr(RedisTransport, "Channel", Moved)
    app = fresh_app("redis://h:1/0", taskdedup_reliable_fetch=True)
    assert not use_reliable_fetch(app) and app.conf.broker_transport is None
    assert "_brpop_read is not a method: the worker keeps kombu's fetch" in caplog.text


def test_an_app_on_the_reliable_fetch_is_not_warned_about_countdowns_beyond_the_visibility(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """kombu hands out a copy of a held countdown every visibility_timeout; the reliable fetch
    never does, so a countdown beyond it is not worth a WARNING (nor a shorter wait for a
    copy, see taskdedup.core.copy_wait)."""
    from taskdedup import Policy
    from taskdedup.celery import DedupTask
    from taskdedup.celery.config import visibility_timeout
    from taskdedup.celery.task import _reservation_ttl_ms

    options = {"broker_transport_options": {"visibility_timeout": 60}}
    assert visibility_timeout(fresh_app("redis://h:1/0", **options)) == 60
    assert visibility_timeout(fresh_app("redis://h:1/0", taskdedup_reliable_fetch=True,
                                        **options)) is None
    app = fresh_app("redis://h:1/0", taskdedup_reliable_fetch=True, **options)

    @app.task(name="far.away", base=DedupTask, dedup=Policy(ttl=10), shared=False)
    def far_away() -> None: ...

    _reservation_ttl_ms(far_away._dedup_policy, {"countdown": 3600}, far_away)
    assert "visibility_timeout" not in caplog.text
