"""An integration-level model test: seeded random sequences of calls driven through a real
Celery worker, each step checked against a small reference model.

Operations: a first call and its duplicates (``delay``), the same explicit ``task_id``
published twice by two fresh calls, a retry in both forms (``raise self.retry(...)`` and
``self.retry(..., throw=False)`` then a normal return), a final failure followed by the
user's re-enqueue, a chain whose next step is a duplicate, a revoke of a queued call followed
by the user's re-enqueue, a worker SIGKILLed while a body runs (its duplicate sent while it is
down), a duplicate sent by name (no reservation: the worker's claim skips it), and since the
same-id copy rule (SPEC §5, issue #19):

* ``eta_copies``: countdowns beyond the visibility timeout (until_expired and
  until_executed), so kombu restores the held messages and copies of one id claim while the
  body runs and after it succeeded;
* ``nested``: a gated task runs another with ``.apply()`` and one directly in-process, each
  recording ``taskdedup.running.current().key`` and writing ``taskdedup.sql.effects`` on
  SQLite (SPEC §11);
* ``redeliver_after_success_in_chain``: a chain's step that succeeded comes back as kombu
  redelivers it (same id, same ``taskdedup`` header, its next step and an errback attached);
* ``skewed_clock``: an approximate window (the ``remember`` task) asked by a producer whose
  clock is off by more than the whole window (SPEC §12);

and since the second call's answers (SPEC §15, issue #22):

* ``wait``: three calls of one ``while_executing`` identity with ``on_busy="wait"`` and
  different ignored arguments, sent at once to the worker's two processes: each runs exactly
  once, never beside another (no overlap recorded), and ends SUCCESS with its own argument;

* ``coalesce``: a call of an ``on_duplicate="coalesce"`` identity, and three duplicates sent
  while it runs: they share one follow-up id (not the running one), which runs once after it
  with the last duplicate's argument, never beside it; both SUCCESS with their own values;
* ``debounce``: two to four calls of a debounced identity (``wait=0.5``) at once: only the
  last runs, with its argument; the others end SUCCESS with the superseded marker of their
  generation;

and since per-key limits (SPEC §16, issue #23):

* ``limited``: three calls of one ``Concurrency(1, key=...)`` key sent at once to the
  worker's two processes: each runs exactly once, never beside another, SUCCESS with its own
  value;
* ``limited_kill``: the worker SIGKILLed while a slot holder runs and two calls of its key
  wait: after the restart the holder's message comes back (late ack) and runs again under its
  own id, the waiting calls run, and none of them beside another.

After each step the test waits until the worker has dealt with every message (the queue is
empty and nothing is unacked: every task acks late; after a step with copies, for a while
with kombu's restore run meanwhile) and checks the invariants:

* bodies: each identity ran exactly as often as the model says (a retry runs, a duplicate
  does not, a task that ran is never run again because of a duplicate after it, nor because
  of a copy of its own message or its redelivery after success; a body killed half-way runs
  again under its own id, which is at-least-once delivery, not a duplicate); no errback runs
  for a call that succeeded;
* handles: a duplicate call is answered with the original's id (a call an approximate window
  remembers: with None);
* identities: an inner execution runs under its own key, the outer one's is restored after
  it, and each identity has its own durable row;
* locks: none is left ``R`` (running) once its owner stopped; an ``until_executed`` lock is
  gone after its task ended, or is the ``F|`` tombstone of that task's id; an
  ``until_expired`` lock is ``D`` by the original's id;
* results: every id the test awaits ends in the state the model says (SUCCESS with the body's
  value, a skipped duplicate's SUCCESS naming its original, or FAILURE with
  ``DuplicateTaskError`` for a chain whose step is a duplicate): nothing stays PENDING or
  STARTED.

Every seed's sequence holds every operation at least once, in a random order, plus random
extra calls of the quick operations; the seeds are fixed so a failure can be replayed
(``TASKDEDUP_MODEL_SEEDS``; ``TASKDEDUP_MODEL_OPS`` narrows the operations, e.g. to find what
a second bug does).

What the new operations find on the code before the copy rule (efd3d2e; run in a worktree
with ``PYTHONPATH`` at it, so the workers run that library too):

==================================  =====================================================
``TASKDEDUP_MODEL_OPS=...``         failure at efd3d2e (``TASKDEDUP_MODEL_SEEDS=11``)
==================================  =====================================================
eta_copies                          ``eta_window(k) ran 2 times, the model says 1`` (a copy
                                    claimed the RUNNING lock of its own id and ran too)
nested                              identities ``[before=<outer>, applied=<inner>,
                                    between=None, direct=None]``: the outer's is lost after
                                    ``.apply()``, the direct call has none and its
                                    ``effects()`` fails
redeliver_after_success_in_chain    ``errback(k) ran 1 times, the model says 0`` (the
                                    redelivery was skipped as a duplicate of itself, and
                                    its DuplicateTaskError went to the errback)
skewed_clock                        ``remember(k) succeeded within the window: a producer
                                    -450000 ms off must still be answered as its duplicate
                                    (None), got a new call``
(default: all, seeds 11,12)         seed 11, step redeliver_after_success_in_chain (above)
==================================  =====================================================
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import chain
from celery.states import READY_STATES

from taskdedup import DuplicateTaskError
from taskdedup.celery import HEADER, skipped_info
from taskdedup.flow import superseded_value
from taskdedup.limits import waiting_key
from taskdedup.sql import table
from taskdedup.stores import redis as redis_store
from taskdedup.testing import wait_for
from tests.conftest import ModelWorker
from tests.effects import released

pytestmark = pytest.mark.slow

SEEDS = [int(s) for s in os.environ.get("TASKDEDUP_MODEL_SEEDS", "11,12").split(",")]
EXTRA_STEPS = 4
ALL_OPERATIONS = ("delay", "explicit_twice", "retry_throw", "retry_no_throw", "fail_then_again",
                  "chain_dup", "revoke_then_again", "kill_mid_body", "by_name", "eta_copies",
                  "nested", "redeliver_after_success_in_chain", "skewed_clock", "wait",
                  "limited", "limited_kill", "coalesce", "debounce")
# The extra random steps are drawn from the quick operations only (eta_copies and
# kill_mid_body wait out a visibility timeout each), to keep a seed's run short.
QUICK = ("delay", "explicit_twice", "retry_throw", "retry_no_throw", "fail_then_again",
         "chain_dup", "revoke_then_again", "by_name", "nested",
         "redeliver_after_success_in_chain", "skewed_clock", "limited")
# limited_kill failed twice in the parallel CI run (Celery 5.3, 5.6: a body short after 120 s),
# and alone too (seed 12, TASKDEDUP_MODEL_OPS=limited_kill): it killed the worker once the
# task's gauge of waiting calls showed two, which an earlier step's waiters (an entry outlives
# its wait by 30 s) could satisfy before this step's waiters had even been fetched; the
# SIGKILL then caught one in kombu's fetch (popped, not yet unacked), which loses it (SPEC §17:
# the reliable fetch is what closes that). It now waits for these two calls' own entries. What
# is left of that window: a waiting call's put-off message is fetched again every ~0.5 s,
# and a SIGKILL within the millisecond or so of such a fetch still loses it (seeds 11-13,
# 15 kills alone: none).
DEFAULT_OPERATIONS = ALL_OPERATIONS
OPERATIONS = tuple(
    os.environ.get("TASKDEDUP_MODEL_OPS", ",".join(DEFAULT_OPERATIONS)).split(","))


@dataclass
class Model:
    """What must have happened: runs per (task, key), the original id per identity."""

    runs: Counter[tuple[str, str]] = field(default_factory=Counter)
    original: dict[tuple[str, str], str] = field(default_factory=dict)
    ended: set[tuple[str, str]] = field(default_factory=set)  # until_executed: lock gone
    # task id -> the final state its result must have, and the original a skip names
    results: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)  # task id -> its SUCCESS value
    # nests key -> the identities recorded before, inside and after its inner executions
    identities: dict[str, list[str]] = field(default_factory=dict)
    rows: set[str] = field(default_factory=set)  # the durable rows' keys: one per identity
    serial: set[str] = field(default_factory=set)  # on_busy="wait" identities: never overlap
    limited: set[str] = field(default_factory=set)  # Concurrency(1) keys: never overlap


class Driver:
    """Sends calls, waits for the worker to settle, and checks the model."""

    def __init__(self, mapp: Any, rc: redis.Redis, worker: ModelWorker) -> None:
        self.m = mapp
        self.rc = rc
        self.worker = worker
        self.queue = worker.queue
        self.model = Model()
        self.log: list[str] = []
        # task id -> how many of its executions must have ended (a redelivery: one more)
        self.awaited: dict[str, int] = {}
        self.database: str | None = None  # the SQLite URL of the durable rows (nested)

    def key(self) -> str:
        return uuid.uuid4().hex[:10]

    def settle(self, timeout: float = 30) -> None:
        """Every task id sent has ended once (``task_postrun``: success, failure, retry or a
        skip), and every message sent or published since is dealt with: the queue is empty
        and nothing is unacked (every task acks late, after its callbacks are published)."""
        def idle() -> bool:
            ended = all(self.rc.llen(f"model:done:{task_id}") >= n
                        for task_id, n in self.awaited.items())
            return ended and self.rc.llen(self.queue) == 0 and self.rc.hlen("unacked") == 0

        wait_for(idle, timeout=timeout, what=f"the worker to settle after {self.log[-1:]}")

    def quiet(self, seconds: float, timeout: float = 60) -> None:
        """:meth:`settle`, while unacked messages past the visibility timeout are restored as
        kombu does, and then nothing queued or unacked for ``seconds``: every copy of a
        message has ended (a copy put off is republished before its predecessor is acked, so
        the queue is never empty in between for long)."""
        since: list[float] = []

        def still() -> bool:
            self._restore()
            ended = all(self.rc.llen(f"model:done:{task_id}") >= n
                        for task_id, n in self.awaited.items())
            if not ended or self.rc.llen(self.queue) or self.rc.hlen("unacked"):
                since.clear()
                return False
            since.append(time.monotonic())
            return since[-1] - since[0] >= seconds

        wait_for(still, timeout=timeout, interval=0.2,
                 what=f"every copy to end after {self.log[-1:]}")

    def lock_key(self, task: Any, args: tuple[Any, ...]) -> str:
        from taskdedup.celery import get_deduplicator

        return str(get_deduplicator(self.m.app).identity(
            task.name, task._dedup_policy, args, {}, func=task._func()).key)

    def lock(self, task: Any, args: tuple[Any, ...]) -> bytes | None:
        value = self.rc.get(self.lock_key(task, args))
        return value if isinstance(value, bytes) else None

    def runs(self, name: str, key: str) -> int:
        return int(self.rc.llen(f"model:runs:{name}:{key}"))

    # -- operations ----------------------------------------------------------------------

    def delay(self, rng: random.Random) -> None:
        used = [k for (name, k) in self.model.original if name == "charge"]
        key = rng.choice(used) if used and rng.random() < 0.5 else self.key()
        result = self.m.charge.delay(key)
        self.log.append(f"charge.delay({key}) -> {result.id}")
        self.awaited.setdefault(result.id, 1)
        first = self.model.original.setdefault(("charge", key), result.id)
        assert result.id == first, f"a duplicate of charge({key}) must answer {first}"
        self.model.runs[("charge", key)] = 1

    def explicit_twice(self, rng: random.Random) -> None:
        key, task_id = self.key(), str(uuid.uuid4())
        first = self.m.charge.apply_async((key,), task_id=task_id)
        second = self.m.charge.apply_async((key,), task_id=task_id)
        self.log.append(f"charge.apply_async(({key},), task_id={task_id}) twice")
        assert first.id == second.id == task_id
        self.awaited.setdefault(task_id, 1)
        self.model.original[("charge", key)] = task_id
        self.model.runs[("charge", key)] = 1

    def retry_throw(self, rng: random.Random) -> None:
        self._retry(throw=True)

    def retry_no_throw(self, rng: random.Random) -> None:
        self._retry(throw=False)

    def _retry(self, throw: bool) -> None:
        key = self.key()
        result = self.m.retry_once.delay(key, throw)
        self.log.append(f"retry_once.delay({key}, throw={throw}) -> {result.id}")
        self.awaited.setdefault(result.id, 1)
        self.model.original[("retry_once", key)] = result.id
        self.model.runs[("retry_once", key)] = 2  # the first run and its retry

    def fail_then_again(self, rng: random.Random) -> None:
        key = self.key()
        first = self.m.fail_once.delay(key)
        self.log.append(f"fail_once.delay({key}) -> {first.id} (fails)")
        self.awaited.setdefault(first.id, 1)
        self.settle()
        again = self.m.fail_once.delay(key)
        self.log.append(f"fail_once.delay({key}) again -> {again.id}")
        assert again.id != first.id, "a final failure releases the lock: the re-enqueue runs"
        self.awaited.setdefault(again.id, 1)
        self.model.runs[("fail_once", key)] = 2
        self.model.ended.add(("fail_once", key))

    def wait(self, rng: random.Random) -> None:
        """SPEC §15: calls of a running identity wait for it and then each run once."""
        key = self.key()
        sent = [self.m.serial.delay(key, n) for n in range(3)]
        self.log.append(f"serial.delay({key}, 0..2) -> {[r.id for r in sent]}")
        for n, result in enumerate(sent):
            self.awaited.setdefault(result.id, 1)
            self.model.results[result.id] = ("SUCCESS", None)
            self.model.values[result.id] = n
        self.model.runs[("serial", key)] = 3
        self.model.serial.add(key)
        self._ran("serial", key, 3)

    def coalesce(self, rng: random.Random) -> None:
        """SPEC §15: duplicates of a running call get one follow-up (a new id), which runs
        once after it with the latest call's argument; never beside it."""
        key = self.key()
        first = self.m.follow.delay(key, 0)
        self.awaited.setdefault(first.id, 1)
        wait_for(lambda: self.runs("follow", key) == 1, timeout=30,
                 what=f"follow({key}) runs")
        later = [self.m.follow.delay(key, n) for n in (1, 2, 3)]
        self.log.append(f"follow.delay({key}, 0) -> {first.id}, 1..3 while it runs -> "
                        f"{[r.id for r in later]}")
        assert len({r.id for r in later}) == 1 and later[0].id != first.id, (
            f"the duplicates of running follow({key}) must share one new follow-up id")
        self.awaited.setdefault(later[0].id, 1)
        for result, n in ((first, 0), (later[0], 3)):
            self.model.results[result.id] = ("SUCCESS", None)
            self.model.values[result.id] = n
        self.model.runs[("follow", key)] = 2
        self.model.serial.add(key)
        self._ran("follow", key, 2)

    def debounce(self, rng: random.Random) -> None:
        """SPEC §15: a burst of debounced calls runs once, the last call's argument; the
        others end SUCCESS as superseded (their generations 1, 2, ...)."""
        key = self.key()
        sent = [self.m.bounce.delay(key, n) for n in range(rng.randint(2, 4))]
        self.log.append(f"bounce.delay({key}, 0..{len(sent) - 1}) -> {[r.id for r in sent]}")
        for n, result in enumerate(sent):
            self.awaited.setdefault(result.id, 1)
            self.model.results[result.id] = ("SUCCESS", None)
            self.model.values[result.id] = (n if n == len(sent) - 1
                                            else superseded_value(n + 1))
        self.model.runs[("bounce", key)] = 1
        self._ran("bounce", key, 1)

    def limited(self, rng: random.Random) -> None:
        """SPEC §16: calls of one limit key run one at a time, each once."""
        key = self.key()
        sent = [self.m.limited.delay(key, n) for n in range(3)]
        self.log.append(f"limited.delay({key}, 0..2) -> {[r.id for r in sent]}")
        self._expect_limited(key, sent, runs=3)

    def limited_kill(self, rng: random.Random) -> None:
        """SPEC §16: a SIGKILLed slot holder's slot lapses within its lease; its redelivery
        and the calls waiting for the slot run, one at a time."""
        key = self.key()
        holder = self.m.limited.delay(key, 0, 1.5)
        wait_for(lambda: self.runs("limited", key) == 1, timeout=30, what="the holder to start")
        waiting = [self.m.limited.delay(key, n) for n in (1, 2)]
        self.log.append(f"limited.delay({key}, 0, 1.5) -> {holder.id} SIGKILLed while it runs, "
                        f"waiting: {[r.id for r in waiting]}")
        wait_for(lambda: self._put_off("model.limited", [r.id for r in waiting]), timeout=20,
                 what="the waiting calls put off")
        # and their put-off messages held by the worker: the gauge entry is written just before
        # the republish, which the worker's BRPOP takes at once, so a SIGKILL right after the
        # entry appears lands in kombu's fetch window (popped, not yet unacked) far more often
        # than at random
        wait_for(lambda: self._held([r.id for r in waiting]), timeout=20,
                 what="the waiting calls' put-off messages held by the worker")
        assert self.runs("limited", key) == 1, "the waiting calls never run beside the holder"
        self.worker.kill()
        self.rc.set(f"model:busy:limited:{key}", 0)  # the killed body never counts down
        self.worker.start()
        wait_for(self._restored, timeout=60, interval=0.5, what="the killed messages restored")
        # the killed body, its redelivery (same id, late ack) and the two waiting calls
        sent = [holder, *waiting]
        try:
            self.settle(timeout=60)
            self._expect_limited(key, sent, runs=4)
        except TimeoutError:
            self._lost_in_kombus_fetch([r.id for r in sent])
            raise

    def _lost_in_kombus_fetch(self, ids: list[str]) -> None:
        """XFAIL when a call that never ended is in no queue and in kombu's unacked hash
        neither: the SIGKILL caught its put-off message in kombu's fetch (popped by BRPOP, not
        yet recorded as unacked), which loses it for good (SPEC §17; the reliable fetch closes
        it, tests/test_celery_fetch_kills.py). A waiting call is fetched again about every
        0.5 s, so a kill lands there now and then; any other shortfall fails."""
        held = b"".join([*self.rc.lrange(self.queue, 0, -1), *self.rc.hvals("unacked")])
        lost = [task_id for task_id in ids
                if self.m.app.AsyncResult(task_id).state not in READY_STATES
                and task_id.encode() not in held]
        if lost:
            pytest.xfail(f"kombu's fetch lost {lost} to the SIGKILL (popped, never unacked: "
                         f"SPEC §17); steps: {self.log}")
        # any other shortfall: say where each call is, and what the worker said last
        where = {task_id: (self.m.app.AsyncResult(task_id).state,
                           "held" if task_id.encode() in held else "nowhere")
                 for task_id in ids}
        print(f"calls: {where}\nthe end of the worker's log:\n{self.worker.output()[-6000:]}",
              file=sys.stderr)

    def _held(self, ids: list[str]) -> bool:
        """Each of ``ids`` is in kombu's unacked hash and none is in the queue."""
        unacked = b"".join(self.rc.hvals("unacked"))
        queued = b"".join(self.rc.lrange(self.queue, 0, -1))
        return all(i.encode() in unacked and i.encode() not in queued for i in ids)

    def _put_off(self, task: str, ids: list[str]) -> bool:
        """Each of ``ids`` has been put off by its limit (its own entry in the task's gauge of
        waiting calls): fetched, refused and given back, not still on its way to the worker.
        The gauge's count is no proof: it is the task's, and an entry outlives its wait by 30 s,
        so an earlier step's waiters satisfied it while these calls were still being fetched
        and the SIGKILL lost one in kombu's fetch (popped, not yet unacked: SPEC §17)."""
        gauge = waiting_key("taskdedup", task)
        return all(self.rc.zscore(gauge, task_id) is not None for task_id in ids)

    def _expect_limited(self, key: str, sent: list[Any], runs: int) -> None:
        for n, result in enumerate(sent):
            self.awaited.setdefault(result.id, 1)
            self.model.results[result.id] = ("SUCCESS", None)
            self.model.values[result.id] = n
        self.model.runs[("limited", key)] = runs
        self.model.limited.add(key)
        self._ran("limited", key, runs)

    def _ran(self, name: str, key: str, runs: int) -> None:
        """Wait until the bodies the model expects have run. A call put off (waiting, a
        follow-up, a limit, a countdown) ends its first delivery IGNORED, which ``settle``
        counts as ended, and its republished message can sit in kombu's fetch window (popped,
        not yet unacked: SPEC §17) just when ``settle`` looks at an empty queue."""
        wait_for(lambda: self.runs(name, key) >= runs, timeout=120,
                 what=f"{name}({key}) to run {runs} times")

    def chain_with_a_duplicate_step(self, rng: random.Random) -> str:
        key = self.key()
        held = self.m.receipt.delay(key)  # the chain's second step is already done
        self.log.append(f"receipt.delay({key}) -> {held.id}")
        self.awaited.setdefault(held.id, 1)
        self.settle()
        result = chain(self.m.charge.s(key), self.m.receipt.s(), self.m.log.s()).apply_async()
        charge_id = result.parent.parent.id
        self.log.append(f"chain(charge({key}), receipt, log) -> charge {charge_id}")
        self.awaited.setdefault(charge_id, 1)
        self.model.original[("charge", key)] = charge_id
        self.model.original[("receipt", key)] = held.id
        self.model.runs[("charge", key)] = 1
        self.model.runs[("receipt", key)] = 1
        self.model.results[result.id] = ("FAILURE", held.id)  # the chain ends in that error
        self.model.results[charge_id] = ("SUCCESS", None)
        self.settle()
        again = self.m.charge.delay(key)  # a task that ran is never run again after this
        self.log.append(f"charge.delay({key}) after the chain -> {again.id}")
        assert again.id == charge_id, "charge ran: its lock must still hold (done)"
        return str(result.id)

    def chain_dup(self, rng: random.Random) -> None:
        self.chain_with_a_duplicate_step(rng)

    def revoke_then_again(self, rng: random.Random) -> None:
        key = self.key()
        queued = self.m.charge.apply_async((key,), countdown=1.0)
        self.m.app.control.revoke(queued.id)
        self.log.append(f"charge.apply_async(({key},), countdown=1) -> {queued.id}, revoked")
        wait_for(lambda: self.lock(self.m.charge, (key,)) is None, timeout=30,
                 what="the revoked call's lock to be released")
        again = self.m.charge.delay(key)
        self.log.append(f"charge.delay({key}) after the revoke -> {again.id}")
        assert again.id != queued.id, "a revoked call's lock is released: the re-enqueue runs"
        self.awaited.setdefault(again.id, 1)
        self.model.original[("charge", key)] = again.id
        self.model.runs[("charge", key)] = 1
        self.model.results[again.id] = ("SUCCESS", None)

    def kill_mid_body(self, rng: random.Random) -> None:
        key = self.key()
        first = self.m.slow.delay(key)
        self.log.append(f"slow.delay({key}) -> {first.id}, worker SIGKILLed while it runs")
        wait_for(lambda: self.runs("slow", key) == 1, timeout=30, what="the body to start")
        self.worker.kill()
        duplicate = self.m.slow.delay(key)  # while no worker runs: the lock is still R
        assert duplicate.id == first.id, "a duplicate of a running task answers the original"
        self.worker.start()
        self.awaited.setdefault(first.id, 1)
        # The message comes back once kombu restores it, past the visibility timeout (4 s).
        # Celery 5.7's kombu looks every second; older ones every ~100 s (every 10th call of a
        # 10 s timer): do now, from here, what that timer does.
        wait_for(self._restored, timeout=60, interval=0.5, what="the killed message restored")
        self.settle(timeout=60)
        self.model.original[("slow", key)] = first.id
        self.model.runs[("slow", key)] = 2  # the killed body, and its redelivery (same id)
        self.model.results[first.id] = ("SUCCESS", None)

    def _restored(self) -> bool:
        self._restore()
        return self.rc.hlen("unacked") == 0

    def _restore(self) -> None:
        """What kombu's own timer does (5.7: every second; older: every ~100 s): put each
        unacked message held past the visibility timeout back in its queue."""
        with self.m.app.connection_for_write() as conn:
            conn.default_channel.qos.restore_visible(num=100, interval=1)

    def by_name(self, rng: random.Random) -> None:
        done = [(k, tid) for (name, k), tid in self.model.original.items()
                if name == "charge" and ("charge", k) not in self.model.ended
                and self.model.results.get(tid, ("SUCCESS", None))[0] == "SUCCESS"]
        if not done:
            self.delay(rng)
            self.settle()
            return self.by_name(rng)
        key, original = rng.choice(done)
        sent = self.m.app.send_task("model.charge", (key,))
        self.log.append(f"send_task('model.charge', ({key},)) -> {sent.id}")
        self.awaited.setdefault(sent.id, 1)
        self.model.results[sent.id] = ("SUCCESS", original)  # skipped, naming the original
        return None

    def eta_copies(self, rng: random.Random) -> None:
        """A countdown beyond the visibility timeout: the worker holds the message unacked
        until it is due, kombu restores it meanwhile, so copies of one id are due together,
        claim while the body runs (RUNNING by this id) and after it (DONE by this id, or the
        ``F|`` tombstone under until_executed). One body per call, its handle its result."""
        visibility = float(self.m.app.conf.broker_transport_options["visibility_timeout"])
        calls = [(self.m.eta_window, "eta_window", self.key()),
                 (self.m.eta_once, "eta_once", self.key())]
        ids: list[str] = []
        for task, name, key in calls:
            sent = task.apply_async((key,), countdown=1.5 * visibility)
            self.log.append(f"{name}.apply_async(({key},), countdown={1.5 * visibility}) "
                            f"-> {sent.id}")
            self.awaited.setdefault(sent.id, 1)
            self.model.original[(name, key)] = sent.id
            self.model.runs[(name, key)] = 1
            self.model.results[sent.id] = ("SUCCESS", None)
            self.model.values[sent.id] = key
            if name == "eta_once":
                self.model.ended.add((name, key))
            ids.append(sent.id)
        self.quiet(2.0, timeout=60)
        copies = {task_id: self.rc.llen(f"model:done:{task_id}") for task_id in ids}
        assert all(n >= 2 for n in copies.values()), (
            f"each call's message must have been copied (ends per id: {copies})")

    def nested(self, rng: random.Random) -> None:
        """A gated task runs another with ``.apply()`` and one directly in-process: each
        inner execution under its own identity (and its own durable row), the outer one's
        before, between and after them."""
        key = self.key()
        db = self._database()
        result = self.m.nests.delay(key, db)
        self.log.append(f"nests.delay({key}) -> {result.id}")
        self.awaited.setdefault(result.id, 1)
        outer = self.lock_key(self.m.nests, (key, db))
        applied = self.lock_key(self.m.inner, (key, "applied", db))
        direct = self.lock_key(self.m.inner, (key, "direct", db))
        self.model.original[("nests", key)] = result.id
        self.model.runs[("nests", key)] = 1
        self.model.runs[("inner", f"{key}-applied")] = 1
        self.model.runs[("inner", f"{key}-direct")] = 1
        self.model.results[result.id] = ("SUCCESS", None)
        self.model.values[result.id] = key
        self.model.identities[key] = [f"before={outer}", f"applied={applied}",
                                      f"between={outer}", f"direct={direct}",
                                      f"after={outer}"]
        self.model.rows |= {outer, applied, direct}

    def _database(self) -> str:
        """A SQLite file with the durable tier's table, made on first use."""
        if self.database is None:
            path = Path(tempfile.mkdtemp(prefix="taskdedup-model-")) / "effects.sqlite"
            self.database = f"sqlite:///{path}"
            engine = sa.create_engine(self.database)
            table(sa.MetaData()).metadata.create_all(engine)
            engine.dispose()
        return self.database

    def redeliver_after_success_in_chain(self, rng: random.Random) -> None:
        """A chain's step succeeded; its message comes back as kombu redelivers it (same id,
        same header, the chain's next step and an errback attached): it ends without a new
        outcome. The next step does not run again, no errback runs, the result stays."""
        key = self.key()
        result = chain(self.m.charge.s(key), self.m.receipt.s()).apply_async()
        charge_id = result.parent.id
        self.log.append(f"chain(charge({key}), receipt) -> charge {charge_id}, "
                        f"receipt {result.id}")
        self.awaited.setdefault(charge_id, 1)
        self.awaited.setdefault(result.id, 1)
        self.settle()
        lock_key = self.lock_key(self.m.charge, (key,))
        # task_success (the completion) follows the result's write: wait for the done lock
        wait_for(lambda: (self.rc.get(lock_key) or b"").startswith(b"D"), timeout=10,
                 what=f"charge({key})'s lock done")
        self.m.app.send_task(
            "model.charge", (key,), task_id=charge_id,
            headers={HEADER: {"task": "model.charge", "key": lock_key}},
            chain=[self.m.receipt.s().set(task_id=result.id)],
            link_error=self.m.errback.si(key))
        self.log.append(f"charge({key}) redelivered as {charge_id}, with its chain and an "
                        "errback")
        self.awaited[charge_id] = 2  # the redelivered copy ended too
        self.model.original[("charge", key)] = charge_id
        self.model.original[("receipt", key)] = result.id
        self.model.runs[("charge", key)] = 1
        self.model.runs[("receipt", key)] = 1
        self.model.runs[("errback", key)] = 0
        for task_id in (charge_id, result.id):
            self.model.results[task_id] = ("SUCCESS", None)
            self.model.values[task_id] = key

    def skewed_clock(self, rng: random.Random) -> None:
        """An approximate window (``remember``: the lock goes after success, a Bloom filter
        keeps the identity) asked by a producer whose clock is off by more than the whole
        window: it is still answered as a duplicate (the server's clock picks the slices)."""
        key = self.key()
        first = self.m.remember.delay(key)
        self.log.append(f"remember.delay({key}) -> {first.id}")
        self.awaited.setdefault(first.id, 1)
        self.model.runs[("remember", key)] = 1
        self.model.results[first.id] = ("SUCCESS", None)
        self.model.values[first.id] = key
        self.settle()
        lock_key = self.lock_key(self.m.remember, (key,))
        wait_for(lambda: released(self.rc, lock_key), timeout=10,
                 what=f"the lock to give way to the filter "
                      f"({self.lock(self.m.remember, (key,))!r})")
        policy = self.m.remember._dedup_policy
        skew_ms = rng.choice((-1, 1)) * int((policy.ttl + 2 * policy.ttl / 4) * 1000)
        with skewed(skew_ms):
            again = self.m.remember.delay(key)
        self.log.append(f"remember.delay({key}) with the producer's clock {skew_ms} ms off "
                        f"-> {getattr(again, 'id', None)}")
        assert again is None, (
            f"remember({key}) succeeded within the window: a producer {skew_ms} ms off must "
            f"still be answered as its duplicate (None), got a new call {again.id}")

    # -- the invariants ------------------------------------------------------------------

    def check(self) -> None:
        self.settle()
        tasks: dict[str, Callable[..., Any]] = {
            "charge": self.m.charge, "receipt": self.m.receipt, "log": self.m.log,
            "fail_once": self.m.fail_once, "retry_once": self.m.retry_once, "slow": self.m.slow,
            "eta_window": self.m.eta_window, "eta_once": self.m.eta_once, "nests": self.m.nests,
        }
        for (name, key), expected in self.model.runs.items():
            assert self.runs(name, key) == expected, (
                f"{name}({key}) ran {self.runs(name, key)} times, the model says {expected}; "
                f"steps: {self.log}")
        for key in self.model.serial:
            overlaps = self.rc.lrange(f"model:overlap:serial:{key}", 0, -1)
            assert not overlaps, (
                f"serial({key}) ran beside another run of its identity ({overlaps}); steps: "
                f"{self.log}")
        for key in self.model.limited:
            overlaps = self.rc.lrange(f"model:overlap:limited:{key}", 0, -1)
            assert not overlaps, (
                f"limited({key}) ran beside another body of its limit key ({overlaps}); "
                f"steps: {self.log}")
        for key, expected in self.model.identities.items():
            seen = [x.decode() for x in self.rc.lrange(f"model:identity:{key}", 0, -1)]
            assert seen == expected, (
                f"nests({key}) ran under these identities {seen}, the model says {expected} "
                f"(before, .apply(), between, direct call, after); steps: {self.log}")
        if self.model.rows:
            engine = sa.create_engine(str(self.database))
            effects = table(sa.MetaData())
            with engine.connect() as conn:
                keys = Counter(row.key for row in conn.execute(sa.select(effects)))
            engine.dispose()
            assert keys == Counter(self.model.rows), (
                f"the durable rows are {dict(keys)}, the model says one per identity "
                f"{sorted(self.model.rows)}; steps: {self.log}")
        for (name, key), owner in self.model.original.items():
            if name == "retry_once":
                continue  # its identity includes `throw`; checked by runs
            args = (key, self.database) if name == "nests" else (key,)
            value = self.lock(tasks[name], args)
            if (name, key) in self.model.ended:
                # gone, or the tombstone its success leaves for its own copies (SPEC §5)
                assert released(self.rc, self.lock_key(tasks[name], args)), (
                    f"{name}({key}) ended: its lock must be gone ({value!r})")
                assert value is None or value.endswith(owner.encode()), (
                    f"{name}({key})'s tombstone must be the original's ({owner}): {value!r}")
            else:
                assert value is not None and value.startswith(b"D"), (
                    f"{name}({key}) succeeded: its lock must be done, got {value!r}")
                assert value.endswith(owner.encode()), (
                    f"{name}({key})'s lock must be the original's ({owner}): {value!r}")
        for task_id, (state, original) in self.model.results.items():
            result = self.m.app.AsyncResult(task_id)
            wait_for(lambda r=result: r.state in READY_STATES, timeout=10,
                     what=f"{task_id}'s result to be final ({result.state}); steps: {self.log}")
            assert result.state == state, (
                f"{task_id} ended {result.state}, the model says {state}; steps: {self.log}")
            if state == "FAILURE":
                assert isinstance(result.result, DuplicateTaskError)
                assert result.result.existing_id == original
            else:
                assert skipped_info(result) == (
                    None if original is None else {"existing_id": original, "state": "done"})
            if task_id in self.model.values:
                assert result.result == self.model.values[task_id], (
                    f"{task_id}'s result is {result.result!r}, the model says "
                    f"{self.model.values[task_id]!r}; steps: {self.log}")


@contextmanager
def skewed(skew_ms: int) -> Iterator[None]:
    """This process's clock, as the Redis store reads it, ``skew_ms`` off (nothing learnt of
    the server's meanwhile)."""
    now_ms, offset = redis_store._now_ms, getattr(redis_store, "_offset_ms", None)
    redis_store._now_ms = lambda: int(time.time() * 1000) + skew_ms  # type: ignore[assignment]
    if offset is not None:
        redis_store._offset_ms = 0  # type: ignore[attr-defined]
    try:
        yield
    finally:
        redis_store._now_ms = now_ms  # type: ignore[assignment]
        if offset is not None:
            redis_store._offset_ms = offset  # type: ignore[attr-defined]


def test_random_sequences_hold_the_model(mapp: Any, rc: redis.Redis,
                                         model_worker: ModelWorker) -> None:
    for seed in SEEDS:
        rng = random.Random(seed)
        quick = [op for op in OPERATIONS if op in QUICK] or list(OPERATIONS)
        steps = list(OPERATIONS) + [rng.choice(quick) for _ in range(EXTRA_STEPS)]
        rng.shuffle(steps)
        driver = Driver(mapp, rc, model_worker)
        for step in steps:
            try:
                getattr(driver, step)(rng)
                driver.check()
            except (AssertionError, TimeoutError) as exc:
                raise AssertionError(f"seed {seed}, step {step}: {exc}; steps: {driver.log}"
                                     ) from None


def test_a_chain_whose_next_step_is_a_duplicate_never_runs_the_first_step_again(
    mapp: Any, rc: redis.Redis, model_worker: ModelWorker,
) -> None:
    driver = Driver(mapp, rc, model_worker)
    chain_id = driver.chain_with_a_duplicate_step(random.Random(0))
    driver.check()
    state = mapp.app.AsyncResult(chain_id).state
    assert state in READY_STATES, f"the chain ended silently: its result is {state}"
