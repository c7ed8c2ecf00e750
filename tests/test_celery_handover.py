"""The table by which a prefork worker's main process hands the claim it carried to the pool
process that runs the body (:mod:`taskdedup.celery.handover`), with real forked processes:
exactly one side wins an offer, and nothing a message brings can take one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from taskdedup import Policy
from taskdedup.celery import handover

POLICY = Policy(ttl=60)


class _Beat:
    def __init__(self) -> None:
        self.renewing: dict[tuple[str, str], Any] = {}

    def add(self, name: str, key: str, owner: str, lease_ms: int) -> None:
        self.renewing[key, owner] = None

    def hand_over(self, key: str, owner: str, settled: Any) -> bool:
        self.renewing[key, owner] = settled
        return True

    def remove(self, key: str, owner: str) -> None:
        self.renewing.pop((key, owner), None)


class _Store:
    def __init__(self) -> None:
        self.reserved: list[tuple[str, str, int]] = []

    def reserve(self, key: str, owner: str, ttl_ms: int) -> None:
        self.reserved.append((key, owner, ttl_ms))


class _Dedup:
    """What :func:`handover.hand` and :func:`handover.end` use of a Deduplicator."""

    def __init__(self) -> None:
        self.beat = _Beat()
        self.store = _Store()
        self.released: list[tuple[str, str, str]] = []

    def heartbeat(self) -> _Beat:
        return self.beat

    def stop_heartbeat(self, key: str, owner: str) -> None:
        self.beat.remove(key, owner)

    def release(self, name: str, key: str, owner: str, *, reason: str) -> bool:
        self.released.append((key, owner, reason))
        self.beat.remove(key, owner)
        return True


class _Request:
    """What :func:`handover.hand` uses of a Celery request: its id, and a weak reference."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name, value in (("_table", [None]), ("_lock", [None]), ("_owner", [None]),
                        ("_free", []), ("_offers", {})):
        monkeypatch.setattr(handover, name, value)
    handover.open_table()
    yield


_requests: list[_Request] = []  # alive while a test runs


def _offer(dedup: _Dedup, task_id: str = "task-a", key: str = "k:a",
           request: _Request | None = None) -> list[int]:
    fields: dict[str, Any] = {}
    if request is None:
        request = _Request(task_id)
        _requests.append(request)
    assert handover.hand(request, fields, "t", key, dedup, POLICY)
    return list(fields[handover.FIELD])


def _in_child(call: Any) -> bool:
    """``call()`` in a forked process (a pool process): its answer."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            os.write(write, b"1" if call() else b"0")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(child, 0)
    return answer == b"1"


def test_a_pool_process_takes_the_offer_made_for_its_call_and_the_main_process_keeps_off(
    table: None,
) -> None:
    dedup = _Dedup()
    handed = _offer(dedup)
    settled = dedup.beat.renewing["k:a", "task-a"]
    assert settled() is False  # offered: the main process renews the lease
    assert _in_child(lambda: handover.take(handed, "task-a", "k:a"))
    assert settled() is True  # taken: its renewals stop
    handover.end("task-a")
    assert dedup.released == []  # the pool process's to settle
    assert ("k:a", "task-a") not in dedup.beat.renewing


def test_an_offer_no_pool_process_took_is_withdrawn_and_released_once(table: None) -> None:
    dedup = _Dedup()
    handed = _offer(dedup)
    handover.end("task-a")
    assert dedup.released == [("k:a", "task-a", "stopped")]
    assert not _in_child(lambda: handover.take(handed, "task-a", "k:a"))  # too late
    handover.end("task-a")
    assert len(dedup.released) == 1


def test_only_the_offer_for_this_call_and_this_lock_can_be_taken(table: None) -> None:
    dedup = _Dedup()
    handed = _offer(dedup)
    slot, generation = handed
    for forged in ([slot, generation ^ 1], [slot + 1, generation], [slot], "x", None,
                   [slot, str(generation)], [-1, generation], [handover.SLOTS, generation]):
        assert not handover.take(forged, "task-a", "k:a"), forged
    assert not handover.take(handed, "task-b", "k:a")  # another call's id
    assert not handover.take(handed, "task-a", "k:b")  # another lock
    assert handover.take(handed, "task-a", "k:a")
    assert not handover.take(handed, "task-a", "k:a")  # once


def test_a_stopping_consumer_turns_every_offer_left_back_to_queued(table: None) -> None:
    """Their messages go back to the broker: each lock goes back to its own reservation."""
    dedup = _Dedup()
    taken = _offer(dedup, "task-a", "k:a")
    _offer(dedup, "task-b", "k:b")
    assert handover.take(taken, "task-a", "k:a")
    handover.end_all()
    assert dedup.store.reserved == [("k:b", "task-b", POLICY.ttl_ms)]
    assert dedup.released == []
    assert dedup.beat.renewing == {}


def test_offers_seen_taken_are_closed_so_the_slots_never_run_out(table: None) -> None:
    """Celery's own request class ends a success without a hook of taskdedup's: a taken
    offer is closed when the next one is made, not when its request ends."""
    dedup = _Dedup()
    for n in range(handover.SLOTS + 100):
        handed = _offer(dedup, f"task-{n}", f"k:{n}")
        assert handover.take(handed, f"task-{n}", f"k:{n}")
    assert len(handover._offers) == 1  # the last one, taken: closed at the next offer
    assert dedup.released == []
    assert len(dedup.beat.renewing) == 1


def test_an_offer_whose_request_is_gone_untaken_stops_renewing_and_is_given_back(
    table: None,
) -> None:
    """A request Celery let go while its offer stood (a body that never reached its claim,
    and ended without a failure): its lease is no longer renewed, and the next offer releases
    its lock."""
    dedup = _Dedup()
    request = _Request("task-a")
    _offer(dedup, "task-a", "k:a", request=request)
    settled = dedup.beat.renewing["k:a", "task-a"]
    assert settled() is False
    del request
    assert settled() is True
    _offer(dedup, "task-b", "k:b")
    assert dedup.released == [("k:a", "task-a", "stopped")]


def test_a_table_left_locked_is_called_broken_and_nothing_more_is_handed_over(
    table: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    dedup = _Dedup()
    handed = _offer(dedup)
    monkeypatch.setattr(handover, "LOCK_TIMEOUT", 0.05)
    handover._lock[0].acquire()  # as a pool process killed inside it would leave it
    try:
        assert not handover.take(handed, "task-a", "k:a")
        assert not handover.ready() and not handover.room()
        handover.end("task-a")  # cannot tell whether it was taken: no release, no renewal
        assert dedup.released == []
        assert dedup.beat.renewing == {}
        fields: dict[str, Any] = {}
        assert not handover.hand(_Request("task-c"), fields, "t", "k:c", dedup, POLICY)
        assert fields == {}
    finally:
        handover._lock[0].release()


def test_a_process_without_the_table_hands_nothing_over(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(handover, "_table", [None])
    assert not handover.ready()
    assert not handover.hand(_Request("task-a"), {}, "t", "k:a", _Dedup(), POLICY)
    assert not handover.take([0, 1], "task-a", "k:a")


def test_the_field_is_taken_off_the_request_and_its_custom_headers() -> None:
    class Request:
        pass

    request = Request()
    request.__dict__[handover.FIELD] = [1, 2]
    request.headers = {handover.FIELD: [1, 2], "other": 1}  # type: ignore[attr-defined]
    assert handover.pop_field(request) == [1, 2]
    assert handover.FIELD not in request.__dict__
    assert request.headers == {"other": 1}  # type: ignore[attr-defined]
    assert handover.pop_field(request) is None
