"""Unit tests of taskdedup.core.Deduplicator over MemoryStore with a fake clock, plus the
heartbeat against the real Redis server of the session (no sleeps: conditions with deadlines).
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from taskdedup import (
    DedupEvent,
    Deduplicator,
    Event,
    IdempotencyKeyMismatch,
    MemoryStore,
    Policy,
    RedisStore,
    StoreUnavailableError,
)
from taskdedup.core import GateCall, GateResult, Identity, Verdict, resolve_duplicate
from taskdedup.identity import fingerprint
from taskdedup.stores.base import LockInfo, LockResult, LockState, Outcome
from taskdedup.testing import FakeClock, wait_for

A, B, C = "task-a", "task-b", "task-c"
TASK = "app.charge"
HEX32 = r"[0-9a-f]{32}"


class DownStore:
    """A store whose backend is unreachable: every call raises StoreUnavailableError."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _down(self, name: str) -> Any:
        self.calls.append(name)
        raise StoreUnavailableError(f"taskdedup could not {name}: Redis is down")

    def reserve(self, key: str, owner: str, ttl_ms: int, check: str = "") -> LockResult:
        return self._down("reserve")  # type: ignore[no-any-return]

    def replace(self, key: str, owner: str, ttl_ms: int, check: str = "") -> LockResult:
        return self._down("replace")  # type: ignore[no-any-return]

    def claim(self, key: str, owner: str, lease_ms: int) -> LockResult:
        return self._down("claim")  # type: ignore[no-any-return]

    def heartbeat(self, key: str, owner: str, lease_ms: int) -> Outcome:
        return self._down("heartbeat")  # type: ignore[no-any-return]

    def complete(self, key: str, owner: str, ttl_ms: int) -> Outcome:
        return self._down("complete")  # type: ignore[no-any-return]

    def release(self, key: str, owner: str, *, only_queued: bool = False) -> Outcome:
        return self._down("release")  # type: ignore[no-any-return]

    def get(self, key: str) -> LockInfo | None:
        return self._down("get")  # type: ignore[no-any-return]


class Recorder:
    """An event listener that keeps every event."""

    def __init__(self) -> None:
        self.events: list[DedupEvent] = []
        self._lock = threading.Lock()

    def __call__(self, event: DedupEvent) -> None:
        with self._lock:
            self.events.append(event)

    def of(self, kind: Event) -> list[DedupEvent]:
        with self._lock:
            return [e for e in self.events if e.event is kind]


def stop_all_heartbeats(dedup: Deduplicator) -> None:
    """Leave no lock renewing after a test."""
    heartbeat = dedup.heartbeat()
    with heartbeat._cond:
        held = list(heartbeat._due)
    for key, owner in held:
        dedup.stop_heartbeat(key, owner)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> MemoryStore:
    return MemoryStore(clock=clock)


@pytest.fixture
def dedup(store: MemoryStore) -> Iterator[Deduplicator]:
    d = Deduplicator(store)
    yield d
    stop_all_heartbeats(d)


@pytest.fixture
def rec(dedup: Deduplicator) -> Recorder:
    r = Recorder()
    dedup.events.add(r)
    return r


def ident(dedup: Deduplicator, policy: Policy, *args: Any, **kwargs: Any) -> Identity:
    return dedup.identity(TASK, policy, args, kwargs)


# -- identity ------------------------------------------------------------------------------


def test_identity_key_layout_without_scope(dedup: Deduplicator) -> None:
    identity = dedup.identity(TASK, Policy(), (42, 5))
    assert re.fullmatch(rf"taskdedup:app\.charge:{HEX32}", identity.key)
    assert identity.key == f"taskdedup:{TASK}:{fingerprint(TASK, (42, 5))}"
    assert identity.check == ""


def test_identity_key_layout_with_scope(dedup: Deduplicator) -> None:
    identity = dedup.identity(TASK, Policy(scope="tenant-7"), (42, 5))
    digest = fingerprint(TASK, (42, 5), scope="tenant-7")
    assert identity.key == f"taskdedup:tenant-7:{TASK}:{digest}"
    assert re.fullmatch(rf"taskdedup:tenant-7:app\.charge:{HEX32}", identity.key)


def test_scope_separates_identities(dedup: Deduplicator) -> None:
    a = dedup.identity(TASK, Policy(scope="eu"), (1,)).key
    b = dedup.identity(TASK, Policy(scope="us"), (1,)).key
    assert a.rsplit(":", 1)[1] != b.rsplit(":", 1)[1]


def test_identity_uses_a_custom_prefix(store: MemoryStore) -> None:
    d = Deduplicator(store, prefix="myapp")
    assert re.fullmatch(rf"myapp:app\.charge:{HEX32}", d.identity(TASK, Policy(), (1,)).key)
    assert d.identity(TASK, Policy(scope="s"), (1,)).key.startswith("myapp:s:app.charge:")


@pytest.mark.parametrize("prefix", ["", "a:b", ":"])
def test_invalid_prefix_is_refused(store: MemoryStore, prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix must be a non-empty string without ':'"):
        Deduplicator(store, prefix=prefix)


def test_identity_binds_arguments_to_func(dedup: Deduplicator) -> None:
    def charge(user_id: int, amount: int = 5) -> None: ...

    keys = {
        dedup.identity(TASK, Policy(), args, kwargs, func=charge).key
        for args, kwargs in [
            ((42, 5), {}), ((42,), {"amount": 5}), ((), {"user_id": 42}), ((42,), {}),
        ]
    }
    assert len(keys) == 1


def test_identity_applies_include(dedup: Deduplicator) -> None:
    def charge(user_id: int, amount: int, request_id: str) -> None: ...

    p = Policy(include=["user_id", "amount"])
    a = dedup.identity(TASK, p, (42, 5, "r1"), func=charge)
    b = dedup.identity(TASK, p, (42, 5, "r2"), func=charge)
    c = dedup.identity(TASK, p, (42, 6, "r1"), func=charge)
    assert a == b
    assert a != c


def test_dedup_key_gives_a_different_digest_and_an_argument_check(dedup: Deduplicator) -> None:
    plain = dedup.identity(TASK, Policy(), (42, 5))
    keyed = dedup.identity(TASK, Policy(), (42, 5), dedup_key="ORD-789")
    assert keyed.key != plain.key
    assert re.fullmatch(rf"taskdedup:app\.charge:{HEX32}", keyed.key)
    assert re.fullmatch(HEX32, keyed.check)
    assert keyed.check == fingerprint(TASK, (42, 5))


def test_dedup_key_replaces_the_arguments_in_the_key(dedup: Deduplicator) -> None:
    a = dedup.identity(TASK, Policy(), (1,), dedup_key="ORD-1")
    b = dedup.identity(TASK, Policy(), (2,), dedup_key="ORD-1")
    c = dedup.identity(TASK, Policy(), (1,), dedup_key="ORD-2")
    assert a.key == b.key
    assert a.check != b.check
    assert a.key != c.key


def test_key_callable_replaces_the_identity(dedup: Deduplicator) -> None:
    seen: list[tuple[Any, ...]] = []

    def by_user(user_id: int, amount: int) -> int:
        seen.append((user_id, amount))
        return user_id

    p = Policy(key=by_user)
    a = dedup.identity(TASK, p, (42, 5))
    b = dedup.identity(TASK, p, (42,), {"amount": 7})
    c = dedup.identity(TASK, p, (43, 5))
    assert a.key == b.key
    assert a.key != c.key
    assert a.key != dedup.identity(TASK, Policy(), (42, 5)).key
    assert a.check == ""
    assert seen == [(42, 5), (42, 7), (43, 5)]


def test_identity_refuses_an_argument_without_identity(dedup: Deduplicator) -> None:
    with pytest.raises(TypeError, match=r"args\[1\]"):
        dedup.identity(TASK, Policy(), (1, object()))


# -- gate ----------------------------------------------------------------------------------


def test_gate_accepts_and_reserves(dedup: Deduplicator, store: MemoryStore, rec: Recorder) -> None:
    p = Policy(ttl=30)
    identity = ident(dedup, p, 1)
    result = dedup.gate(TASK, p, identity, A)
    assert result.verdict is Verdict.ACCEPTED
    assert result.existing_id is None
    info = store.get(identity.key)
    assert info is not None
    assert (info.state, info.owner, info.ttl_ms) == (LockState.QUEUED, A, 30_000)
    assert [e.event for e in rec.events] == [Event.RESERVED]
    assert rec.events[0].seconds is not None


def test_gate_uses_the_given_ttl_ms(dedup: Deduplicator, store: MemoryStore) -> None:
    p = Policy(ttl=30)
    identity = ident(dedup, p, 1)
    dedup.gate(TASK, p, identity, A, ttl_ms=45_000)
    info = store.get(identity.key)
    assert info is not None and info.ttl_ms == 45_000


def test_gate_reports_a_duplicate_with_the_original_id(
    dedup: Deduplicator, store: MemoryStore, rec: Recorder
) -> None:
    p = Policy()
    identity = ident(dedup, p, 1)
    dedup.gate(TASK, p, identity, A)
    result = dedup.gate(TASK, p, identity, B)
    assert result.verdict is Verdict.DUPLICATE
    assert result.existing_id == A
    assert result.state is LockState.QUEUED
    info = store.get(identity.key)
    assert info is not None and info.owner == A
    dup = rec.of(Event.DUPLICATE)
    assert len(dup) == 1
    assert (dup[0].task_id, dup[0].existing_id) == (B, A)


def test_gate_by_the_same_id_is_accepted(dedup: Deduplicator) -> None:
    p = Policy()
    identity = ident(dedup, p, 1)
    dedup.gate(TASK, p, identity, A)
    assert dedup.gate(TASK, p, identity, A).verdict is Verdict.ACCEPTED


def test_a_fresh_gate_by_the_same_id_is_a_duplicate_of_itself(
    dedup: Deduplicator, store: MemoryStore
) -> None:
    """An explicit id reused by a new call (``fresh``), queued or running: a duplicate; a
    store written before ``fresh`` is called as before for calls that are not fresh."""
    p = Policy()
    identity = ident(dedup, p, 1)
    dedup.gate(TASK, p, identity, A)
    result = dedup.gate(TASK, p, identity, A, fresh=True)
    assert (result.verdict, result.existing_id, result.state) == (
        Verdict.DUPLICATE, A, LockState.QUEUED)
    store.claim(identity.key, A, 60_000)
    assert dedup.gate(TASK, p, identity, A, fresh=True).verdict is Verdict.DUPLICATE
    assert dedup.gate(TASK, p, identity, A).verdict is Verdict.ACCEPTED  # a retry


def test_gate_many_passes_fresh_per_call(dedup: Deduplicator) -> None:
    p = Policy()
    one, two = ident(dedup, p, 1), ident(dedup, p, 2)
    dedup.gate(TASK, p, one, A)
    dedup.gate(TASK, p, two, B)
    answers = dedup.gate_many([
        GateCall(TASK, p, one, A, 60_000, fresh=True),
        GateCall(TASK, p, two, B, 60_000),
    ])
    assert [a.verdict for a in answers] == [  # type: ignore[union-attr]
        Verdict.DUPLICATE, Verdict.ACCEPTED]


def test_gate_after_the_reservation_expired_is_accepted(
    dedup: Deduplicator, clock: FakeClock
) -> None:
    p = Policy(ttl=10)
    identity = ident(dedup, p, 1)
    dedup.gate(TASK, p, identity, A)
    clock.advance(10.001)
    assert dedup.gate(TASK, p, identity, B).verdict is Verdict.ACCEPTED


def test_gate_replace_displaces_a_queued_owner(
    dedup: Deduplicator, store: MemoryStore, rec: Recorder
) -> None:
    p = Policy(on_duplicate="replace")
    identity = ident(dedup, p, 1)
    dedup.gate(TASK, p, identity, A)
    result = dedup.gate(TASK, p, identity, B)
    assert result.verdict is Verdict.REPLACED
    assert result.existing_id == A
    info = store.get(identity.key)
    assert info is not None and (info.state, info.owner) == (LockState.QUEUED, B)
    assert [e.detail for e in rec.of(Event.DUPLICATE)] == ["replaced"]


def test_gate_replace_does_not_displace_a_running_owner(
    dedup: Deduplicator, store: MemoryStore
) -> None:
    p = Policy(mode="until_executed", on_duplicate="replace")
    identity = ident(dedup, p, 1)
    dedup.gate(TASK, p, identity, A)
    dedup.start(TASK, p, identity.key, A)
    result = dedup.gate(TASK, p, identity, B)
    assert result.verdict is Verdict.DUPLICATE
    assert (result.existing_id, result.state) == (A, LockState.RUNNING)
    info = store.get(identity.key)
    assert info is not None and info.owner == A
    dedup.finish(TASK, p, identity.key, A, success=True)


def test_gate_many_answers_each_call_in_order_as_gate_would(
    dedup: Deduplicator, store: MemoryStore, rec: Recorder
) -> None:
    """One reserve_many for the plain calls; replace calls one by one; a mismatch is an
    answer of its own, not an exception that loses the others."""
    p, replace = Policy(), Policy(on_duplicate="replace")
    keyed = dedup.identity(TASK, p, (1,), dedup_key="K")
    dedup.gate(TASK, p, ident(dedup, p, 1), A)
    dedup.gate(TASK, p, dedup.identity(TASK, p, (2,), dedup_key="K"), A)
    dedup.gate(TASK, replace, ident(dedup, replace, 3), A)
    calls = [
        GateCall(TASK, p, ident(dedup, p, 1), B, 60_000),  # held by A
        GateCall(TASK, p, ident(dedup, p, 2), B, 60_000),  # fresh
        GateCall(TASK, p, keyed, B, 60_000),  # the key again with other arguments
        GateCall(TASK, replace, ident(dedup, replace, 3), B, 60_000),
    ]
    answers = dedup.gate_many(calls)
    assert isinstance(answers[0], GateResult) and answers[0].verdict is Verdict.DUPLICATE
    assert answers[0].existing_id == A
    assert isinstance(answers[1], GateResult) and answers[1].verdict is Verdict.ACCEPTED
    assert isinstance(answers[2], IdempotencyKeyMismatch)
    assert isinstance(answers[3], GateResult) and answers[3].verdict is Verdict.REPLACED
    info = store.get(ident(dedup, p, 2).key)
    assert info is not None and info.owner == B
    assert len(rec.of(Event.RESERVED)) == 3 + 1


def test_gate_many_with_the_store_down_applies_on_store_error_per_call() -> None:
    dedup = Deduplicator(DownStore())
    strict, lenient = Policy(), Policy(on_store_error="allow")
    calls = [GateCall(TASK, policy, Identity(f"taskdedup:{TASK}:{n}"), B, 60_000)
             for n, policy in enumerate([strict, lenient])]
    answers = dedup.gate_many(calls)
    assert isinstance(answers[0], StoreUnavailableError)
    assert isinstance(answers[1], GateResult) and answers[1].verdict is Verdict.UNGUARDED


def test_gate_dedup_key_reused_with_other_arguments_raises_mismatch(
    dedup: Deduplicator, store: MemoryStore, rec: Recorder
) -> None:
    p = Policy()
    first = dedup.identity(TASK, p, (42, 5), dedup_key="ORD-789")
    other = dedup.identity(TASK, p, (42, 6), dedup_key="ORD-789")
    dedup.gate(TASK, p, first, A)
    with pytest.raises(IdempotencyKeyMismatch) as info:
        dedup.gate(TASK, p, other, B)
    assert info.value.existing_id == A
    assert info.value.key == first.key
    assert "Use a new dedup_key" in str(info.value)
    held = store.get(first.key)
    assert held is not None and held.owner == A
    assert [e.detail for e in rec.of(Event.DUPLICATE)] == ["mismatch"]


def test_gate_dedup_key_reused_with_the_same_arguments_is_a_duplicate(
    dedup: Deduplicator,
) -> None:
    p = Policy()
    identity = dedup.identity(TASK, p, (42, 5), dedup_key="ORD-789")
    dedup.gate(TASK, p, identity, A)
    again = dedup.identity(TASK, p, (42, 5), dedup_key="ORD-789")
    result = dedup.gate(TASK, p, again, B)
    assert (result.verdict, result.existing_id) == (Verdict.DUPLICATE, A)


def test_gate_dedup_key_check_ignores_excluded_arguments(dedup: Deduplicator) -> None:
    def charge(user_id: int, amount: int, request_ts: float) -> None: ...

    p = Policy(exclude=["request_ts"])
    first = dedup.identity(TASK, p, (42, 5, 1.0), func=charge, dedup_key="ORD-789")
    retry = dedup.identity(TASK, p, (42, 5, 2.0), func=charge, dedup_key="ORD-789")
    dedup.gate(TASK, p, first, A)
    result = dedup.gate(TASK, p, retry, B)
    assert (result.verdict, result.existing_id) == (Verdict.DUPLICATE, A)


# -- store errors --------------------------------------------------------------------------


def test_gate_store_error_is_raised_under_on_store_error_raise() -> None:
    dedup = Deduplicator(DownStore())
    rec = Recorder()
    dedup.events.add(rec)
    p = Policy(on_store_error="raise")
    with pytest.raises(StoreUnavailableError, match="Redis is down"):
        dedup.gate(TASK, p, Identity("taskdedup:t:x"), A)
    assert [(e.event, e.detail) for e in rec.events] == [(Event.STORE_ERROR, "enqueue")]


def test_gate_store_error_is_unguarded_under_allow_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dedup = Deduplicator(DownStore())
    rec = Recorder()
    dedup.events.add(rec)
    p = Policy(on_store_error="allow")
    with caplog.at_level(logging.WARNING, logger="taskdedup"):
        result = dedup.gate(TASK, p, Identity("taskdedup:t:x"), A)
    assert result.verdict is Verdict.UNGUARDED
    warnings = [r for r in caplog.records if r.name == "taskdedup" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "WITHOUT dedup" in warnings[0].getMessage()
    assert [(e.event, e.detail) for e in rec.events] == [(Event.STORE_ERROR, "enqueue")]
    assert dedup.counters.get(Event.STORE_ERROR, TASK) == 1


def test_gate_replace_store_error_follows_on_store_error() -> None:
    dedup = Deduplicator(DownStore())
    p = Policy(on_duplicate="replace", on_store_error="allow")
    assert dedup.gate(TASK, p, Identity("k"), A).verdict is Verdict.UNGUARDED
    with pytest.raises(StoreUnavailableError):
        dedup.gate(TASK, Policy(on_duplicate="replace"), Identity("k"), A)


def test_start_store_error_follows_on_store_error() -> None:
    dedup = Deduplicator(DownStore())
    with pytest.raises(StoreUnavailableError):
        dedup.start(TASK, Policy(), "k", A)
    result = dedup.start(TASK, Policy(on_store_error="allow"), "k", A)
    assert result.verdict is Verdict.UNGUARDED
    assert len(dedup.heartbeat()) == 0


def test_finish_never_raises_on_store_errors(caplog: pytest.LogCaptureFixture) -> None:
    dedup = Deduplicator(DownStore())
    rec = Recorder()
    dedup.events.add(rec)
    with caplog.at_level(logging.WARNING, logger="taskdedup"):
        dedup.finish(TASK, Policy(), "k", A, success=True)
        dedup.finish(TASK, Policy(), "k", A, success=False)
    assert [(e.event, e.detail) for e in rec.events] == [
        (Event.STORE_ERROR, "complete"),
        (Event.STORE_ERROR, "release:failed"),
    ]
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 2


def test_release_never_raises_on_store_errors() -> None:
    store = DownStore()
    dedup = Deduplicator(store)
    rec = Recorder()
    dedup.events.add(rec)
    assert dedup.release(TASK, "k", A, reason="revoked") is False
    assert store.calls == ["release"]
    assert [(e.event, e.detail) for e in rec.events] == [(Event.STORE_ERROR, "release:revoked")]


# -- start ---------------------------------------------------------------------------------


def test_start_until_executing_releases_the_reservation_without_claiming(
    dedup: Deduplicator, store: MemoryStore, rec: Recorder
) -> None:
    p = Policy(mode="until_executing")
    identity = ident(dedup, p, 1)
    dedup.gate(TASK, p, identity, A)
    result = dedup.start(TASK, p, identity.key, A)
    assert result.verdict is Verdict.ACCEPTED
    assert store.get(identity.key) is None
    assert len(dedup.heartbeat()) == 0
    assert [(e.event, e.detail) for e in rec.events[1:]] == [(Event.RELEASED, "started")]


def test_start_until_executing_runs_even_when_another_id_holds_the_key(
    dedup: Deduplicator, store: MemoryStore
) -> None:
    p = Policy(mode="until_executing")
    identity = ident(dedup, p, 1)
    dedup.gate(TASK, p, identity, A)
    assert dedup.start(TASK, p, identity.key, B).verdict is Verdict.ACCEPTED
    info = store.get(identity.key)
    assert info is not None and info.owner == A  # not ours: left alone


GATING = ["until_executed", "until_expired", "while_executing"]


@pytest.mark.parametrize("mode", GATING)
def test_start_claims_the_running_lock_and_starts_the_heartbeat(
    dedup: Deduplicator, store: MemoryStore, rec: Recorder, mode: str
) -> None:
    p = Policy(mode=mode, lease=30)
    identity = ident(dedup, p, 1)
    if p.mode.gates_enqueue:
        dedup.gate(TASK, p, identity, A)
    result = dedup.start(TASK, p, identity.key, A)
    assert result.verdict is Verdict.ACCEPTED
    info = store.get(identity.key)
    assert info is not None
    assert (info.state, info.owner, info.ttl_ms) == (LockState.RUNNING, A, 30_000)
    assert len(dedup.heartbeat()) == 1
    assert rec.of(Event.CLAIMED)[0].task_id == A


def test_the_heartbeat_thread_calls_later_once_and_survives_a_failing_call(
    dedup: Deduplicator, caplog: pytest.LogCaptureFixture
) -> None:
    """``Heartbeat.call_later``: what an RQ work-horse's held stats threads ride on."""
    called = threading.Event()
    calls: list[str] = []

    def fails() -> None:
        calls.append("fails")
        raise RuntimeError("boom")

    def works() -> None:
        calls.append("works")
        called.set()

    last = threading.Event()
    heartbeat = dedup.heartbeat()
    with caplog.at_level(logging.ERROR, logger="taskdedup"):
        heartbeat.call_later(0.01, fails)
        heartbeat.call_later(0.05, works)
        assert called.wait(10), "the later call did not come"
        # a marker due later: by the time it runs, a repeat of either would have run too
        heartbeat.call_later(0.1, lambda: (calls.append("marker"), last.set()))
        assert last.wait(10), "the marker did not come"
    assert calls == ["fails", "works", "marker"]
    assert "a call on the heartbeat thread failed" in caplog.text


@pytest.mark.parametrize("mode", GATING)
def test_start_by_a_second_owner_is_a_duplicate(
    dedup: Deduplicator, store: MemoryStore, rec: Recorder, mode: str
) -> None:
    p = Policy(mode=mode)
    key = ident(dedup, p, 1).key
    dedup.start(TASK, p, key, A)
    result = dedup.start(TASK, p, key, B)
    assert result.verdict is Verdict.DUPLICATE
    assert (result.existing_id, result.state) == (A, LockState.RUNNING)
    skipped = rec.of(Event.SKIPPED)
    assert len(skipped) == 1
    assert (skipped[0].task_id, skipped[0].existing_id, skipped[0].detail) == (B, A, "R")
    assert len(dedup.heartbeat()) == 1  # only A renews
    info = store.get(key)
    assert info is not None and info.owner == A


def test_start_logs_a_skipped_duplicate_at_debug_not_info(
    dedup: Deduplicator, caplog: pytest.LogCaptureFixture
) -> None:
    """A skipped duplicate is counted (Event.SKIPPED); a webhook storm must not flood INFO."""
    p = Policy()
    key = ident(dedup, p, 1).key
    dedup.start(TASK, p, key, A)
    with caplog.at_level(logging.INFO, logger="taskdedup"):
        dedup.start(TASK, p, key, B)
    assert [r for r in caplog.records if r.name == "taskdedup"] == []
    with caplog.at_level(logging.DEBUG, logger="taskdedup"):
        dedup.start(TASK, p, key, B)
    records = [r for r in caplog.records if r.name == "taskdedup"]
    assert [r.levelno for r in records] == [logging.DEBUG]
    message = records[0].getMessage()
    assert "skipped" in message and "running" in message and A in message


def test_dropped_and_replaced_duplicates_log_at_debug_not_info(
    dedup: Deduplicator, caplog: pytest.LogCaptureFixture
) -> None:
    drop, replace = Policy(on_duplicate="drop"), Policy(on_duplicate="replace")
    dropped, replaced = ident(dedup, drop, 1), ident(dedup, replace, 2)
    dedup.gate(TASK, drop, dropped, A)
    dedup.gate(TASK, replace, replaced, A)
    with caplog.at_level(logging.INFO, logger="taskdedup"):
        assert resolve_duplicate(TASK, drop, dropped.key, A) is False
        assert dedup.gate(TASK, replace, replaced, B).verdict is Verdict.REPLACED
    assert [r for r in caplog.records if r.name == "taskdedup"] == []
    with caplog.at_level(logging.DEBUG, logger="taskdedup"):
        assert resolve_duplicate(TASK, drop, dropped.key, A) is False
        assert dedup.gate(TASK, replace, replaced, C).verdict is Verdict.REPLACED
    records = [r for r in caplog.records if r.name == "taskdedup"]
    assert [r.levelno for r in records] == [logging.DEBUG, logging.DEBUG]
    assert "dropped duplicate" in records[0].getMessage()
    assert "replaced queued task" in records[1].getMessage()


def test_start_after_done_by_the_same_id_is_finished(
    dedup: Deduplicator, rec: Recorder
) -> None:
    p = Policy(mode="until_expired")
    key = ident(dedup, p, 1).key
    dedup.start(TASK, p, key, A)
    dedup.finish(TASK, p, key, A, success=True)
    result = dedup.start(TASK, p, key, A)  # a redelivery after success
    assert result.verdict is Verdict.FINISHED
    assert (result.existing_id, result.state) == (A, LockState.DONE)
    assert rec.of(Event.SKIPPED)[0].detail == "D"
    assert len(dedup.heartbeat()) == 0


def test_start_of_a_reserved_call_by_its_own_id_claims(
    dedup: Deduplicator, store: MemoryStore
) -> None:
    p = Policy()
    identity = ident(dedup, p, 1)
    dedup.gate(TASK, p, identity, A)
    assert dedup.start(TASK, p, identity.key, A).verdict is Verdict.ACCEPTED
    info = store.get(identity.key)
    assert info is not None and info.state is LockState.RUNNING


def test_start_of_a_call_reserved_by_another_id_is_a_duplicate(dedup: Deduplicator) -> None:
    p = Policy()
    identity = ident(dedup, p, 1)
    dedup.gate(TASK, p, identity, A)
    result = dedup.start(TASK, p, identity.key, B)
    assert (result.verdict, result.existing_id, result.state) == (
        Verdict.DUPLICATE, A, LockState.QUEUED,
    )


# -- finish --------------------------------------------------------------------------------


def test_finish_success_until_expired_keeps_done_for_ttl(
    dedup: Deduplicator, store: MemoryStore, clock: FakeClock, rec: Recorder
) -> None:
    p = Policy(mode="until_expired", ttl=10)
    key = ident(dedup, p, 1).key
    dedup.start(TASK, p, key, A)
    dedup.finish(TASK, p, key, A, success=True)
    info = store.get(key)
    assert info is not None
    assert (info.state, info.owner) == (LockState.DONE, A)
    assert info.ttl_ms == pytest.approx(10_000, abs=1)
    assert len(dedup.heartbeat()) == 0
    assert len(rec.of(Event.COMPLETED)) == 1
    clock.advance(9.9)
    assert store.get(key) is not None
    clock.advance(0.2)
    assert store.get(key) is None


@pytest.mark.parametrize("mode", ["until_executed", "while_executing"])
def test_finish_success_frees_the_identity_and_leaves_a_tombstone_for_its_copies(
    dedup: Deduplicator, store: MemoryStore, rec: Recorder, mode: str
) -> None:
    p = Policy(mode=mode, lease=30)
    key = ident(dedup, p, 1).key
    dedup.start(TASK, p, key, A)
    dedup.finish(TASK, p, key, A, success=True)
    lock = store.get(key)
    assert lock is not None and (lock.state, lock.owner) == (LockState.FINISHED, A)
    assert 0 < lock.ttl_ms <= 30_000  # for one lease
    assert len(dedup.heartbeat()) == 0
    assert len(rec.of(Event.COMPLETED)) == 1
    assert dedup.start(TASK, p, key, A).verdict is Verdict.FINISHED  # a copy of A: ends
    assert dedup.start(TASK, p, key, B).verdict is Verdict.ACCEPTED  # another call: runs


def test_start_of_its_own_running_id_is_deferred_and_leaves_the_running_copy(
    dedup: Deduplicator, store: MemoryStore, rec: Recorder
) -> None:
    """SPEC §5: kombu restores unacked ETA messages every visibility_timeout; a copy that
    claims while the first runs is deferred, not run and not skipped."""
    p = Policy(mode="until_executed")
    key = ident(dedup, p, 1).key
    assert dedup.start(TASK, p, key, A).verdict is Verdict.ACCEPTED
    copy = dedup.start(TASK, p, key, A)
    assert (copy.verdict, copy.existing_id, copy.state) == (
        Verdict.DEFERRED, A, LockState.RUNNING)
    assert len(rec.of(Event.DEFERRED)) == 1 and rec.of(Event.SKIPPED) == []
    assert len(dedup.heartbeat()) == 1  # the running copy keeps renewing
    dedup.finish(TASK, p, key, A, success=True)
    assert dedup.start(TASK, p, key, A).verdict is Verdict.FINISHED


@pytest.mark.parametrize("mode", GATING)
def test_finish_failure_releases_the_lock(
    dedup: Deduplicator, store: MemoryStore, rec: Recorder, mode: str
) -> None:
    p = Policy(mode=mode)
    key = ident(dedup, p, 1).key
    dedup.start(TASK, p, key, A)
    dedup.finish(TASK, p, key, A, success=False)
    assert store.get(key) is None
    assert len(dedup.heartbeat()) == 0
    assert [e.detail for e in rec.of(Event.RELEASED)] == ["failed"]
    assert dedup.start(TASK, p, key, B).verdict is Verdict.ACCEPTED  # the re-enqueue runs


def test_finish_until_executing_touches_nothing(dedup: Deduplicator, store: MemoryStore) -> None:
    p = Policy(mode="until_executing")
    identity = ident(dedup, p, 1)
    dedup.start(TASK, p, identity.key, A)
    dedup.gate(TASK, p, identity, B)  # a new call was reserved meanwhile
    dedup.finish(TASK, p, identity.key, A, success=True)
    dedup.finish(TASK, p, identity.key, A, success=False)
    info = store.get(identity.key)
    assert info is not None and (info.state, info.owner) == (LockState.QUEUED, B)


def test_finish_after_the_lock_was_taken_emits_lease_lost_and_leaves_it(
    dedup: Deduplicator, store: MemoryStore, clock: FakeClock, rec: Recorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    p = Policy(mode="until_expired", lease=30)
    key = ident(dedup, p, 1).key
    dedup.start(TASK, p, key, A)
    clock.advance(31)  # A's lease expired (its worker stalled)
    assert dedup.start(TASK, p, key, B).verdict is Verdict.ACCEPTED
    with caplog.at_level(logging.WARNING, logger="taskdedup"):
        dedup.finish(TASK, p, key, A, success=True)
    lost = rec.of(Event.LEASE_LOST)
    assert [(e.task_id, e.detail) for e in lost] == [(A, "complete")]
    assert rec.of(Event.COMPLETED) == []
    assert any("expired" in r.getMessage() for r in caplog.records if r.name == "taskdedup")
    info = store.get(key)
    assert info is not None
    assert (info.state, info.owner, info.ttl_ms) == (LockState.RUNNING, B, 30_000)


def test_failed_finish_after_the_lock_was_taken_leaves_it(
    dedup: Deduplicator, store: MemoryStore, clock: FakeClock, rec: Recorder
) -> None:
    p = Policy(mode="until_executed", lease=30)
    key = ident(dedup, p, 1).key
    dedup.start(TASK, p, key, A)
    clock.advance(31)
    dedup.start(TASK, p, key, B)
    dedup.finish(TASK, p, key, A, success=False)
    info = store.get(key)
    assert info is not None and (info.state, info.owner) == (LockState.RUNNING, B)
    assert rec.of(Event.RELEASED) == []


# -- release -------------------------------------------------------------------------------


def test_release_by_the_owner_deletes_and_returns_true(
    dedup: Deduplicator, store: MemoryStore, rec: Recorder
) -> None:
    p = Policy()
    identity = ident(dedup, p, 1)
    dedup.gate(TASK, p, identity, A)
    assert dedup.release(TASK, identity.key, A, reason="publish_failed") is True
    assert store.get(identity.key) is None
    assert [e.detail for e in rec.of(Event.RELEASED)] == ["publish_failed"]


def test_release_by_a_non_owner_returns_false_and_keeps_the_lock(
    dedup: Deduplicator, store: MemoryStore, rec: Recorder
) -> None:
    p = Policy()
    identity = ident(dedup, p, 1)
    dedup.gate(TASK, p, identity, A)
    assert dedup.release(TASK, identity.key, B, reason="revoked") is False
    info = store.get(identity.key)
    assert info is not None and info.owner == A
    assert rec.of(Event.RELEASED) == []


def test_release_of_an_absent_key_returns_false(dedup: Deduplicator) -> None:
    assert dedup.release(TASK, "taskdedup:app.charge:" + "0" * 32, A, reason="x") is False


def test_release_stops_the_heartbeat(dedup: Deduplicator) -> None:
    p = Policy()
    key = ident(dedup, p, 1).key
    dedup.start(TASK, p, key, A)
    assert len(dedup.heartbeat()) == 1
    dedup.release(TASK, key, A, reason="revoked")
    assert len(dedup.heartbeat()) == 0


# -- events and counters -------------------------------------------------------------------


def test_events_never_carry_argument_values(
    dedup: Deduplicator, clock: FakeClock, rec: Recorder
) -> None:
    secret, amount = "s3cr3t-card-4242", 987654321
    p = Policy(lease=30)
    identity = dedup.identity(TASK, p, (secret, amount), {"note": secret})
    dedup.gate(TASK, p, identity, A)
    dedup.gate(TASK, p, identity, B)
    dedup.start(TASK, p, identity.key, B)
    dedup.start(TASK, p, identity.key, A)
    clock.advance(31)
    dedup.start(TASK, p, identity.key, B)
    dedup.finish(TASK, p, identity.key, A, success=True)
    dedup.finish(TASK, p, identity.key, B, success=False)
    kinds = {e.event for e in rec.events}
    assert kinds >= {Event.RESERVED, Event.DUPLICATE, Event.CLAIMED, Event.SKIPPED,
                     Event.LEASE_LOST, Event.RELEASED}
    for event in rec.events:
        assert isinstance(event, DedupEvent)
        assert event.task == TASK and event.key == identity.key
        text = repr(event)
        assert secret not in text
        assert str(amount) not in text


def test_a_raising_listener_is_logged_and_does_not_break_the_call(
    dedup: Deduplicator, store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(event: DedupEvent) -> None:
        raise RuntimeError("listener bug")

    after = Recorder()
    dedup.events.add(broken)
    dedup.events.add(after)
    p = Policy()
    identity = ident(dedup, p, 1)
    with caplog.at_level(logging.ERROR, logger="taskdedup"):
        result = dedup.gate(TASK, p, identity, A)
    assert result.verdict is Verdict.ACCEPTED
    assert store.get(identity.key) is not None
    assert [e.event for e in after.events] == [Event.RESERVED]  # later listeners still run
    errors = [r for r in caplog.records if r.name == "taskdedup" and r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "listener" in errors[0].getMessage()
    assert errors[0].exc_info is not None and isinstance(errors[0].exc_info[1], RuntimeError)


def test_a_removed_listener_is_not_called(dedup: Deduplicator) -> None:
    rec = Recorder()
    dedup.events.add(rec)
    dedup.events.remove(rec)
    p = Policy()
    dedup.gate(TASK, p, ident(dedup, p, 1), A)
    assert rec.events == []


def test_counters_count_per_task_and_event(dedup: Deduplicator) -> None:
    p = Policy(mode="until_executed")
    one = ident(dedup, p, 1)
    dedup.gate(TASK, p, one, A)
    dedup.gate(TASK, p, one, B)
    dedup.gate(TASK, p, one, "task-c")
    other = dedup.identity("app.email", p, (1,))
    dedup.gate("app.email", p, other, A)
    dedup.start(TASK, p, one.key, A)
    dedup.start(TASK, p, one.key, B)
    dedup.finish(TASK, p, one.key, A, success=True)
    c = dedup.counters
    assert c.get(Event.RESERVED, TASK) == 1
    assert c.get(Event.RESERVED, "app.email") == 1
    assert c.get(Event.RESERVED) == 2
    assert c.get(Event.DUPLICATE, TASK) == 2
    assert c.get(Event.SKIPPED, TASK) == 1
    assert c.get(Event.LEASE_LOST, TASK) == 0
    assert c.snapshot() == {
        TASK: {"reserved": 1, "duplicate": 2, "claimed": 1, "skipped": 1, "completed": 1},
        "app.email": {"reserved": 1},
    }
    c.reset()
    assert c.snapshot() == {}


class Tally:
    """A counting listener: ``tally(fields)``, never a DedupEvent."""

    def __init__(self) -> None:
        self.fields: list[tuple[Any, ...]] = []

    def __call__(self, event: DedupEvent) -> None:  # pragma: no cover - tally is used
        raise AssertionError("a listener with tally() is called with the fields")

    def tally(self, fields: tuple[Any, ...]) -> None:
        self.fields.append(fields)


def test_counting_listeners_get_the_fields_and_no_event_object_is_made_for_them(
    dedup: Deduplicator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's and publisher's hot path: where every listener only counts (the core's
    Counters, the stats recorder), no DedupEvent is made; one that takes events gets it."""
    import taskdedup.events as events_module

    made: list[DedupEvent] = []

    class Made(DedupEvent):
        __slots__ = ()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(events_module, "DedupEvent", Made)
    tally = Tally()
    dedup.events.add(tally)
    p = Policy()
    identity = ident(dedup, p, 1)
    dedup.gate(TASK, p, identity, A)
    dedup.start(TASK, p, identity.key, A)
    dedup.finish(TASK, p, identity.key, A, success=True)
    assert [f[:4] for f in tally.fields] == [(Event.RESERVED, TASK, identity.key, A),
                                             (Event.CLAIMED, TASK, identity.key, A),
                                             (Event.COMPLETED, TASK, identity.key, A)]
    assert all(len(f) == 7 for f in tally.fields)
    assert made == []
    assert dedup.counters.get(Event.CLAIMED, TASK) == 1
    rec = Recorder()
    dedup.events.add(rec)
    dedup.gate(TASK, p, ident(dedup, p, 2), B)
    assert [e.event for e in rec.events] == [Event.RESERVED] and made == rec.events
    assert len(tally.fields) == 4
    dedup.events.remove(tally)
    dedup.gate(TASK, p, ident(dedup, p, 3), B)
    assert len(tally.fields) == 4 and len(rec.events) == 2


def test_a_raising_tally_is_logged_and_the_other_listeners_still_count(
    dedup: Deduplicator, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(Tally):
        def tally(self, fields: tuple[Any, ...]) -> None:
            raise RuntimeError("tally bug")

    dedup.events.add(Broken())
    rec = Recorder()
    dedup.events.add(rec)
    p = Policy()
    with caplog.at_level(logging.ERROR, logger="taskdedup"):
        assert dedup.gate(TASK, p, ident(dedup, p, 1), A).verdict is Verdict.ACCEPTED
    assert [e.event for e in rec.events] == [Event.RESERVED]
    assert dedup.counters.get(Event.RESERVED, TASK) == 1
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and isinstance(errors[0].exc_info[1], RuntimeError)


def test_counters_keep_at_most_a_batch_of_events_uncounted() -> None:
    """Counters keep events to count them in batches: never more than FOLD_AT of them,
    and every one counted once."""
    from taskdedup.events import FOLD_AT, Counters

    counters = Counters()
    for i in range(FOLD_AT * 3 + 7):
        counters(DedupEvent(Event.CLAIMED if i % 2 else Event.COMPLETED, TASK, "k"))
        assert len(counters._seen) < FOLD_AT
    assert counters.get(Event.CLAIMED, TASK) == (FOLD_AT * 3 + 7) // 2
    assert counters.get(Event.COMPLETED) == FOLD_AT * 3 + 7 - (FOLD_AT * 3 + 7) // 2


def test_a_running_identity_entered_later_is_made_when_asked_for() -> None:
    """A worker enters its task's identity without making it (most bodies never ask):
    :func:`taskdedup.running.current` makes it, and leave restores what was before."""
    from taskdedup import running

    asked: list[str] = []

    def make(task_id: str) -> running.Running:
        asked.append(task_id)
        return running.Running(TASK, task_id, "k", 60.0, redelivery=3660.0)

    outer = running.enter(running.Running("app.outer", "o", "ko", 1.0))
    token = running.enter_later(make, "t-1")
    try:
        assert asked == []
        assert running.current() == running.Running(TASK, "t-1", "k", 60.0, redelivery=3660.0)
        assert asked == ["t-1"]
    finally:
        running.leave(token)
    assert running.current() == running.Running("app.outer", "o", "ko", 1.0)
    running.leave(outer)
    assert running.current() is None


# -- heartbeat against the real Redis ------------------------------------------------------


class CountingRedisStore(RedisStore):
    """A RedisStore that counts heartbeat calls per (key, owner)."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(client)
        self.beats: Counter[tuple[str, str]] = Counter()

    def heartbeat(self, key: str, owner: str, lease_ms: int) -> Outcome:
        outcome = super().heartbeat(key, owner, lease_ms)
        self.beats[(key, owner)] += 1
        return outcome


@pytest.fixture
def rstore(redis_url: str) -> Iterator[CountingRedisStore]:
    s = CountingRedisStore(RedisStore.from_url(redis_url).client)
    yield s
    s.close()


@pytest.fixture
def rdedup(rstore: CountingRedisStore) -> Iterator[Deduplicator]:
    d = Deduplicator(rstore)
    yield d
    stop_all_heartbeats(d)


def unique_key() -> str:
    return f"taskdedup:test.heartbeat:{uuid.uuid4().hex}"


def test_heartbeat_keeps_a_running_lock_beyond_its_lease(
    rdedup: Deduplicator, rstore: CountingRedisStore
) -> None:
    rec = Recorder()
    rdedup.events.add(rec)
    p = Policy(mode="until_executed", lease=0.3)
    key = unique_key()
    assert rdedup.start(TASK, p, key, A).verdict is Verdict.ACCEPTED
    started = time.monotonic()
    wait_for(
        lambda: time.monotonic() - started > 4 * p.lease and rstore.beats[(key, A)] >= 4,
        timeout=10, what="four leases to pass with the heartbeat renewing",
    )
    info = rstore.get(key)
    assert info is not None
    assert (info.state, info.owner) == (LockState.RUNNING, A)
    assert 0 < info.ttl_ms <= 300
    assert rec.of(Event.LEASE_LOST) == []
    assert len(rdedup.heartbeat()) == 1
    rdedup.finish(TASK, p, key, A, success=True)
    assert len(rdedup.heartbeat()) == 0
    info = rstore.get(key)
    assert info is not None and (info.state, info.owner) == (LockState.FINISHED, A)


def test_heartbeat_that_finds_another_owner_reports_lease_lost_and_stops(
    rdedup: Deduplicator, rstore: CountingRedisStore, redis_client: redis.Redis
) -> None:
    rec = Recorder()
    rdedup.events.add(rec)
    p = Policy(mode="until_executed", lease=0.3)
    key, control = unique_key(), unique_key()
    rdedup.start(TASK, p, key, A)
    redis_client.set(key, "R||task-other", px=60_000)  # A's lock expired and was retaken
    lost = wait_for(lambda: rec.of(Event.LEASE_LOST), timeout=10, what="lease_lost")
    assert [(e.task_id, e.key, e.detail) for e in lost] == [(A, key, "heartbeat")]
    assert len(rdedup.heartbeat()) == 0
    beats_after_loss = rstore.beats[(key, A)]
    # Another lock keeps beating; the lost one is never renewed again.
    rdedup.start(TASK, p, control, B)
    wait_for(lambda: rstore.beats[(control, B)] >= 3, timeout=10, what="control lock beats")
    assert rstore.beats[(key, A)] == beats_after_loss
    assert redis_client.get(key) == b"R||task-other"
    assert redis_client.pttl(key) > 50_000
    # A's completion does not touch the new owner's lock either.
    rdedup.finish(TASK, p, key, A, success=True)
    assert redis_client.get(key) == b"R||task-other"
    rdedup.finish(TASK, p, control, B, success=True)
    assert len(rdedup.heartbeat()) == 0


def test_a_lock_holding_a_value_taskdedup_did_not_write_is_reported_at_warning(
    rdedup: Deduplicator, rstore: CountingRedisStore, redis_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SPEC §8 / #19 B11: a foreign value (no TTL: forever) under a lock key blocked every
    call and execution with a DEBUG line only. Now: a WARNING naming the key and what to do,
    at enqueue and at claim, and counted (``foreign``)."""
    rec = Recorder()
    rdedup.events.add(rec)
    client = redis.Redis.from_url(redis_url)
    p = Policy()
    identity = ident(rdedup, p, unique_key())
    client.set(identity.key, "written by someone else")
    with caplog.at_level(logging.WARNING, logger="taskdedup"):
        assert rdedup.gate(TASK, p, identity, A).verdict is Verdict.DUPLICATE
        assert rdedup.start(TASK, p, identity.key, A).verdict is Verdict.DUPLICATE
    said = [r.getMessage() for r in caplog.records if identity.key in r.getMessage()]
    assert len(said) == 2 and all("taskdedup clear --key" in m for m in said), said
    assert [e.detail for e in rec.of(Event.FOREIGN)] == ["enqueue", "start"]
    assert client.get(identity.key) == b"written by someone else"  # never touched
