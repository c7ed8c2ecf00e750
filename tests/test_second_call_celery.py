"""The second call waits instead of being skipped, with real Celery prefork workers (two
workers of two processes each; SPEC §15, issue #22).

- ``on_busy="wait"``: every call that finds its identity running is put off (republished,
  not a retry, no pool process held) and runs once the other has finished, with its own
  arguments, never beside another run of its identity.
- ``busy_timeout``: a call that has waited that long ends FAILURE with
  :class:`taskdedup.BusyTimeoutError` naming the holder, without running, within a second or
  two of the timeout.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import redis
from kombu.exceptions import OperationalError

from taskdedup import BusyTimeoutError
from taskdedup.stats import read_stats
from taskdedup.testing import wait_for
from tests.effects import recorded
from tests.pairs import celery_pair
from tests.workers import CeleryWorker

pytestmark = pytest.mark.slow

QUEUE = "it-second-call"


class SecondCallWorker(CeleryWorker):
    app_module = "tests.second_call_app"


workers, capp = celery_pair(SecondCallWorker, QUEUE)


def label() -> str:
    return uuid.uuid4().hex[:12]


def started(rc: redis.Redis, name: str, n: int) -> Any:
    return lambda: f"start{n}" in recorded(rc, name)


def test_every_waiting_call_runs_once_after_the_other_never_beside_it(
    capp: Any, rc: redis.Redis, workers: list[CeleryWorker]
) -> None:
    """Five calls of one identity (arguments it ignores differ): the first holds the body;
    the four others find it running, wait without holding a pool process (an unrelated task
    runs meanwhile on the 4 processes), then run one at a time, each with its own argument,
    each SUCCESS with its own result."""
    name = label()
    first = capp.wait_busy.delay(name, 0, True)
    wait_for(started(rc, name, 0), timeout=30, what="the first call runs")
    before = _deferred(rc, "wait_busy")
    waiting = [capp.wait_busy.delay(name, n) for n in range(1, 5)]
    wait_for(lambda: _deferred(rc, "wait_busy") >= before + 4, timeout=30, interval=0.2,
             what="the four calls put off")
    # They hold no pool process: four other tasks still run while the gate is closed.
    others = [capp.app.tasks["tests.celery_app.record"].delay(label(), i) for i in range(4)]
    for other in others:
        other.get(timeout=30)
    assert recorded(rc, name) == ["start0"]
    rc.set(f"go:{name}", 1)
    assert first.get(timeout=30) == 0
    for n, handle in enumerate(waiting, start=1):
        assert handle.get(timeout=60) == n
    runs = recorded(rc, name)
    assert "overlap" not in runs
    assert sorted(runs) == sorted([f"start{n}" for n in range(5)] + [f"end{n}" for n in range(5)])
    for i in range(0, len(runs), 2):  # one at a time: each start followed by its own end
        assert runs[i + 1] == "end" + runs[i].removeprefix("start")


def test_a_wait_past_busy_timeout_fails_clearly_and_never_runs(
    capp: Any, rc: redis.Redis, workers: list[CeleryWorker]
) -> None:
    """busy_timeout=3: the holder runs until the test opens its gate (well after); the
    waiting call ends FAILURE with BusyTimeoutError naming the holder within ~2 s of its
    timeout, and its body never runs."""
    name = label()
    holder = capp.busy_timeout.delay(name, 0, True)
    wait_for(started(rc, name, 0), timeout=30, what="the holder runs")
    sent = time.monotonic()
    waiter = capp.busy_timeout.delay(name, 1)
    with pytest.raises(BusyTimeoutError) as raised:
        waiter.get(timeout=30, propagate=True)
    took = time.monotonic() - sent
    assert 3 <= took <= 6, took
    assert waiter.state == "FAILURE"
    assert holder.id in str(raised.value) and "waited" in str(raised.value)
    assert raised.value.holder_id == holder.id
    assert recorded(rc, name) == ["start0"]  # the waiter never ran
    rc.set(f"go:{name}", 1)
    assert holder.get(timeout=30) == 0
    assert "start1" not in recorded(rc, name)


def test_until_executed_a_call_finding_its_identity_running_waits_then_runs(
    capp: Any, rc: redis.Redis, workers: list[CeleryWorker]
) -> None:
    """until_executed gates both: a second call while the first runs is answered at enqueue
    (the original's handle, nothing sent, as with on_busy='skip'). A message that reaches a
    worker anyway (sent by name, without the gate) finds the identity running: it waits,
    then runs once the first has finished."""
    name = label()
    task = capp.wait_until_executed
    first = task.delay(name, 0, True)
    wait_for(started(rc, name, 0), timeout=30, what="the first call runs")
    again = task.delay(name, 1)
    assert again.id == first.id  # gated at enqueue, as today
    before = _deferred(rc, "wait_until_executed")
    by_name = capp.app.send_task(task.name, (name, 2), queue=QUEUE)
    wait_for(lambda: _deferred(rc, "wait_until_executed") > before, timeout=30, interval=0.2,
             what="the call sent by name put off")
    assert recorded(rc, name) == ["start0"]
    rc.set(f"go:{name}", 1)
    assert first.get(timeout=30) == 0
    assert by_name.get(timeout=30) == 2
    assert recorded(rc, name) == ["start0", "end0", "start2", "end2"]


def test_a_killed_holder_frees_its_waiter_within_its_lease(
    capp: Any, rc: redis.Redis, workers: list[CeleryWorker], redis_url: str
) -> None:
    """The holder runs on a worker of its own, SIGKILLed mid-body: its running lock is no
    longer renewed and lapses within its lease (8 s); the waiting call then runs, within the
    lease plus one back-off (lease / 4) of the kill, not never."""
    name = label()
    own = SecondCallWorker(redis_url, queue=f"{QUEUE}-holder", concurrency=1).start()
    try:
        capp.wait_busy.apply_async((name, 0, True), queue=own.queue)
        wait_for(started(rc, name, 0), timeout=30, what="the holder runs")
        before = _deferred(rc, "wait_busy")
        waiter = capp.wait_busy.delay(name, 1)
        wait_for(lambda: _deferred(rc, "wait_busy") > before, timeout=30, interval=0.2,
                 what="the waiter put off")
    finally:
        own.kill()
    killed = time.monotonic()
    rc.decr(f"busy:{name}")  # the killed body's own decrement, which it never made
    assert waiter.get(timeout=30) == 1
    assert time.monotonic() - killed <= 8 + 2 + 3
    assert recorded(rc, name) == ["start0", "start1", "end1"]  # the holder never ended


@pytest.mark.parametrize("task", ["wait_refused", "limited_refused"])
def test_a_put_off_the_broker_refuses_ends_failure_and_is_not_lost_unseen(
    capp: Any, rc: redis.Redis, workers: list[CeleryWorker], task: str
) -> None:
    """A waiting call (``on_busy="wait"``; a ``Concurrency`` limit) whose put-off republish
    the broker refuses ends FAILURE with that error, its body never run, rather than being
    acked away and left PENDING for good; the limit's call gives back the lock it had kept
    queued, so the same call sent again is a new call that runs."""
    t = getattr(capp, task)
    name = label()
    holder = t.delay(name, 0, True)
    wait_for(started(rc, name, 0), timeout=30, what="the holder runs")
    rc.set(f"putoff-refused:{name}", 1)
    waiter = t.delay(name, 1)
    with pytest.raises(OperationalError, match="refused the put-off"):
        waiter.get(timeout=30, propagate=True)
    assert waiter.state == "FAILURE"
    assert recorded(rc, name) == ["start0"]
    rc.delete(f"putoff-refused:{name}")
    rc.set(f"go:{name}", 1)
    assert holder.get(timeout=30) == 0
    again = t.delay(name, 1)
    assert again.id != waiter.id
    assert again.get(timeout=30) == 1
    assert recorded(rc, name) == ["start0", "end0", "start1", "end1"]


def _deferred(rc: redis.Redis, task: str) -> int:
    """The ``deferred:busy`` count the workers flushed (every ~5 s) for ``task``."""
    stats = read_stats(rc, task=f"tests.second_call_app.{task}")
    return sum(s.get("deferred:busy") for s in stats.values())
