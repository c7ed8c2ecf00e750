"""A lease kept by a worker for the child it forks (:mod:`taskdedup.forklease`), in-process on a
real Redis: the child's word stops the renewals, a lock the child released is not reported
lost, and one gone while the child still runs is."""

from __future__ import annotations

import os

import pytest
import redis

from taskdedup import Deduplicator, Policy, RedisStore, forklease
from taskdedup.events import DedupEvent, Event
from taskdedup.forklease import ChildLease
from taskdedup.testing import wait_for
from tests.claims import claimed_call
from tests.effects import holds_for
from tests.forking import child_runs_while_held

NAME = "tests.forklease"
POLICY = Policy(ttl=60, lease=0.09)  # renewed every 30 ms


@pytest.fixture
def dedup(redis_url: str) -> Deduplicator:
    return Deduplicator(RedisStore.from_url(redis_url))


def kept(dedup: Deduplicator) -> tuple[str, str, ChildLease]:
    """A fresh call claimed here, its lease kept for a child about to be forked."""
    key, owner = claimed_call(dedup, NAME, POLICY)
    lease = ChildLease(dedup, NAME, key, owner, POLICY.lease_ms)
    assert lease.keep()
    return key, owner, lease


def lost(dedup: Deduplicator) -> list[DedupEvent]:
    events: list[DedupEvent] = []
    dedup.events.add(lambda e: events.append(e) if e.event is Event.LEASE_LOST else None)
    return events


@pytest.mark.parametrize("child_settled", [True, False], ids=["settled", "running"])
def test_a_lock_gone_is_lost_only_while_the_child_has_not_settled_it(
    dedup: Deduplicator, rc: redis.Redis, child_settled: bool
) -> None:
    events = lost(dedup)
    key, owner = claimed_call(dedup, NAME, POLICY)
    heartbeat = dedup.heartbeat()
    assert heartbeat.hand_over(key, owner, lambda: child_settled)
    rc.delete(key)  # released by the child (settled), or lost while it runs
    wait_for(lambda: len(heartbeat) == 0, timeout=5, what="the renewal dropped")
    assert [e.key for e in events] == ([] if child_settled else [key])


def test_the_renewals_stop_at_the_childs_word_and_go_on_until_then(
    dedup: Deduplicator, rc: redis.Redis
) -> None:
    key, owner, lease = kept(dedup)
    go, done = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's exit code is the answer
        try:
            os.close(done)
            lease.adopt()
            os.read(go, 1)  # until the parent has seen the lease renewed
            dedup.stop_heartbeat(key, owner)  # the body is over: this settles it
            os._exit(0)
        except BaseException:
            os._exit(1)
    try:
        os.close(go)

        def renewed() -> None:
            assert rc.get(key) == f"R||{owner}".encode()
            assert len(dedup.heartbeat()) == 1 and not lease.settled()

        holds_for(4 * POLICY.lease, renewed)  # by this process, past its lease
        os.write(done, b"x")
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert lease.settled()
        wait_for(lambda: len(dedup.heartbeat()) == 0, timeout=5, what="renewals stopped")
    finally:
        os.close(done)
        lease.end()
    assert lease.settled()  # and asking after end() is safe


def test_where_the_parents_death_cannot_be_watched_the_child_renews_from_the_start(
    dedup: Deduplicator, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, owner, lease = kept(dedup)
    monkeypatch.setattr(forklease, "_PRCTL", None)  # not Linux
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's exit code is the answer
        try:
            lease.adopt()
            renewing = len(dedup.heartbeat()) == 1  # this child's own heartbeat
            dedup.stop_heartbeat(key, owner)
            os._exit(0 if renewing and len(dedup.heartbeat()) == 0 else 1)
        except BaseException:
            os._exit(2)
    try:
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert lease.settled()
    finally:
        lease.end()


def test_a_child_forked_while_a_parents_thread_counts_an_event_counts_its_own(
    dedup: Deduplicator,
) -> None:
    """The worker's heartbeat thread counts an event (a lease it found lost) at the moment a
    work-horse is forked: the horse's own counts must not wait on the lock that thread held
    (it does not exist in the horse)."""
    assert child_runs_while_held(dedup.counters._lock,
                                 lambda: isinstance(dedup.counters.snapshot(), dict))
