"""A completion held for a transaction the worker sends anyway (``RedisStore.hold_here``,
``Deduplicator.finish(..., hold=True)``): a solo worker's next record of a message carries
it, else it goes out on its own within ``HOLD_FOR``; nothing held is ever lost.

The carrier here is a ``MULTI … EXEC`` of this test's own, as kombu's record is in a
worker (``tests/test_celery_solo.py`` shows the real one).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from taskdedup import Deduplicator, Policy, RedisStore, core
from taskdedup.events import DedupEvent, Event
from taskdedup.stores import trail
from taskdedup.testing import wait_for
from tests.claims import claimed_call

NAME = "tests.held"
POLICY = Policy(ttl=60, lease=30)


@pytest.fixture(params=[True, False], ids=["shipped", "scripts"])
def dedup(redis_url: str, request: pytest.FixtureRequest) -> Deduplicator:
    """Each test twice: the completion as a swap (SET IFEQ, where the server has it) and as
    the script."""
    return Deduplicator(RedisStore.from_url(redis_url, compare_and_set=request.param))


@pytest.fixture
def store(dedup: Deduplicator) -> RedisStore:
    assert isinstance(dedup.store, RedisStore)
    return dedup.store


@pytest.fixture
def wakes(dedup: Deduplicator, monkeypatch: pytest.MonkeyPatch) -> Any:
    """This thread holds its completions; the wake-ups it asked for, counted. It stops
    holding at the end (what is held goes out). A held completion is due after 0.5 s
    (``HOLD_FOR``), and the heartbeat thread reads nothing for a minute: what a test does
    meanwhile, however slow the machine, sees what it held still held."""
    monkeypatch.setattr(trail, "HOLD_FOR", 0.5)
    monkeypatch.setattr(core, "SETTLE_AFTER", 60.0)
    store = dedup.store
    assert isinstance(store, RedisStore)
    calls: list[int] = []
    assert store.hold_here(lambda: calls.append(1))
    yield calls
    store.hold_here(None)


def _events(dedup: Deduplicator) -> list[DedupEvent]:
    seen: list[DedupEvent] = []
    dedup.events.add(seen.append)
    return seen


def _carry(client: redis.Redis, store: RedisStore) -> list[Any]:
    """Send what this thread holds in a transaction of its own, as kombu's record does;
    the replies it passed on."""
    held = store.carry_held()
    pipe = client.pipeline(transaction=True)
    pipe.set("held:carrier", "1")  # the carrier's own command
    for command, _ in held:
        pipe.execute_command(*command, get=True)
    replies = pipe.execute(raise_on_error=False)
    store.held_replies(held, replies[1:])
    return replies[1:]


def _held_call(dedup: Deduplicator) -> tuple[RedisStore, str, str]:
    """A fresh call claimed and finished with its completion held: (store, key, owner)."""
    store = dedup.store
    assert isinstance(store, RedisStore)
    key, owner = claimed_call(dedup, NAME, POLICY, uuid.uuid4().hex)
    dedup.finish(NAME, POLICY, key, owner, success=True, later=True, hold=True)
    return store, key, owner


def _done(client: redis.Redis, key: str, owner: str) -> bool:
    return client.get(key) == f"D||{owner}".encode()


def test_a_thread_that_does_not_hold_sends_at_once(
    dedup: Deduplicator, redis_client: redis.Redis
) -> None:
    _, key, owner = _held_call(dedup)
    assert _done(redis_client, key, owner)


def test_a_held_completion_rides_the_next_transaction(
    dedup: Deduplicator, store: RedisStore, redis_client: redis.Redis, wakes: list[int]
) -> None:
    seen = _events(dedup)
    calls = [claimed_call(dedup, NAME, POLICY, uuid.uuid4().hex) for _ in range(2)]
    for key, owner in calls:
        dedup.finish(NAME, POLICY, key, owner, success=True, later=True, hold=True)
        assert redis_client.get(key) == f"R||{owner}".encode()  # held: not on the server yet
    assert wakes == [1]  # one wake-up for the first held, none for the next
    assert len(_carry(redis_client, store)) == 2
    assert all(_done(redis_client, key, owner) for key, owner in calls)
    assert not store.settle(older_than=0.0)  # no reply owed: the transaction brought them
    assert store.flush_held() is None
    completed = [e.task_id for e in seen if e.event is Event.COMPLETED]
    assert completed == [owner for _, owner in calls]
    assert not [e for e in seen if e.event is Event.LEASE_LOST]


def test_a_held_completion_not_carried_goes_out_on_its_own_after_hold_for(
    dedup: Deduplicator, redis_client: redis.Redis, wakes: list[int]
) -> None:
    store, key, owner = _held_call(dedup)
    left = store.flush_held()
    assert left is not None and 0 < left <= 0.5  # not due yet: still held
    assert redis_client.get(key) == f"R||{owner}".encode()
    wait_for(lambda: store.flush_held() is None, timeout=5, what="the held completion due")
    assert _done(redis_client, key, owner)
    assert _carry(redis_client, store) == []  # nothing is carried twice


def test_the_heartbeat_thread_sends_what_nobody_carried_or_flushed(
    dedup: Deduplicator, redis_client: redis.Redis
) -> None:
    """The worker's own timer never comes (its loop is stuck): the heartbeat thread reads
    what this thread owes within ``SETTLE_AFTER`` and sends what it holds first."""
    store = dedup.store
    assert isinstance(store, RedisStore)
    assert store.hold_here(lambda: None)  # a wake-up that does nothing
    try:
        key, owner = claimed_call(dedup, NAME, POLICY, uuid.uuid4().hex)
        dedup.finish(NAME, POLICY, key, owner, success=True, later=True, hold=True)
        wait_for(lambda: _done(redis_client, key, owner), timeout=5,
                 what="the completion sent by the heartbeat thread")
        assert store.flush_held() is None
    finally:
        store.hold_here(None)


def test_a_send_of_this_thread_takes_what_it_holds_first(
    dedup: Deduplicator, redis_client: redis.Redis, wakes: list[int]
) -> None:
    """A claim this thread makes on its own goes out behind the completions it holds: the
    server runs them first, as the worker sent them."""
    store, key, owner = _held_call(dedup)
    claimed_call(dedup, NAME, POLICY, uuid.uuid4().hex)  # the next task's claim
    assert _done(redis_client, key, owner)
    assert store.flush_held() is None


def test_a_refused_transaction_sends_the_held_completions_at_once(
    dedup: Deduplicator, redis_client: redis.Redis, wakes: list[int]
) -> None:
    store, key, owner = _held_call(dedup)
    held = store.carry_held()
    assert len(held) == 1
    store.held_replies(held, None)  # the carrier's transaction was refused as a whole
    assert _done(redis_client, key, owner)


def test_stopping_to_hold_sends_what_is_held(
    dedup: Deduplicator, redis_client: redis.Redis, wakes: list[int]
) -> None:
    store, key, owner = _held_call(dedup)
    store.hold_here(None)
    assert _done(redis_client, key, owner)
    other, owner2 = claimed_call(dedup, NAME, POLICY, uuid.uuid4().hex)
    dedup.finish(NAME, POLICY, other, owner2, success=True, later=True, hold=True)
    assert _done(redis_client, other, owner2)  # no longer held


def test_a_lock_lost_before_its_carried_completion_is_reported(
    dedup: Deduplicator, store: RedisStore, redis_client: redis.Redis, wakes: list[int]
) -> None:
    seen = _events(dedup)
    store, key, owner = _held_call(dedup)
    redis_client.set(key, "R||someone-else")  # its lease lapsed, another call took it
    _carry(redis_client, store)
    assert redis_client.get(key) == b"R||someone-else"  # a former owner writes nothing
    assert [e.task_id for e in seen if e.event is Event.LEASE_LOST] == [owner]


def test_a_flushed_script_cache_is_completed_again(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The script, carried after a ``SCRIPT FLUSH``, answers NOSCRIPT: made again."""
    dedup = Deduplicator(RedisStore.from_url(redis_url, compare_and_set=False))
    store = dedup.store
    assert isinstance(store, RedisStore)
    assert store.hold_here(lambda: None)
    try:
        key, owner = claimed_call(dedup, NAME, POLICY, uuid.uuid4().hex)
        dedup.finish(NAME, POLICY, key, owner, success=True, later=True, hold=True)
        redis_client.script_flush()
        replies = _carry(redis_client, store)
        assert isinstance(replies[0], redis.exceptions.NoScriptError)
        assert _done(redis_client, key, owner)
    finally:
        store.hold_here(None)
