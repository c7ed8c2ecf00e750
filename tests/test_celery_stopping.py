"""Which held messages a stopping worker takes out (:mod:`taskdedup.celery.stopping`): those
whose gated body already finished, by their lock read with their own task id; nothing else.
With real workers: tests/test_celery_fetch_workers.py."""

from __future__ import annotations

import base64
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from kombu.utils.json import dumps

from taskdedup import Policy
from taskdedup.celery import DedupTask, get_deduplicator
from taskdedup.celery.stopping import finished_among
from taskdedup.stores.memory import MemoryStore

LEASE_MS = 60_000


@pytest.fixture
def app() -> Any:
    app = Celery("stopping", set_as_current=False)
    app.conf.update(taskdedup_store=MemoryStore(), taskdedup_stats=False)

    @app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60), name="s.charge")
    def charge(n: int) -> int:
        return n

    @app.task(base=DedupTask, dedup=Policy(mode="until_expired", ttl=60), name="s.report")
    def report(n: int) -> int:
        return n

    @app.task(base=DedupTask, dedup=Policy(mode="until_executing", ttl=60), name="s.notify")
    def notify(n: int) -> int:
        return n

    @app.task(name="s.plain")
    def plain(n: int) -> int:
        return n

    return app


def key(app: Any, name: str, n: int) -> str:
    task = app.tasks[name]
    return str(get_deduplicator(app).identity(name, task._dedup_policy, (n,), {},
                                              func=task._func()).key)


def raw(name: str, task_id: str, lock: str | None, eta: str | None = None,
        args: tuple[Any, ...] | None = None) -> bytes:
    """A message as kombu's Redis transport stores it: the headers, and a body (Celery's
    protocol 2) read only for a message that carries no key this task could have made."""
    headers: dict[str, Any] = {"task": name, "id": task_id, "eta": eta}
    if lock is not None:
        headers["taskdedup"] = {"task": name, "key": lock}
    body = [list(args), {}, {}] if args is not None else []
    return str(dumps({
        "body": base64.b64encode(str(dumps(body)).encode()).decode(), "headers": headers,
        "content-type": "application/json", "content-encoding": "utf-8",
        "properties": {"delivery_tag": uuid.uuid4().hex, "body_encoding": "base64"}})).encode()


def ran_to(app: Any, lock: str, owner: str, *, done: bool = False) -> None:
    """The body of ``owner`` ran and completed its lock: ``D`` (kept) or ``F`` (tombstone)."""
    store = get_deduplicator(app).store
    store.claim(lock, owner, LEASE_MS)
    store.complete(lock, owner, LEASE_MS if done else 0, finished_ms=0 if done else LEASE_MS)


def test_a_message_whose_body_finished_by_its_own_id_is_taken_and_nothing_else(
    app: Any
) -> None:
    ids = {tag: str(uuid.uuid4()) for tag in "abcdefghijklmn"}
    lock = {n: key(app, "s.charge", n) for n in range(1, 12)}
    ran_to(app, lock[1], ids["a"])  # F by a: ran
    ran_to(app, key(app, "s.report", 1), ids["b"], done=True)  # D by b: ran
    get_deduplicator(app).store.claim(lock[2], ids["c"], LEASE_MS)  # R by c: runs now
    ran_to(app, lock[3], "someone-else")  # F by another id: a new call's to make
    ran_to(app, lock[4], ids["e"])  # F by e, but e's message is a countdown still ahead
    ran_to(app, lock[5], ids["f"])  # F by f, the message names another task's key
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    earlier = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()
    ran_to(app, lock[6], ids["g"])  # F by g, its countdown already due
    ran_to(app, key(app, "s.notify", 1), ids["h"], done=True)  # not gated at execution
    messages = {
        "a": raw("s.charge", ids["a"], lock[1]),
        "b": raw("s.report", ids["b"], key(app, "s.report", 1)),
        "c": raw("s.charge", ids["c"], lock[2]),
        "d": raw("s.charge", ids["d"], lock[3]),
        "e": raw("s.charge", ids["e"], lock[4], eta=later),
        "f": raw("s.report", ids["f"], lock[5]),
        "g": raw("s.charge", ids["g"], lock[6], eta=earlier),
        "h": raw("s.notify", ids["h"], key(app, "s.notify", 1)),
        "i": raw("s.plain", ids["i"], None),
        "j": raw("s.charge", ids["j"], None),  # no key, no arguments to make it from
        # sent by name (no key carried): its lock is the identity of its arguments
        "k": raw("s.charge", ids["k"], None, args=(8,)),
        # a forged key: the arguments' lock is read, not the key's
        "l": raw("s.charge", ids["l"], "taskdedup:forged", args=(9,)),
        "m": raw("s.charge", ids["m"], None, args=(10,)),  # its lock R: it runs
        "n": raw("s.charge", ids["n"], None, args=(11,)),  # its lock F by another id
        "o": raw("s.charge", ids["n"], None, args=(1, 2)),  # arguments it does not take
        "x": b"not kombu's json",
    }
    ran_to(app, lock[8], ids["k"])
    ran_to(app, lock[9], ids["l"])
    get_deduplicator(app).store.claim(lock[10], ids["m"], LEASE_MS)
    ran_to(app, lock[11], "someone-else")
    taken = finished_among(app, list(messages.values()))
    assert sorted(tag for tag, message in messages.items() if message in taken) == [
        "a", "b", "g", "k", "l"]


def test_what_kombus_channel_holds_leaves_out_what_celery_acked(redis_url: str) -> None:
    """kombu's fetch: the look reads the QoS's record of delivered messages less those acked
    and not yet dropped from it; any other channel is not looked at."""
    from kombu import Connection

    from taskdedup.celery import _compat

    with Connection(redis_url) as conn:
        channel = conn.default_channel
        held = _compat.held_unacked(channel)
        assert held is not None and held() == []
        channel.qos._delivered.update(a="A", b="B")  # what kombu's append records
        channel.qos._dirty.add("a")  # what QoS.ack marks
        assert held() == [("b", "B")]
        channel.qos._delivered.clear()
        channel.qos._dirty.clear()
    assert _compat.held_unacked(object()) is None


class _Message:
    """A py-amqp message as Celery's request holds it: its headers, acked or not."""

    def __init__(self, headers: dict[str, Any], acknowledged: bool = False) -> None:
        self.headers, self.acknowledged, self.acks = headers, acknowledged, 0

    def ack(self) -> None:
        self.acknowledged, self.acks = True, self.acks + 1


def test_other_transports_note_the_held_requests_that_ran_and_ack_them_at_shutdown(
    app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RabbitMQ: the looks read Celery's held requests and ack nothing (py-amqp is not safe
    to ack on from another thread); what they noted while the tombstone said it ran is acked
    by the step's shutdown, on the consumer's thread, even once the tombstone lapsed. A
    request whose body did not finish, or whose message Celery acked, is left alone."""
    from types import SimpleNamespace

    from celery.worker import state

    from taskdedup.celery.stopping import _gone, _Noted

    ids = {tag: str(uuid.uuid4()) for tag in "abc"}
    lock = {n: key(app, "s.charge", n) for n in range(1, 4)}
    ran_to(app, lock[1], ids["a"])
    get_deduplicator(app).store.claim(lock[2], ids["b"], LEASE_MS)  # running
    ran_to(app, lock[3], ids["c"])
    messages = {tag: _Message({"task": "s.charge", "id": ids[tag], "taskdedup": {
        "task": "s.charge", "key": lock[n]}}, acknowledged=tag == "c")
        for n, tag in enumerate("abc", 1)}
    requests: dict[str, Any] = {ids[tag]: SimpleNamespace(message=message, args=(), kwargs={})
                                for tag, message in messages.items()}
    # sent by name: no key in the header, its lock the identity of the request's arguments
    by_name = _Message({"task": "s.charge", "id": str(uuid.uuid4())})
    ran_to(app, key(app, "s.charge", 4), by_name.headers["id"])
    requests[by_name.headers["id"]] = SimpleNamespace(message=by_name, args=(4,), kwargs={})
    monkeypatch.setattr(state, "requests", requests)
    noted = _Noted(app)
    noted.look()
    assert {m.acks for m in messages.values()} == {0}  # nothing acked off the consumer's thread
    get_deduplicator(app).store.clear()  # the tombstones lapsed during the stop
    noted.ack()
    assert {tag: m.acks for tag, m in messages.items()} == {"a": 1, "b": 0, "c": 0}
    assert by_name.acks == 1
    assert noted.done.is_set()
    # py-amqp's channel says is_open, kombu's closed
    assert _gone(SimpleNamespace(is_open=False, connection=object()))
    assert not _gone(SimpleNamespace(is_open=True, connection=object()))
    assert _gone(SimpleNamespace(closed=False, connection=None))
