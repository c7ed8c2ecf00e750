"""One contract suite for every Store: MemoryStore (fake clock) and RedisStore (real server).

The ``harness`` fixture runs each contract test twice. Expiry is driven, never slept on:
the memory variant advances its fake clock; the redis variant uses short TTLs and waits for
the key to disappear, with a deadline (:func:`taskdedup.testing.wait_for`). The tests at the
end cover what only RedisStore has (errors, NOSCRIPT, decoding, round trips, URLs), and a
property test checks that both stores answer any sequence of calls alike.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskdedup.exceptions import ConfigurationError, StoreUnavailableError
from taskdedup.stores import (
    LockInfo,
    LockResult,
    LockState,
    MemoryStore,
    Outcome,
    RedisStore,
    Store,
)
from taskdedup.testing import FakeClock, free_port, wait_for

A, B = "task-a", "task-b"
C1, C2 = "1" * 32, "2" * 32
LONG = 600_000  # ms: never expires during a test
SHORT = 150  # ms: expires during a test (waited for, never slept on)

Q, R, D, F = LockState.QUEUED, LockState.RUNNING, LockState.DONE, LockState.FINISHED
ACQUIRED = LockResult(Outcome.ACQUIRED)
UNKNOWN_HOLDER = LockResult(Outcome.DUPLICATE)  # held by a value taskdedup did not write


@dataclass
class Harness:
    """A store under test plus the means to expire keys and to read/write raw values."""

    kind: str
    store: MemoryStore | RedisStore
    clock: FakeClock | None = None
    client: redis.Redis | None = None

    def let_expire(self, key: str, ttl_ms: int) -> None:
        """Make time pass until a lock written with ``ttl_ms`` has expired."""
        if self.clock is not None:
            self.clock.advance(ttl_ms / 1000 + 0.001)
            return
        client = self.client
        assert client is not None
        wait_for(lambda: not client.exists(key), timeout=10 + ttl_ms / 1000, what=f"{key} expiry")

    def write_raw(self, key: str, value: str | bytes, ttl_ms: int | None = None) -> None:
        """Write a value as another program would."""
        if isinstance(self.store, MemoryStore):
            text = value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value
            self.store.set_raw(key, text, ttl_ms)
        else:
            assert self.client is not None
            self.client.set(key, value, px=ttl_ms)

    def read_raw(self, key: str) -> str | None:
        if isinstance(self.store, MemoryStore):
            return self.store.get_raw(key)
        assert self.client is not None
        raw = self.client.get(key)
        assert raw is None or isinstance(raw, bytes)
        return None if raw is None else raw.decode("utf-8", "surrogateescape")


@pytest.fixture(params=["memory", "redis", "redis-scripts"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    """Each store: memory; Redis as shipped (on Valkey 9.1 a worker's claim and completion
    swap with SET IFEQ: ``stores/cas.py``); Redis with every transition by its script."""
    if request.param == "memory":
        clock = FakeClock()
        yield Harness("memory", MemoryStore(clock=clock), clock=clock)
        return
    client: redis.Redis = request.getfixturevalue("redis_client")  # flushed per test
    store = RedisStore(client, compare_and_set=request.param == "redis")
    yield Harness("redis", store, client=client)


@pytest.fixture
def store(harness: Harness) -> MemoryStore | RedisStore:
    return harness.store


@pytest.fixture
def redis_store(redis_client: redis.Redis) -> RedisStore:
    return RedisStore(redis_client)


@pytest.fixture
def scripts_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client on another database of the same server (flushed), beside ``redis_client``."""
    client = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/1")
    client.flushdb()
    try:
        yield client
    finally:
        client.flushdb()
        client.close()


def hold(store: Store, key: str, owner: str, state: LockState, check: str = "") -> None:
    """Bring ``key`` into ``state`` for ``owner`` through the transitions themselves."""
    assert store.reserve(key, owner, LONG, check) == ACQUIRED
    if state is Q:
        return
    assert store.claim(key, owner, LONG) == ACQUIRED
    if state is D:
        assert store.complete(key, owner, LONG) is Outcome.OK
    if state is F:
        assert store.complete(key, owner, 0, finished_ms=LONG) is Outcome.OK


def info(store: Store, key: str) -> tuple[LockState, str, str] | None:
    """The lock without its ttl."""
    lock = store.get(key)
    return None if lock is None else (lock.state, lock.owner, lock.check)


STATES = pytest.mark.parametrize("state", [Q, R, D], ids=["queued", "running", "done"])


def test_store_satisfies_the_store_protocol(store: Store) -> None:
    assert isinstance(store, Store)


# -- reserve ---------------------------------------------------------------------------------


def test_reserve_absent_acquires_a_queued_lock(store: Store) -> None:
    assert store.reserve("k", A, LONG, C1) == ACQUIRED
    lock = store.get("k")
    assert lock is not None
    assert (lock.key, lock.state, lock.owner, lock.check) == ("k", Q, A, C1)
    assert 0 < lock.ttl_ms <= LONG


def test_reserve_by_the_same_owner_while_queued_is_acquired(store: Store) -> None:
    hold(store, "k", A, Q)
    assert store.reserve("k", A, LONG) == ACQUIRED
    assert info(store, "k") == (Q, A, "")


def test_reserve_by_the_same_owner_while_running_requeues_and_keeps_the_check(store: Store) -> None:
    hold(store, "k", A, R, C1)
    assert store.reserve("k", A, LONG, C2) == ACQUIRED
    assert info(store, "k") == (Q, A, C1)


def test_reserve_by_the_same_owner_never_shortens_the_expiry(store: Store) -> None:
    store.reserve("k", A, LONG)
    assert store.reserve("k", A, 1_000) == ACQUIRED
    lock = store.get("k")
    assert lock is not None and lock.ttl_ms > LONG // 2


def test_reserve_by_the_same_owner_extends_to_a_longer_ttl(store: Store) -> None:
    store.reserve("k", A, 10_000)
    assert store.reserve("k", A, LONG) == ACQUIRED
    lock = store.get("k")
    assert lock is not None and lock.ttl_ms > LONG // 2


def test_reserve_by_the_same_owner_of_a_key_without_expiry_sets_the_ttl(harness: Harness) -> None:
    harness.write_raw("k", f"Q||{A}", ttl_ms=None)
    assert harness.store.reserve("k", A, LONG) == ACQUIRED
    lock = harness.store.get("k")
    assert lock is not None and 0 < lock.ttl_ms <= LONG


def test_reserve_by_the_same_owner_when_done_is_duplicate(store: Store) -> None:
    hold(store, "k", A, D)
    assert store.reserve("k", A, LONG) == LockResult(Outcome.DUPLICATE, A, D)
    assert info(store, "k") == (D, A, "")


@STATES
def test_reserve_by_another_owner_is_duplicate_with_state_and_owner(
    store: Store, state: LockState
) -> None:
    hold(store, "k", A, state)
    assert store.reserve("k", B, LONG) == LockResult(Outcome.DUPLICATE, A, state)
    assert info(store, "k") == (state, A, "")


@STATES
def test_reserve_by_another_owner_with_a_different_check_is_mismatch(
    store: Store, state: LockState
) -> None:
    hold(store, "k", A, state, C1)
    assert store.reserve("k", B, LONG, C2) == LockResult(Outcome.MISMATCH, A, state)
    assert info(store, "k") == (state, A, C1)


def test_reserve_by_another_owner_with_the_same_check_is_duplicate(store: Store) -> None:
    hold(store, "k", A, Q, C1)
    assert store.reserve("k", B, LONG, C1) == LockResult(Outcome.DUPLICATE, A, Q)


@pytest.mark.parametrize(("held", "new"), [(C1, ""), ("", C1)], ids=["new-empty", "held-empty"])
def test_reserve_by_another_owner_with_an_empty_check_on_either_side_is_duplicate(
    store: Store, held: str, new: str
) -> None:
    hold(store, "k", A, Q, held)
    assert store.reserve("k", B, LONG, new) == LockResult(Outcome.DUPLICATE, A, Q)


def test_reserve_after_the_reservation_expired_acquires_for_a_new_owner(harness: Harness) -> None:
    store = harness.store
    store.reserve("k", A, SHORT)
    harness.let_expire("k", SHORT)
    assert store.reserve("k", B, LONG) == ACQUIRED
    assert info(store, "k") == (Q, B, "")


# -- replace ---------------------------------------------------------------------------------


def test_replace_absent_acquires_a_queued_lock(store: Store) -> None:
    assert store.replace("k", A, LONG, C1) == ACQUIRED
    assert info(store, "k") == (Q, A, C1)


def test_replace_by_the_same_owner_while_queued_is_acquired_and_keeps_the_check(
    store: Store,
) -> None:
    hold(store, "k", A, Q, C1)
    assert store.replace("k", A, LONG) == ACQUIRED
    assert info(store, "k") == (Q, A, C1)


def test_replace_by_the_same_owner_when_done_is_duplicate(store: Store) -> None:
    hold(store, "k", A, D)
    assert store.replace("k", A, LONG) == LockResult(Outcome.DUPLICATE, A, D)


def test_replace_displaces_another_owners_queued_lock(store: Store) -> None:
    hold(store, "k", A, Q)
    assert store.replace("k", B, 30_000, C2) == LockResult(Outcome.REPLACED, A, Q)
    lock = store.get("k")
    assert lock is not None
    assert (lock.state, lock.owner, lock.check) == (Q, B, C2)
    assert 0 < lock.ttl_ms <= 30_000  # the new reservation's ttl, not the displaced one's


@pytest.mark.parametrize("state", [R, D], ids=["running", "done"])
def test_replace_of_another_owners_started_lock_is_duplicate(
    store: Store, state: LockState
) -> None:
    hold(store, "k", A, state)
    assert store.replace("k", B, LONG) == LockResult(Outcome.DUPLICATE, A, state)
    assert info(store, "k") == (state, A, "")


def test_replace_with_a_different_check_is_mismatch_and_writes_nothing(store: Store) -> None:
    hold(store, "k", A, Q, C1)
    assert store.replace("k", B, LONG, C2) == LockResult(Outcome.MISMATCH, A, Q)
    assert info(store, "k") == (Q, A, C1)


# -- claim -----------------------------------------------------------------------------------


def test_claim_absent_acquires_a_running_lock_with_an_empty_check(store: Store) -> None:
    assert store.claim("k", A, 30_000) == ACQUIRED
    lock = store.get("k")
    assert lock is not None
    assert (lock.state, lock.owner, lock.check) == (R, A, "")
    assert 0 < lock.ttl_ms <= 30_000


def test_claim_of_its_own_queued_lock_runs_it_for_the_lease_and_keeps_the_check(
    store: Store,
) -> None:
    hold(store, "k", A, Q, C1)
    assert store.claim("k", A, 30_000) == ACQUIRED
    lock = store.get("k")
    assert lock is not None
    assert (lock.state, lock.owner, lock.check) == (R, A, C1)
    assert 0 < lock.ttl_ms <= 30_000


def test_claim_of_its_own_running_lock_is_a_copy_and_leaves_it(store: Store) -> None:
    """SPEC §5: the same id RUNNING means another copy of one message runs now (kombu's
    restored ETA copies): the claim says so, and the running copy's lease is not touched."""
    hold(store, "k", A, R)
    before = store.get("k")
    assert store.claim("k", A, 1_000) == LockResult(Outcome.DUPLICATE, A, R)
    after = store.get("k")
    assert before is not None and after is not None
    assert (after.state, after.owner) == (R, A) and after.ttl_ms > 1_000


def test_complete_with_finished_ms_leaves_a_tombstone_only_its_owner_sees(store: Store) -> None:
    """until_executed / while_executing: the identity is free again for every other call,
    while this id's own copies find that it finished (SPEC §5)."""
    hold(store, "k", A, R, C1)
    assert store.complete("k", A, 0, finished_ms=LONG) is Outcome.OK
    assert info(store, "k") == (F, A, C1)
    assert store.claim("k", A, LONG) == LockResult(Outcome.DUPLICATE, A, F)
    assert store.reserve("k", A, LONG) == LockResult(Outcome.DUPLICATE, A, F)
    assert store.reserve("k", B, LONG, C2) == ACQUIRED  # another call: free, no mismatch
    assert info(store, "k") == (Q, B, C2)


def test_claim_of_another_owners_tombstone_is_acquired(store: Store) -> None:
    hold(store, "k", A, F)
    assert store.claim("k", B, LONG) == ACQUIRED
    assert info(store, "k") == (R, B, "")


def test_claim_of_its_own_done_lock_is_duplicate(store: Store) -> None:
    hold(store, "k", A, D)
    assert store.claim("k", A, LONG) == LockResult(Outcome.DUPLICATE, A, D)
    assert info(store, "k") == (D, A, "")


@STATES
def test_claim_of_another_owners_lock_is_duplicate(store: Store, state: LockState) -> None:
    hold(store, "k", A, state)
    assert store.claim("k", B, LONG) == LockResult(Outcome.DUPLICATE, A, state)
    assert info(store, "k") == (state, A, "")


def test_claim_after_a_dead_workers_lease_expired_acquires(harness: Harness) -> None:
    store = harness.store
    store.claim("k", A, SHORT)
    harness.let_expire("k", SHORT)
    assert store.claim("k", B, LONG) == ACQUIRED
    assert info(store, "k") == (R, B, "")


# -- heartbeat -------------------------------------------------------------------------------


def test_heartbeat_renews_its_own_running_lock(store: Store) -> None:
    store.claim("k", A, 10_000)
    assert store.heartbeat("k", A, LONG) is Outcome.OK
    lock = store.get("k")
    assert lock is not None and lock.state is R and lock.ttl_ms > LONG // 2


@pytest.mark.parametrize("state", [Q, D], ids=["queued", "done"])
def test_heartbeat_leaves_its_own_queued_or_done_lock_unchanged(
    store: Store, state: LockState
) -> None:
    hold(store, "k", A, state)
    assert store.heartbeat("k", A, 1_000) is Outcome.OK
    lock = store.get("k")
    assert lock is not None and lock.state is state and lock.ttl_ms > LONG // 2


def test_heartbeat_of_another_owners_lock_is_not_owner_and_does_not_renew_it(store: Store) -> None:
    store.claim("k", A, 10_000)
    assert store.heartbeat("k", B, LONG) is Outcome.NOT_OWNER
    lock = store.get("k")
    assert lock is not None and lock.owner == A and lock.ttl_ms <= 10_000


def test_heartbeat_of_an_absent_lock_is_not_owner_and_creates_nothing(store: Store) -> None:
    assert store.heartbeat("k", A, LONG) is Outcome.NOT_OWNER
    assert store.get("k") is None


# -- fresh calls (an explicit id reused) -------------------------------------------------------


@STATES
@pytest.mark.parametrize("method", ["reserve", "replace"])
def test_fresh_call_of_the_owners_own_lock_is_a_duplicate_of_itself(
    store: Store, state: LockState, method: str
) -> None:
    """A fresh call (not a retry or a republish) reusing an explicit id finds the lock of
    that id: a duplicate in any state, and nothing is written."""
    hold(store, "k", A, state, C1)
    before = info(store, "k")
    result = getattr(store, method)("k", A, LONG, C1, fresh=True)
    assert result == LockResult(Outcome.DUPLICATE, A, state)
    assert info(store, "k") == before


@pytest.mark.parametrize("method", ["reserve", "replace"])
def test_fresh_call_is_gated_as_any_other_otherwise(store: Store, method: str) -> None:
    assert getattr(store, method)("k", A, LONG, fresh=True) == ACQUIRED
    assert info(store, "k") == (Q, A, "")
    held = getattr(store, method)("k", B, LONG, fresh=True)
    expected = LockResult(Outcome.REPLACED, A, Q) if method == "replace" else (
        LockResult(Outcome.DUPLICATE, A, Q))
    assert held == expected


@STATES
def test_not_fresh_call_of_the_owners_own_lock_keeps_todays_answer(
    store: Store, state: LockState
) -> None:
    """A retry or a republish by the same id (fresh=False, the default) is accepted (queued
    or running) or a duplicate (done), as before."""
    hold(store, "k", A, state)
    expected = LockResult(Outcome.DUPLICATE, A, D) if state is D else ACQUIRED
    assert store.reserve("k", A, LONG, fresh=False) == expected


def test_reserve_many_fresh_applies_to_every_item(store: MemoryStore | RedisStore) -> None:
    hold(store, "mine", A, R)
    results = store.reserve_many([("mine", A, LONG, ""), ("new", A, LONG, "")], fresh=True)
    assert results == [LockResult(Outcome.DUPLICATE, A, R), ACQUIRED]
    assert store.reserve_many([("mine", A, LONG, "")]) == [ACQUIRED]  # a retry: requeued
    assert info(store, "mine") == (Q, A, "")


def test_reserve_and_run_fresh_runs_no_command_for_the_owners_own_lock(
    redis_store: RedisStore,
) -> None:
    """The one-round-trip gate (Celery's RedisTransport, RQ's DedupQueue) takes ``fresh``
    too; without it (RQ) the owner's own queued lock is accepted as before."""
    from taskdedup.stores.redis import reserve_and_run

    client = redis_store.client
    hold(redis_store, "k", A, R)
    push = [("RPUSH", "queue", "m")]
    lock, _ = reserve_and_run(client, "k", A, LONG, "", False, push, fresh=True)
    assert lock == LockResult(Outcome.DUPLICATE, A, R)
    assert client.llen("queue") == 0
    assert info(redis_store, "k") == (R, A, "")
    lock, _ = reserve_and_run(client, "k", A, LONG, "", False, push)
    assert lock == ACQUIRED
    assert client.llen("queue") == 1
    lock, _ = reserve_and_run(client, "k", A, LONG, "", True, push, fresh=True)
    assert lock == LockResult(Outcome.DUPLICATE, A, Q)
    assert client.llen("queue") == 1


def test_reserve_and_run_guard_answers_a_live_job_of_the_owner_s_id_before_the_gate(
    redis_store: RedisStore,
) -> None:
    """``guard`` (RQ's explicit job id): a job hash ``peek + owner`` whose status has not
    ended is answered ALIVE with that hash, nothing reserved and no command run; an ended
    or absent job leaves the call to the gate, as without the guard."""
    from taskdedup.stores.redis import reserve_and_run

    client = redis_store.client
    push = [("RPUSH", "queue", "m")]
    with pytest.raises(ValueError, match="guard needs peek"):
        reserve_and_run(client, "k", A, LONG, "", False, push, guard=True)
    client.hset(f"job:{A}", mapping={"status": "started", "origin": "q"})
    lock, peeked = reserve_and_run(client, "k", A, LONG, "", False, push, "job:", guard=True)
    assert lock == LockResult(Outcome.ALIVE, A)
    assert peeked is not None and dict(zip(peeked[::2], peeked[1::2], strict=True)) == {
        b"status": b"started", b"origin": b"q"}
    assert not client.exists("k") and client.llen("queue") == 0
    client.hset(f"job:{A}", "status", "finished")
    lock, _ = reserve_and_run(client, "k", A, LONG, "", False, push, "job:", guard=True)
    assert lock == ACQUIRED and client.llen("queue") == 1
    lock, _ = reserve_and_run(client, "k", B, LONG, "", False, push, "job:", guard=True)
    assert lock == LockResult(Outcome.DUPLICATE, A, Q)  # no job B: the gate answers
    assert client.llen("queue") == 1


# -- complete --------------------------------------------------------------------------------


def test_complete_marks_its_own_running_lock_done_for_the_ttl_and_keeps_the_check(
    store: Store,
) -> None:
    hold(store, "k", A, R, C1)
    assert store.complete("k", A, 30_000) is Outcome.OK
    lock = store.get("k")
    assert lock is not None
    assert (lock.state, lock.owner, lock.check) == (D, A, C1)
    assert 0 < lock.ttl_ms <= 30_000


@pytest.mark.parametrize("ttl_ms", [0, 30_000])
def test_complete_leaves_its_own_queued_lock_for_the_pending_retry(
    store: Store, ttl_ms: int
) -> None:
    """``self.retry(throw=False)`` then a normal return: the retry re-reserved the lock (R →
    Q) before the body completed; completing must not turn it into DONE (the retry's claim
    would skip it) nor delete it (a duplicate would get in meanwhile)."""
    hold(store, "k", A, R, C1)
    assert store.reserve("k", A, LONG, C1) == ACQUIRED  # the retry's publish
    assert store.complete("k", A, ttl_ms) is Outcome.OK
    assert info(store, "k") == (Q, A, C1)
    lock = store.get("k")
    assert lock is not None and lock.ttl_ms > 30_000
    assert store.claim("k", A, LONG) == ACQUIRED  # the retry runs


@pytest.mark.parametrize("ttl_ms", [0, 30_000])
def test_complete_leaves_its_own_done_lock_as_it_is(store: Store, ttl_ms: int) -> None:
    hold(store, "k", A, D, C1)
    before = store.get("k")
    assert store.complete("k", A, ttl_ms) is Outcome.OK
    after = store.get("k")
    assert before is not None and after is not None
    assert (after.state, after.owner, after.check) == (D, A, C1)
    assert after.ttl_ms <= before.ttl_ms


def test_complete_with_a_zero_ttl_deletes_its_own_lock(store: Store) -> None:
    hold(store, "k", A, R)
    assert store.complete("k", A, 0) is Outcome.OK
    assert store.get("k") is None


def test_complete_of_another_owners_lock_is_not_owner_and_leaves_it(store: Store) -> None:
    hold(store, "k", A, R)
    assert store.complete("k", B, LONG) is Outcome.NOT_OWNER
    assert store.complete("k", B, 0) is Outcome.NOT_OWNER
    assert info(store, "k") == (R, A, "")


def test_complete_of_an_absent_lock_is_not_owner_and_creates_nothing(store: Store) -> None:
    assert store.complete("k", A, LONG) is Outcome.NOT_OWNER
    assert store.get("k") is None


# -- release ---------------------------------------------------------------------------------


@STATES
def test_release_deletes_its_own_lock(store: Store, state: LockState) -> None:
    hold(store, "k", A, state)
    assert store.release("k", A) is Outcome.OK
    assert store.get("k") is None


def test_release_of_another_owners_lock_is_not_owner_and_leaves_it(store: Store) -> None:
    hold(store, "k", A, Q)
    assert store.release("k", B) is Outcome.NOT_OWNER
    assert info(store, "k") == (Q, A, "")


def test_release_of_an_absent_lock_is_not_owner(store: Store) -> None:
    assert store.release("k", A) is Outcome.NOT_OWNER


def test_release_only_queued_deletes_a_queued_lock(store: Store) -> None:
    hold(store, "k", A, Q)
    assert store.release("k", A, only_queued=True) is Outcome.OK
    assert store.get("k") is None


@pytest.mark.parametrize("state", [LockState.RUNNING, LockState.DONE])
def test_release_only_queued_leaves_a_claimed_or_done_lock(store: Store, state: LockState) -> None:
    """Cancelling a job that a worker claimed meanwhile must not free the running lock."""
    hold(store, "k", A, state)
    assert store.release("k", A, only_queued=True) is Outcome.NOT_OWNER
    assert info(store, "k") == (state, A, "")


# -- fencing ---------------------------------------------------------------------------------


def test_former_owner_cannot_heartbeat_complete_or_release_a_lock_taken_over_after_expiry(
    harness: Harness,
) -> None:
    store = harness.store
    store.claim("k", A, SHORT)
    harness.let_expire("k", SHORT)
    store.claim("k", B, LONG)
    assert store.heartbeat("k", A, LONG) is Outcome.NOT_OWNER
    assert store.complete("k", A, LONG) is Outcome.NOT_OWNER
    assert store.complete("k", A, 0) is Outcome.NOT_OWNER
    assert store.release("k", A) is Outcome.NOT_OWNER
    lock = store.get("k")
    assert lock is not None and (lock.state, lock.owner) == (R, B) and lock.ttl_ms > SHORT


# -- owners and the value format ---------------------------------------------------------------


def test_raw_value_is_state_check_owner(harness: Harness) -> None:
    store = harness.store
    store.reserve("k", A, LONG, C1)
    assert harness.read_raw("k") == f"Q|{C1}|{A}"
    store.claim("k", A, LONG)
    assert harness.read_raw("k") == f"R|{C1}|{A}"
    store.complete("k", A, LONG)
    assert harness.read_raw("k") == f"D|{C1}|{A}"
    store.claim("k2", B, LONG)
    assert harness.read_raw("k2") == f"R||{B}"


def test_owner_containing_separators_round_trips(store: Store) -> None:
    owner = "id|with||pipes|"
    assert store.reserve("k", owner, LONG, C1) == ACQUIRED
    assert info(store, "k") == (Q, owner, C1)
    assert store.reserve("k", B, LONG) == LockResult(Outcome.DUPLICATE, owner, Q)
    assert store.claim("k", owner, LONG) == ACQUIRED
    assert store.release("k", "id") is Outcome.NOT_OWNER
    assert store.release("k", owner) is Outcome.OK


@pytest.mark.parametrize("other", ["task-a ", "TASK-A", "task-", "task-a|"])
def test_owners_are_compared_as_exact_strings(store: Store, other: str) -> None:
    hold(store, "k", A, R)
    assert store.claim("k", other, LONG) == LockResult(Outcome.DUPLICATE, A, R)
    assert store.release("k", other) is Outcome.NOT_OWNER


MALFORMED = [
    "garbage",
    "",
    f"X||{A}",
    f"Q|abc|{A}",
    f"Q|{'A' * 32}|{A}",
    f"Q|{'a' * 33}|{A}",
    "Q||",
    f"Q|{A}",
    "Q",
]


@pytest.mark.parametrize("raw", MALFORMED)
def test_malformed_value_blocks_reserve_replace_and_claim_as_an_unknown_owner(
    harness: Harness, raw: str
) -> None:
    harness.write_raw("k", raw, LONG)
    store = harness.store
    assert store.reserve("k", A, LONG) == UNKNOWN_HOLDER
    assert store.replace("k", A, LONG) == UNKNOWN_HOLDER
    assert store.claim("k", A, LONG) == UNKNOWN_HOLDER
    assert harness.read_raw("k") == raw


@pytest.mark.parametrize("raw", MALFORMED)
def test_malformed_value_is_never_touched_by_heartbeat_complete_or_release(
    harness: Harness, raw: str
) -> None:
    harness.write_raw("k", raw, LONG)
    store = harness.store
    for owner in (A, raw or A):  # even an owner spelled like the whole raw value
        assert store.heartbeat("k", owner, LONG) is Outcome.NOT_OWNER
        assert store.complete("k", owner, LONG) is Outcome.NOT_OWNER
        assert store.complete("k", owner, 0) is Outcome.NOT_OWNER
        assert store.release("k", owner) is Outcome.NOT_OWNER
    assert harness.read_raw("k") == raw


@pytest.mark.parametrize("raw", MALFORMED)
def test_get_of_a_malformed_value_returns_none(harness: Harness, raw: str) -> None:
    harness.write_raw("k", raw, LONG)
    assert harness.store.get("k") is None


def test_non_utf8_owner_written_by_someone_else_decodes_with_surrogateescape(
    harness: Harness,
) -> None:
    harness.write_raw("k", b"Q||\xff\xfeid", LONG)
    owner = b"\xff\xfeid".decode("utf-8", "surrogateescape")
    assert harness.store.reserve("k", A, LONG) == LockResult(Outcome.DUPLICATE, owner, Q)
    assert info(harness.store, "k") == (Q, owner, "")


# -- get ---------------------------------------------------------------------------------------


def test_get_of_an_absent_key_returns_none(store: Store) -> None:
    assert store.get("k") is None


def test_get_returns_lock_info_with_state_owner_check_and_ttl(store: Store) -> None:
    store.reserve("k", A, 30_000, C1)
    lock = store.get("k")
    assert isinstance(lock, LockInfo)
    assert lock[:4] == ("k", Q, A, C1)
    assert 0 < lock.ttl_ms <= 30_000


# -- reserve_many and scan ---------------------------------------------------------------------


def test_reserve_many_returns_one_result_per_item_in_order(store: MemoryStore | RedisStore) -> None:
    hold(store, "held", B, R)
    hold(store, "explicit", B, Q, C1)
    results = store.reserve_many(
        [
            ("new", A, LONG, ""),
            ("held", A, LONG, ""),
            ("new", B, LONG, ""),  # items apply in order: "new" is A's by now
            ("explicit", A, LONG, C2),
            ("new", A, 1_000, ""),
        ]
    )
    assert results == [
        ACQUIRED,
        LockResult(Outcome.DUPLICATE, B, R),
        LockResult(Outcome.DUPLICATE, A, Q),
        LockResult(Outcome.MISMATCH, B, Q),
        ACQUIRED,
    ]
    assert info(store, "new") == (Q, A, "")


def test_reserve_many_of_no_items_returns_an_empty_list(store: MemoryStore | RedisStore) -> None:
    assert store.reserve_many([]) == []


def test_scan_yields_only_keys_with_the_prefix_taken_literally(
    store: MemoryStore | RedisStore,
) -> None:
    for key in ("app:1", "app:2", "app*x", "app?", "other:app:3", "ap"):
        store.reserve(key, A, LONG)
    assert sorted(store.scan("app:", count=1)) == ["app:1", "app:2"]
    assert sorted(store.scan("app*")) == ["app*x"]
    assert sorted(store.scan("app?")) == ["app?"]
    assert sorted(store.scan("")) == ["ap", "app*x", "app:1", "app:2", "app?", "other:app:3"]


# -- concurrency and arguments -----------------------------------------------------------------


def test_concurrent_reserves_of_one_identity_accept_exactly_one(store: Store) -> None:
    owners = [f"task-{n}" for n in range(16)]
    barrier = threading.Barrier(len(owners))
    results: dict[str, LockResult] = {}

    def enqueue(owner: str) -> None:
        barrier.wait(timeout=30)
        results[owner] = store.reserve("k", owner, LONG)

    threads = [threading.Thread(target=enqueue, args=(owner,)) for owner in owners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    winners = [owner for owner, result in results.items() if result == ACQUIRED]
    assert len(results) == len(owners) and len(winners) == 1
    losers = [result for owner, result in results.items() if owner != winners[0]]
    assert all(result == LockResult(Outcome.DUPLICATE, winners[0], Q) for result in losers)


INVALID_CALLS: list[tuple[str, Callable[[Store], Any], type[Exception]]] = [
    ("empty-owner", lambda s: s.reserve("k", "", LONG), ValueError),
    ("zero-ttl", lambda s: s.reserve("k", A, 0), ValueError),
    ("float-ttl", lambda s: s.reserve("k", A, 1.5), TypeError),  # type: ignore[arg-type]
    ("uppercase-check", lambda s: s.replace("k", A, LONG, "F" * 32), ValueError),
    ("short-check", lambda s: s.reserve("k", A, LONG, "abc"), ValueError),
    ("zero-lease", lambda s: s.claim("k", A, 0), ValueError),
    ("negative-complete-ttl", lambda s: s.complete("k", A, -1), ValueError),
    ("bool-lease", lambda s: s.heartbeat("k", A, True), TypeError),
    ("empty-owner-release", lambda s: s.release("k", ""), ValueError),
]


@pytest.mark.parametrize(
    ("call", "error"), [c[1:] for c in INVALID_CALLS], ids=[c[0] for c in INVALID_CALLS]
)
def test_invalid_arguments_are_refused_before_touching_the_store(
    store: Store, call: Callable[[Store], Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        call(store)
    assert store.get("k") is None


# -- RedisStore only -----------------------------------------------------------------------------


def closed_port_store(**kwargs: Any) -> tuple[RedisStore, int]:
    port = free_port()
    url = kwargs.pop("url", f"redis://127.0.0.1:{port}/0").format(port=port)
    return RedisStore.from_url(url, socket_connect_timeout=2, **kwargs), port


STORE_CALLS: list[tuple[str, Callable[[RedisStore], Any]]] = [
    ("reserve", lambda s: s.reserve("k", A, LONG)),
    ("replace", lambda s: s.replace("k", A, LONG)),
    ("claim", lambda s: s.claim("k", A, LONG)),
    ("heartbeat", lambda s: s.heartbeat("k", A, LONG)),
    ("complete", lambda s: s.complete("k", A, LONG)),
    ("release", lambda s: s.release("k", A)),
    ("get", lambda s: s.get("k")),
    ("reserve_many", lambda s: s.reserve_many([("k", A, LONG, "")])),
    ("scan", lambda s: list(s.scan("k"))),
]


@pytest.mark.parametrize("call", [c[1] for c in STORE_CALLS], ids=[c[0] for c in STORE_CALLS])
def test_redis_store_on_a_closed_port_raises_store_unavailable_with_the_address(
    call: Callable[[RedisStore], Any],
) -> None:
    store, port = closed_port_store()
    with pytest.raises(StoreUnavailableError) as caught:
        call(store)
    message = str(caught.value)
    assert f"127.0.0.1:{port}" in message
    assert "is Redis running" in message and "on_store_error='allow'" in message
    assert "dedup_store=" in message and "fakeredis[lua]" in message  # what to point where
    assert isinstance(caught.value.__cause__, redis.exceptions.ConnectionError)


def test_store_unavailable_message_redacts_the_password() -> None:
    store, port = closed_port_store(url="redis://alice:s3cret-pw@127.0.0.1:{port}/2")
    with pytest.raises(StoreUnavailableError) as caught:
        store.reserve("k", A, LONG)
    assert "s3cret-pw" not in str(caught.value)
    assert f"redis://alice:***@127.0.0.1:{port}/2" in str(caught.value)


def test_missing_permission_raises_store_unavailable_naming_the_permission(
    redis_url: str, redis_client: redis.Redis
) -> None:
    redis_client.acl_setuser(
        "taskdedup-limited",
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        commands=["+get", "+ping", "+hello", "+client"],
    )
    try:
        url = redis_url.replace("redis://", "redis://taskdedup-limited:pw@")
        with RedisStore.from_url(url) as store, pytest.raises(StoreUnavailableError) as caught:
            store.reserve("k", A, LONG)
    finally:
        redis_client.acl_deluser("taskdedup-limited")
    assert "lacks a permission" in str(caught.value)
    assert isinstance(caught.value.__cause__, redis.exceptions.NoPermissionError)
    assert "pw@" not in str(caught.value)


TRANSITIONS: list[tuple[str, Callable[[RedisStore], Any], Any]] = [
    ("reserve", lambda s: s.reserve("k", A, LONG), ACQUIRED),
    ("replace", lambda s: s.replace("k", B, LONG), LockResult(Outcome.REPLACED, A, Q)),
    ("claim", lambda s: s.claim("k", A, LONG), ACQUIRED),
    ("heartbeat", lambda s: s.heartbeat("k", A, LONG), Outcome.OK),
    ("complete", lambda s: s.complete("k", A, LONG), Outcome.OK),
    ("release", lambda s: s.release("k", A), Outcome.OK),
    ("get", lambda s: info(s, "k"), (Q, A, "")),
    (
        "reserve_many",
        lambda s: s.reserve_many([("k", B, LONG, "")]),
        [LockResult(Outcome.DUPLICATE, A, Q)],
    ),
]


@pytest.mark.parametrize(
    ("name", "call", "expected"), TRANSITIONS, ids=[t[0] for t in TRANSITIONS]
)
def test_scripts_are_loaded_again_after_script_flush(
    redis_store: RedisStore,
    redis_client: redis.Redis,
    name: str,
    call: Callable[[RedisStore], Any],
    expected: Any,
) -> None:
    redis_store = RedisStore(redis_client, compare_and_set=False)  # claim, complete: scripts
    redis_store.reserve_many([("k", A, LONG, "")])  # loads the reserve script
    redis_client.script_flush()
    sha = redis_store._scripts[name.replace("reserve_many", "reserve")].sha
    assert redis_client.script_exists(sha) == [False]
    assert call(redis_store) == expected
    assert redis_client.script_exists(sha) == [True]


def test_reserve_many_after_script_flush_retries_the_noscript_items_once(
    redis_store: RedisStore, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis_store.reserve_many([("warm", A, LONG, "")])
    redis_client.script_flush()
    exchanges: list[int] = []
    exchange = redis_store._exchange

    def counting(commands: list[tuple[Any, ...]]) -> list[Any]:
        exchanges.append(len(commands))
        return exchange(commands)

    monkeypatch.setattr(redis_store, "_exchange", counting)
    items = [(f"k{n}", A, LONG, "") for n in range(5)]
    assert redis_store.reserve_many(items) == [ACQUIRED] * 5
    assert exchanges == [5, 6]  # 5 EVALSHA answered NOSCRIPT; then SCRIPT LOAD + 5 EVALSHA
    assert redis_store.reserve_many(items) == [ACQUIRED] * 5
    assert exchanges == [5, 6, 5]


class RoundTrips:
    """Counts round trips on every redis-py connection: a write that follows a read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self._last = "read"
        send = redis.connection.Connection.send_packed_command
        read = redis.connection.Connection.read_response

        def counting_send(conn: Any, *args: Any, **kwargs: Any) -> Any:
            if self._last == "read":
                self.count += 1
            self._last = "send"
            return send(conn, *args, **kwargs)  # type: ignore[no-untyped-call]

        def counting_read(conn: Any, *args: Any, **kwargs: Any) -> Any:
            self._last = "read"
            return read(conn, *args, **kwargs)

        monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting_send)
        monkeypatch.setattr(redis.connection.Connection, "read_response", counting_read)


def test_reserve_many_takes_one_round_trip(
    redis_store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    trips = RoundTrips(monkeypatch)
    items = [(f"k{n}", f"task-{n}", LONG, "") for n in range(2_500)]
    results = redis_store.reserve_many(items)  # first use: SCRIPT LOAD rides along
    assert trips.count == 1 and results == [ACQUIRED] * 2_500
    assert redis_store.reserve_many(items) == [ACQUIRED] * 2_500
    assert trips.count == 2


@pytest.mark.parametrize("swaps", [True, False], ids=["shipped", "scripts"])
@pytest.mark.parametrize(("name", "call"), [t[:2] for t in TRANSITIONS],
                         ids=[t[0] for t in TRANSITIONS])
def test_each_call_takes_one_round_trip_once_scripts_are_loaded(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, name: str,
    call: Callable[[RedisStore], Any], swaps: bool,
) -> None:
    """Every transition from the state it is made in (a completion from RUNNING), whether
    the worker's steps swap (SET IFEQ) or run their scripts."""
    redis_store = RedisStore(redis_client, compare_and_set=swaps)
    for warm in (lambda s: s.reserve("k", A, LONG), *[t[1] for t in TRANSITIONS]):
        warm(redis_store)
    redis_store.release("k", A)
    redis_store.release("k", B)
    redis_store.reserve("k", A, LONG)
    if name == "complete":
        redis_store.claim("k", A, LONG)
    trips = RoundTrips(monkeypatch)
    call(redis_store)
    assert trips.count == 1


def test_reserve_many_splits_batches_larger_than_a_chunk(redis_store: RedisStore) -> None:
    redis_store.bulk_chunk = 3
    items = [(f"k{n}", A, LONG, "") for n in range(7)] + [("k0", B, LONG, "")]
    assert redis_store.reserve_many(items) == [ACQUIRED] * 7 + [LockResult(Outcome.DUPLICATE, A, Q)]


def test_reserve_many_on_a_single_connection_client_recovers_from_noscript(
    redis_url: str, redis_client: redis.Redis
) -> None:
    with RedisStore(redis.Redis.from_url(redis_url, single_connection_client=True)) as store:
        assert store.reserve_many([("k1", A, LONG, "")]) == [ACQUIRED]
        redis_client.script_flush()
        assert store.reserve_many([("k1", B, LONG, ""), ("k2", B, LONG, "")]) == [
            LockResult(Outcome.DUPLICATE, A, Q),
            ACQUIRED,
        ]


def test_decode_responses_client_gives_the_same_answers(
    redis_url: str, redis_client: redis.Redis
) -> None:
    with RedisStore(redis.Redis.from_url(redis_url, decode_responses=True)) as store:
        assert store.reserve("k", A, LONG, C1) == ACQUIRED
        assert store.reserve("k", B, LONG) == LockResult(Outcome.DUPLICATE, A, Q)
        assert info(store, "k") == (Q, A, C1)
        assert store.reserve_many([("k", B, LONG, ""), ("k2", B, LONG, "")]) == [
            LockResult(Outcome.DUPLICATE, A, Q),
            ACQUIRED,
        ]
        assert sorted(store.scan("k")) == ["k", "k2"]
        redis_client.set("bad", b"R||\xff")
        assert store.claim("bad", A, LONG) == LockResult(Outcome.DUPLICATE, "\udcff", R)


def test_key_of_another_type_blocks_reserve_and_is_never_touched(
    redis_store: RedisStore, redis_client: redis.Redis
) -> None:
    redis_client.hset("k", "field", "value")
    assert redis_store.reserve("k", A, LONG) == UNKNOWN_HOLDER
    assert redis_store.replace("k", A, LONG) == UNKNOWN_HOLDER
    assert redis_store.claim("k", A, LONG) == UNKNOWN_HOLDER
    assert redis_store.heartbeat("k", A, LONG) is Outcome.NOT_OWNER
    assert redis_store.complete("k", A, 0) is Outcome.NOT_OWNER
    assert redis_store.release("k", A) is Outcome.NOT_OWNER
    assert redis_store.get("k") is None
    assert redis_client.hgetall("k") == {b"field": b"value"}


@pytest.mark.parametrize("scheme", ["redis", "valkey"])
def test_from_url_accepts_redis_and_valkey_schemes(redis_url: str, scheme: str) -> None:
    url = redis_url.replace("redis://", f"{scheme}://", 1)
    with RedisStore.from_url(url) as store:
        assert store.reserve("from-url", A, LONG) == ACQUIRED
        assert store.release("from-url", A) is Outcome.OK


def test_from_url_maps_valkeys_to_tls() -> None:
    store = RedisStore.from_url("valkeys://example.invalid:6380/1")
    assert store.client.connection_pool.connection_class is redis.connection.SSLConnection
    assert repr(store) == "<RedisStore rediss://example.invalid:6380/1>"


def test_from_url_sets_timeouts_unless_given() -> None:
    defaults = RedisStore.from_url("redis://localhost:6379/0").client.connection_pool
    assert defaults.connection_kwargs["socket_timeout"] == 5
    assert defaults.connection_kwargs["socket_connect_timeout"] == 5
    assert defaults.connection_kwargs["health_check_interval"] == 30
    given_ = RedisStore.from_url("redis://localhost:6379/0", socket_timeout=1).client
    assert given_.connection_pool.connection_kwargs["socket_timeout"] == 1


def test_from_url_refuses_other_schemes_with_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError) as caught:
        RedisStore.from_url("amqp://guest:hunter2@localhost:5672//")
    assert "redis://" in str(caught.value) and "hunter2" not in str(caught.value)


def test_each_lua_script_opens_with_keys_argv_and_return_codes() -> None:
    lua = files("taskdedup.stores").joinpath("lua")
    for name in ("reserve", "replace", "claim", "heartbeat", "complete", "release"):
        source = lua.joinpath(f"{name}.lua").read_text()
        lines = source.splitlines()
        header = "\n".join(lines[: next(i for i, x in enumerate(lines) if not x.startswith("--"))])
        assert "KEYS[1]" in header and "ARGV[1]" in header and "Returns" in header, name
        assert "KEYS[2]" not in source, name


# -- both stores agree ----------------------------------------------------------------------------

OPS = st.one_of(
    st.tuples(st.sampled_from(["reserve", "replace"]), st.sampled_from(["k1", "k2"]),
              st.sampled_from([A, B, "a|b"]), st.sampled_from([60_000, LONG]),
              st.sampled_from(["", C1, C2])),
    st.tuples(st.sampled_from(["claim", "heartbeat"]), st.sampled_from(["k1", "k2"]),
              st.sampled_from([A, B, "a|b"]), st.sampled_from([60_000, LONG])),
    st.tuples(st.just("complete"), st.sampled_from(["k1", "k2"]),
              st.sampled_from([A, B, "a|b"]), st.sampled_from([0, 60_000, LONG])),
    st.tuples(st.just("finish"), st.sampled_from(["k1", "k2"]),
              st.sampled_from([A, B, "a|b"]), st.sampled_from([60_000, LONG])),
    st.tuples(st.just("claim_unreserved"), st.sampled_from(["k1", "k2"]),
              st.sampled_from([A, B, "a|b"]), st.sampled_from([60_000, LONG])),
    st.tuples(st.just("release"), st.sampled_from(["k1", "k2"]), st.sampled_from([A, B, "a|b"])),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(OPS, max_size=25))
def test_memory_and_redis_stores_agree_on_any_sequence_of_calls(
    redis_client: redis.Redis, scripts_client: redis.Redis, ops: list[tuple[Any, ...]]
) -> None:
    """Memory, Redis as shipped (swaps for the worker's claim and completion where the
    server has SET IFEQ) and Redis by scripts alone (another database) answer alike and
    leave the same locks."""
    redis_client.flushdb()
    scripts_client.flushdb()
    stores = (MemoryStore(clock=FakeClock()), RedisStore(redis_client),
              RedisStore(scripts_client, compare_and_set=False))

    def call(store: Any, name: str, *args: Any) -> Any:
        if name == "finish":  # a success that releases the identity: the F tombstone
            return store.complete(*args[:2], 0, finished_ms=args[2])
        if name == "claim_unreserved":  # while_executing's claim (a hint: never the outcome)
            if isinstance(store, RedisStore):
                return store.claim(*args, reserved=False)
            return store.claim(*args)
        return getattr(store, name)(*args)

    for name, *args in ops:
        answers = [call(store, name, *args) for store in stores]
        assert answers[0] == answers[1] == answers[2], (name, args, answers)
        for key in ("k1", "k2"):
            locks = [store.get(key) for store in stores]
            # TTLs are 60 s or 600 s and never expire here; compare which one is in force.
            views = [None if lock is None else (*lock[:4], lock.ttl_ms > 60_000) for lock in locks]
            assert views[0] == views[1] == views[2], (name, args, key, views)
