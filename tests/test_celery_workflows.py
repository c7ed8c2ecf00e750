"""Workflows around a duplicate, on a real worker (``tests.model_app``: acks late, task events,
STARTED tracked): chains, ``link`` callbacks, groups, chords, tasks that publish from their
body, and duplicates skipped on the worker — each ends in a state users can see, and a task
that ran is never run again because of a duplicate after it.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import chain, chord, group, signals
from celery.events.state import State
from celery.exceptions import ChordError
from celery.states import FAILURE, READY_STATES, SUCCESS

from taskdedup import DuplicateTaskError
from taskdedup.celery import get_deduplicator, skipped_info
from taskdedup.testing import wait_for
from tests.conftest import ModelWorker

pytestmark = pytest.mark.slow


def new_key() -> str:
    return uuid.uuid4().hex[:10]


def runs(rc: redis.Redis, name: str, key: str) -> int:
    return int(rc.llen(f"model:runs:{name}:{key}"))


def lock(mapp: Any, task: Any, *args: Any) -> bytes | None:
    key = get_deduplicator(mapp.app).identity(task.name, task._dedup_policy, args, {},
                                              func=task._func()).key
    value = mapp.app.backend.client.get(key)
    return value if isinstance(value, bytes) else None


def final(mapp: Any, task_id: str, timeout: float = 30) -> Any:
    """The task's result once it is in a ready state (never waits past the deadline)."""
    result = mapp.app.AsyncResult(task_id)
    wait_for(lambda: result.state in READY_STATES, timeout=timeout,
             what=f"{task_id} to reach a final state (it is {result.state})")
    return result


def done_once(mapp: Any, rc: redis.Redis, task: Any, *args: Any) -> str:
    """Run ``task(*args)`` to completion: its identity is then held (done) by the returned id."""
    held = task.delay(*args)
    assert final(mapp, held.id).state == SUCCESS
    wait_for(lambda: (lock(mapp, task, *args) or b"").startswith(b"D"), timeout=10,
             what="the lock to be done")
    return str(held.id)


class Events:
    """A real event receiver with the state Flower keeps (``celery.events.state.State``)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = State()
        self.receiver: Any = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.app.connection_for_read() as conn:
            self.receiver = self.app.events.Receiver(conn, handlers={"*": self.state.event})
            consume_ready = self.receiver.on_consume_ready

            def ready(*args: Any, **kwargs: Any) -> None:
                consume_ready(*args, **kwargs)
                self.ready.set()  # its queue is bound: no event is missed from here on

            self.receiver.on_consume_ready = ready
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def __enter__(self) -> Events:
        self.thread.start()
        assert self.ready.wait(10), "the event receiver did not start"
        return self

    def __exit__(self, *_: Any) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.thread.join(5)

    def final_state(self, task_id: str, timeout: float = 30) -> Any:
        def seen() -> Any:
            task = self.state.tasks.get(task_id)
            return task if task is not None and task.state in READY_STATES else None

        return wait_for(seen, timeout=timeout,
                        what=f"the events to show {task_id} finished (as Flower would)")


@pytest.fixture
def events(mapp: Any) -> Iterator[Events]:
    with Events(mapp.app) as receiver:
        yield receiver


# -- item 1: the next step of a chain, a callback, published by the worker -------------------

def test_a_chain_whose_next_step_is_a_duplicate_ends_with_an_error_naming_the_original(
    mapp: Any, rc: redis.Redis, model_worker: ModelWorker,
) -> None:
    key = new_key()
    held = done_once(mapp, rc, mapp.receipt, key)
    result = chain(mapp.charge.s(key), mapp.receipt.s(), mapp.log.s()).apply_async()
    charge_id, receipt_id = result.parent.parent.id, result.parent.id
    # the task that ran stays SUCCESS, its lock done: a later call is its duplicate
    assert final(mapp, charge_id).state == SUCCESS
    ended = final(mapp, result.id)
    assert ended.state == FAILURE, "the chain's result must end in a clear error"
    assert isinstance(ended.result, DuplicateTaskError)
    assert ended.result.existing_id == held and held in str(ended.result)
    step = final(mapp, receipt_id)
    assert step.state == FAILURE and step.result.existing_id == held
    assert mapp.charge.delay(key).id == charge_id
    assert (lock(mapp, mapp.charge, key) or b"").startswith(b"D")
    assert runs(rc, "charge", key) == 1 and runs(rc, "receipt", key) == 1
    assert runs(rc, "log", key) == 0


def test_a_link_callback_that_is_a_duplicate_fails_on_its_own_and_the_parent_succeeds(
    mapp: Any, rc: redis.Redis, model_worker: ModelWorker,
) -> None:
    key, other = new_key(), new_key()
    held = done_once(mapp, rc, mapp.receipt, other)
    parent = mapp.charge.apply_async((key,), link=mapp.receipt.si(other))
    assert final(mapp, parent.id).state == SUCCESS
    children = wait_for(lambda: mapp.app.AsyncResult(parent.id).children, timeout=10,
                        what="the parent's children to be stored")
    (callback,) = children
    ended = final(mapp, callback.id)
    assert ended.state == FAILURE and ended.result.existing_id == held
    assert runs(rc, "charge", key) == 1 and runs(rc, "receipt", other) == 1
    assert (lock(mapp, mapp.charge, key) or b"").startswith(b"D")


# -- item 6: a duplicate skipped on the worker reaches a final state -------------------------

def test_a_duplicate_skipped_on_the_worker_ends_success_naming_the_original_in_events_too(
    mapp: Any, rc: redis.Redis, model_worker: ModelWorker, events: Events,
) -> None:
    """Sent by name (no reservation): the worker's claim finds the identity done by another
    id. The result backend and the worker's events both show it finished, naming it."""
    key = new_key()
    held = done_once(mapp, rc, mapp.charge, key)
    sent = mapp.app.send_task("model.charge", (key,))
    result = final(mapp, sent.id)
    assert result.state == SUCCESS
    assert skipped_info(result) == {"existing_id": held, "state": "done"}
    assert result.get(timeout=5) == {"SKIPPED": f"duplicate of {held} (done)",
                                     "taskdedup": "skipped duplicate", "existing_id": held,
                                     "state": "done"}
    seen = events.final_state(sent.id)
    assert seen.state == SUCCESS and held in str(seen.result)
    assert runs(rc, "charge", key) == 1


def test_a_skipped_duplicate_with_callbacks_fails_naming_the_original_and_its_errback_runs(
    mapp: Any, rc: redis.Redis, model_worker: ModelWorker, events: Events,
) -> None:
    key, then, on_error = new_key(), new_key(), new_key()
    held = done_once(mapp, rc, mapp.charge, key)
    sent = mapp.app.send_task("model.charge", (key,), link=mapp.log.si(then),
                              link_error=mapp.log.si(on_error))
    result = final(mapp, sent.id)
    assert result.state == FAILURE
    assert isinstance(result.result, DuplicateTaskError) and result.result.existing_id == held
    with pytest.raises(DuplicateTaskError, match=held):
        result.get(timeout=5)
    assert events.final_state(sent.id).state == FAILURE
    wait_for(lambda: runs(rc, "log", on_error) == 1, timeout=20, what="the errback to run")
    assert runs(rc, "log", then) == 0 and runs(rc, "charge", key) == 1


def test_a_retry_whose_identity_another_call_took_ends_as_its_skipped_duplicate(
    mapp: Any, rc: redis.Redis, model_worker: ModelWorker,
) -> None:
    """``until_executing`` releases the lock when the first run starts; a new call takes it;
    the first run's ``self.retry`` is then a duplicate of that call. It is never left in
    RETRY without a message: it ends as a skipped duplicate naming the call that runs."""
    key = new_key()
    first = mapp.retry_later.delay(key)
    wait_for(lambda: runs(rc, "retry_later", key) == 1, timeout=20, what="the first run")
    second = mapp.retry_later.apply_async((key,), countdown=3)  # queued while the retry comes
    assert second.id != first.id, "released when the first run started: a new call is taken"
    rc.set(f"model:go:{key}", 1, ex=60)
    ended = final(mapp, first.id)
    assert ended.state == SUCCESS
    assert skipped_info(ended) == {"existing_id": second.id, "state": None}
    assert final(mapp, second.id).state == SUCCESS
    assert runs(rc, "retry_later", key) == 2  # the first run and the call that took over


# -- item 7: a duplicate published from a task's body is not one of its children ---------------

def test_a_duplicate_published_from_a_body_is_not_left_among_the_parents_children(
    mapp: Any, rc: redis.Redis, model_worker: ModelWorker,
) -> None:
    key, child = new_key(), new_key()
    held = done_once(mapp, rc, mapp.receipt, child)
    parent = mapp.spawn.delay(key, child)
    assert final(mapp, parent.id).get(timeout=5) == held  # the duplicate's handle: the original
    stored = mapp.app.AsyncResult(parent.id)
    ids = [c.id for c in stored.children or []]
    assert all(mapp.app.AsyncResult(i).state != "PENDING" for i in ids), (
        f"children that were never sent: {ids}")
    assert list(stored.collect(timeout=10))  # returns: nothing waits for a message never sent


def test_publish_signals_and_sent_events_fire_only_for_messages_sent(
    mapp: Any, rc: redis.Redis, model_worker: ModelWorker,
) -> None:
    """With a ``after_task_publish`` receiver (or ``task_send_sent_event``) the gate decides
    before the publish: a duplicate is not announced as sent."""
    sent: list[str] = []

    def record(headers: dict[str, Any] | None = None, **_: Any) -> None:
        sent.append(str((headers or {}).get("id")))

    signals.after_task_publish.connect(record, weak=False)
    try:
        key = new_key()
        first = mapp.receipt.delay(key)
        again = mapp.receipt.delay(key)
    finally:
        signals.after_task_publish.disconnect(record)
    assert again.id == first.id
    assert sent == [first.id]
    final(mapp, first.id)


# -- item 8: a group or chord whose header holds a duplicate --------------------------------

def test_a_group_with_a_duplicate_member_is_published_whole_and_names_the_original(
    mapp: Any, rc: redis.Redis, model_worker: ModelWorker,
) -> None:
    fresh, dup = new_key(), new_key()
    held = done_once(mapp, rc, mapp.receipt, dup)
    result = group(mapp.receipt.si(fresh), mapp.receipt.si(dup)).apply_async()
    values = result.get(timeout=30, propagate=False)
    assert values[0] == fresh
    assert isinstance(values[1], DuplicateTaskError) and values[1].existing_id == held
    assert runs(rc, "receipt", fresh) == 1 and runs(rc, "receipt", dup) == 1


def test_a_group_member_an_approximate_window_remembers_fails_without_an_id(
    mapp: Any, rc: redis.Redis, model_worker: ModelWorker,
) -> None:
    """A filter remembers the identity, not who ran it: the member still ends in an error
    (with no id to name), and the group is still published whole."""
    fresh, seen = new_key(), new_key()
    first = mapp.remember.delay(seen)
    assert final(mapp, first.id).state == SUCCESS
    wait_for(lambda: (lock(mapp, mapp.remember, seen) or b"F|").startswith(b"F|"), timeout=10,
             what="the lock to give way to the filter (a tombstone for the id's own copies)")
    result = group(mapp.remember.si(fresh), mapp.remember.si(seen)).apply_async()
    values = result.get(timeout=30, propagate=False)
    assert values[0] == fresh
    assert isinstance(values[1], DuplicateTaskError) and values[1].existing_id is None
    assert "ran already" in str(values[1])
    assert runs(rc, "remember", fresh) == 1 and runs(rc, "remember", seen) == 1


def test_a_chord_whose_header_holds_a_duplicate_ends_with_a_chord_error(
    mapp: Any, rc: redis.Redis, model_worker: ModelWorker,
) -> None:
    fresh, dup, body = new_key(), new_key(), new_key()
    held = done_once(mapp, rc, mapp.receipt, dup)
    result = chord([mapp.receipt.si(fresh), mapp.receipt.si(dup)])(mapp.total.s(body))
    ended = final(mapp, result.id)
    assert ended.state == FAILURE and isinstance(ended.result, ChordError)
    assert held in str(ended.result)
    assert runs(rc, "total", body) == 0 and runs(rc, "receipt", fresh) == 1
    assert runs(rc, "receipt", dup) == 1


def test_a_chord_body_that_is_a_duplicate_ends_the_chord_with_an_error(
    mapp: Any, rc: redis.Redis, model_worker: ModelWorker,
) -> None:
    """The chord body is published by the worker that finishes the header's last member."""
    one, two, body = new_key(), new_key(), new_key()
    held = done_once(mapp, rc, mapp.total, [one, two], body)
    result = chord([mapp.receipt.si(one), mapp.receipt.si(two)])(mapp.total.s(body))
    ended = final(mapp, result.id)
    assert ended.state == FAILURE, "the chord's result must end in a clear error"
    assert isinstance(ended.result, DuplicateTaskError) and ended.result.existing_id == held
    assert runs(rc, "total", body) == 1  # the held one only
    assert runs(rc, "receipt", one) == 1 and runs(rc, "receipt", two) == 1
