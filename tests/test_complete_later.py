"""A worker's completion sent at once, its reply read later (``RedisStore.complete_later``).

The completion is on the server as soon as ``finish(later=True)`` returns (another client
reads DONE at once), and ``completed`` is emitted then; its reply is read on the worker's next
claim or by the heartbeat thread within ``SETTLE_AFTER``, and a lock found gone is reported
then (``lease_lost`` with its WARNING). A connection broken or a script cache flushed before
the reply is read has the completion made again: it is idempotent for its owner.
"""

from __future__ import annotations

import logging
import uuid

import pytest
import redis

from taskdedup import Deduplicator, Policy, RedisStore
from taskdedup.events import DedupEvent, Event
from taskdedup.stores import trail
from taskdedup.testing import wait_for
from tests.claims import claimed_call
from tests.forking import child_runs_while_held

NAME = "tests.later"
POLICY = Policy(ttl=60, lease=30)


@pytest.fixture(params=[True, False], ids=["shipped", "scripts"])
def dedup(redis_url: str, request: pytest.FixtureRequest) -> Deduplicator:
    """Each test twice: the worker's claim and completion as swaps (SET IFEQ, where the
    server has it: ``stores/cas.py``) and as scripts."""
    return Deduplicator(RedisStore.from_url(redis_url, compare_and_set=request.param))


def _run_body(dedup: Deduplicator, label: str) -> tuple[str, str]:
    """Gate and claim a fresh call; its (key, owner)."""
    return claimed_call(dedup, NAME, POLICY, label)


def _events(dedup: Deduplicator) -> list[DedupEvent]:
    seen: list[DedupEvent] = []
    dedup.events.add(seen.append)
    return seen


def test_the_completion_is_on_the_server_before_its_reply_is_read(
    dedup: Deduplicator, redis_client: redis.Redis
) -> None:
    seen = _events(dedup)
    for label in ("warm", "one"):
        key, owner = _run_body(dedup, f"{label}-{uuid.uuid4().hex}")
        dedup.finish(NAME, POLICY, key, owner, success=True, later=True)
        assert redis_client.get(key) == f"D||{owner}".encode()  # another client sees it now
    store = dedup.store
    assert isinstance(store, RedisStore)
    assert store.settle(older_than=60.0)  # its reply is still owed
    # said at the send, where the task's span and logs still are
    assert [e.task_id for e in seen if e.event is Event.COMPLETED].count(owner) == 1
    wait_for(lambda: not store.settle(older_than=60.0), timeout=5,
             what="the reply read by the heartbeat thread")


def test_the_next_claim_reads_the_reply(dedup: Deduplicator) -> None:
    key, owner = _run_body(dedup, uuid.uuid4().hex)
    dedup.finish(NAME, POLICY, key, owner, success=True, later=True)
    store = dedup.store
    assert isinstance(store, RedisStore)
    assert store.settle(older_than=60.0)
    _run_body(dedup, uuid.uuid4().hex)  # the next task's claim on this thread
    assert not store.settle(older_than=60.0)  # nothing owed: the claim read it


def test_a_lost_lock_is_reported_when_the_reply_comes(
    dedup: Deduplicator, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    seen = _events(dedup)
    key, owner = _run_body(dedup, uuid.uuid4().hex)
    redis_client.delete(key)  # expired, or evicted
    with caplog.at_level(logging.WARNING, logger="taskdedup"):
        dedup.finish(NAME, POLICY, key, owner, success=True, later=True)
        wait_for(lambda: [e for e in seen if e.event is Event.LEASE_LOST and e.task_id == owner],
                 timeout=5, what="the lost lock reported")
    assert redis_client.get(key) is None  # a former owner writes nothing
    assert "finished after its lock" in caplog.text


def test_a_flushed_script_cache_is_completed_again_with_eval(
    dedup: Deduplicator, redis_client: redis.Redis
) -> None:
    key, owner = _run_body(dedup, uuid.uuid4().hex)
    dedup.finish(NAME, POLICY, key, owner, success=True, later=True)  # complete.lua loaded
    key, owner = _run_body(dedup, uuid.uuid4().hex)
    redis_client.script_flush()
    dedup.finish(NAME, POLICY, key, owner, success=True, later=True)  # NOSCRIPT on the server
    wait_for(lambda: redis_client.get(key) == f"D||{owner}".encode(), timeout=5,
             what="the completion made again with EVAL")


def test_a_connection_broken_before_the_reply_is_read_is_completed_again(
    dedup: Deduplicator, redis_client: redis.Redis
) -> None:
    seen = _events(dedup)
    key, owner = _run_body(dedup, uuid.uuid4().hex)
    dedup.finish(NAME, POLICY, key, owner, success=True, later=True)
    redis_client.client_kill_filter(_type="normal", skipme=True)  # the worker's connections
    wait_for(lambda: [e for e in seen if e.event is Event.COMPLETED and e.task_id == owner],
             timeout=5, what="the completion reported after the connection broke")
    assert redis_client.get(key) == f"D||{owner}".encode()
    key, owner = _run_body(dedup, uuid.uuid4().hex)  # the store works on
    assert redis_client.get(key) == f"R||{owner}".encode()


def test_a_single_connection_client_completes_at_once(redis_url: str,
                                                      redis_client: redis.Redis) -> None:
    store = RedisStore(redis.Redis.from_url(redis_url, single_connection_client=True))
    dedup = Deduplicator(store)
    seen = _events(dedup)
    key, owner = _run_body(dedup, uuid.uuid4().hex)
    dedup.finish(NAME, POLICY, key, owner, success=True, later=True)
    assert [e.event for e in seen if e.task_id == owner][-1] is Event.COMPLETED
    assert redis_client.get(key) == f"D||{owner}".encode()


@pytest.mark.parametrize("swaps", [True, False], ids=["shipped", "scripts"])
def test_a_user_without_script_load_completes_at_once_and_stops_trying(
    redis_url: str, redis_client: redis.Redis, swaps: bool
) -> None:
    """SCRIPT refused (``-script``: the ``script|load`` rule needs Redis 7): the completion
    waits for its reply as before, and the store does not ask again for every task. A
    server that swaps (SET IFEQ, ``stores/cas.py``) needs no script for it: the completion
    is still sent at once and read later."""
    user = f"later-{uuid.uuid4().hex[:8]}"
    redis_client.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"],
                             commands=["+@all", "-script"])
    try:
        host, port = redis_client.connection_pool.connection_kwargs["host"], \
            redis_client.connection_pool.connection_kwargs["port"]
        store = RedisStore(redis.Redis(host=host, port=port, username=user, password="pw"),
                           compare_and_set=swaps)
        dedup = Deduplicator(store)
        seen = _events(dedup)
        for _ in range(2):
            key, owner = _run_body(dedup, uuid.uuid4().hex)
            dedup.finish(NAME, POLICY, key, owner, success=True, later=True)
            assert [e.event for e in seen if e.task_id == owner][-1] is Event.COMPLETED
            assert redis_client.get(key) == f"D||{owner}".encode()
        assert (store._trails is not None) is store.compare_and_set
    finally:
        redis_client.acl_deluser(user)


def test_a_claim_behind_a_completion_is_read_with_it_and_made_again_after_a_flush(
    dedup: Deduplicator, redis_client: redis.Redis
) -> None:
    """The claim goes out on the connection that owes the completion's reply, and its read
    reads that reply too; after a flushed script cache the claim comes back NOSCRIPT and is
    made again with EVAL, as a claim."""
    store = dedup.store
    assert isinstance(store, RedisStore)
    key, owner = _run_body(dedup, uuid.uuid4().hex)
    dedup.finish(NAME, POLICY, key, owner, success=True, later=True)
    redis_client.script_flush()
    key2, owner2 = _run_body(dedup, uuid.uuid4().hex)  # claim: NOSCRIPT, made again
    assert not store.settle(older_than=60.0)  # the claim read the completion's reply too
    assert redis_client.get(key2) == f"R||{owner2}".encode()
    assert redis_client.get(key) == f"D||{owner}".encode()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_child_forked_while_the_parents_heartbeat_thread_settles_can_send_at_once(
    redis_url: str,
) -> None:
    """A work-horse or a new pool process is forked while a thread of its parent holds the
    trails' bookkeeping lock (the heartbeat thread reading replies owed): the child, where
    that thread does not exist, still sends its completion (the lock is made anew in it)."""
    store = RedisStore(redis.Redis.from_url(redis_url))
    trails = store._trails
    assert trails is not None

    def send() -> bool:
        replies: list[object] = []
        trails.send(("PING",), replies.append)
        trails.settle_mine()
        return replies == [b"PONG"]

    assert child_runs_while_held(trails._open_lock, send)


def _counted_takes(store: RedisStore) -> list[int]:
    """Count the connections the store's trails take from the pool."""
    trails = store._trails
    assert trails is not None
    takes: list[int] = []
    take = trails._take

    def counted() -> object:
        takes.append(1)
        return take()

    trails._take = counted
    return takes


@pytest.mark.parametrize("keep", [True, False], ids=["pool-process", "work-horse"])
def test_a_worker_process_keeps_its_connection_between_tasks(
    dedup: Deduplicator, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    keep: bool,
) -> None:
    """A prefork pool process (``keep_connections``, from ``worker_process_init``) sends each
    task's claim and completion on one connection it keeps: no pool checkout per task. A
    process forked per job gives it back after each read, as before."""
    monkeypatch.setattr(trail, "_KEEP_IN", [0])
    if keep:
        trail.keep_connections()
    store = dedup.store
    assert isinstance(store, RedisStore)
    takes = _counted_takes(store)
    for _ in range(5):
        key, owner = _run_body(dedup, uuid.uuid4().hex)
        dedup.finish(NAME, POLICY, key, owner, success=True, later=True)
    _run_body(dedup, uuid.uuid4().hex)  # reads the last completion's reply
    assert redis_client.get(key) == f"D||{owner}".encode()
    assert len(takes) == (1 if keep else 6)


def test_a_kept_connection_that_breaks_is_replaced_and_nothing_is_lost(
    dedup: Deduplicator, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trail, "_KEEP_IN", [0])
    trail.keep_connections()
    seen = _events(dedup)
    key, owner = _run_body(dedup, uuid.uuid4().hex)
    dedup.finish(NAME, POLICY, key, owner, success=True, later=True)
    _run_body(dedup, uuid.uuid4().hex)  # its reply read; the connection kept
    redis_client.client_kill_filter(_type="normal", skipme=True)  # the kept one too
    key, owner = _run_body(dedup, uuid.uuid4().hex)
    assert redis_client.get(key) == f"R||{owner}".encode()
    dedup.finish(NAME, POLICY, key, owner, success=True, later=True)
    wait_for(lambda: [e for e in seen if e.event is Event.COMPLETED and e.task_id == owner],
             timeout=5, what="the completion on the new connection")
    assert redis_client.get(key) == f"D||{owner}".encode()
