"""Real solo-pool (and threads-pool) Celery workers: the claim goes out ahead of the body
(``taskdedup.celery.ahead``), and every verdict it can bring still guards the body.

Messages are published to a staging queue no worker reads, prepared (a lock set by hand, a
body spoilt), then moved to the worker's queue in one ``RENAME``.
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from taskdedup.testing import wait_for
from tests.effects import recorded, released
from tests.workers import CeleryWorker, celery_test_app, staging, stored_result

pytestmark = pytest.mark.slow

QUEUE = "it-solo"
STAGE = "it-solo-stage"


@pytest.fixture(scope="module")
def worker(redis_url: str) -> Iterator[CeleryWorker]:
    yield from CeleryWorker(redis_url, queue=QUEUE, concurrency=1, pool="solo").running()


@pytest.fixture(scope="module")
def capp(redis_url: str, worker: CeleryWorker) -> Any:
    return celery_test_app(redis_url, worker.queue)


@pytest.fixture
def rc(redis_url: str) -> Iterator[redis.Redis]:
    yield from staging(redis_url, STAGE)


def label() -> str:
    return uuid.uuid4().hex[:12]


def staged(capp: Any, rc: redis.Redis, task: Any, *args: Any) -> tuple[str, str]:
    """Publish ``task(*args)`` to the staging queue: ``(task id, lock key)``."""
    result = task.apply_async(args, queue=STAGE)
    assert rc.lindex(STAGE, -1) is not None
    return result.id, capp.lock_key(task, *args)


def deliver(rc: redis.Redis) -> None:
    rc.rename(STAGE, QUEUE)


class Monitor:
    """The server's MONITOR stream, in a thread, while the block runs: every command the
    server ran until the block ended (read up to an ``ECHO`` of a word of its own, so a
    reader that lags behind the server still gets every line before it)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.lines: list[str] = []
        self._end = f"monitor-end-{uuid.uuid4().hex}"
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.client.monitor() as monitor:
            self._ready.set()
            while True:
                command = monitor.next_command()["command"]
                if command.endswith(self._end):
                    return
                self.lines.append(command)

    def __enter__(self) -> Monitor:
        self._ready = threading.Event()
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.echo(self._end)  # the stream's last line: the thread reads up to it
        self._thread.join(30)
        assert not self._thread.is_alive(), "MONITOR did not show the end of the block"


def is_claim(line: str, claim_sha: str, task_id: str) -> bool:
    """Whether a MONITOR line is the claim of ``task_id``: its script, or the swap a server
    with SET IFEQ takes instead (``stores/cas.py``)."""
    if line.startswith(f"EVALSHA {claim_sha}"):
        return task_id in line
    return line.startswith("SET ") and " IFEQ " in line and f"R||{task_id}" in line


def test_the_claim_rides_in_kombus_record_of_the_message_and_guards_the_body(
    capp: Any, rc: redis.Redis, redis_url: str,
) -> None:
    """Each claim is carried by the transaction of kombu's unacked record of its message,
    whose reply the worker waits for before Celery sees the message (``ClaimAhead``): one
    round trip for both, no command of its own. Before, it went out just ahead of the record
    on a connection of its own; without ``ClaimAhead`` it came after (``before_start``)."""
    from taskdedup.celery import get_deduplicator

    claim_sha = get_deduplicator(capp.app).store._claim.sha
    names = [label() for _ in range(3)]
    calls = [staged(capp, rc, capp.record_until_executed, name) for name in names]
    assert rc.llen(STAGE) == len(names)
    with Monitor(redis.Redis.from_url(redis_url)) as monitor:
        deliver(rc)
        for name, (_, key) in zip(names, calls, strict=True):
            wait_for(lambda name=name: recorded(rc, name), timeout=30, what="the body ran")
            wait_for(lambda key=key: released(rc, key), timeout=30, what="the lock completed")
    lines = monitor.lines
    for name, (task_id, key) in zip(names, calls, strict=True):
        claim = next(i for i, line in enumerate(lines)
                     if is_claim(line, claim_sha, task_id))
        record = next(i for i, line in enumerate(lines)
                      if line.startswith("HSET unacked ") and task_id in line)
        end = lines.index("EXEC", claim)
        around = lines[record - 3:end + 1]
        assert claim == record + 1 and lines[record - 2] == "MULTI", around
        # nothing else in the transaction (Redis < 7 shows the script's own commands, on its key)
        assert all(key in line for line in lines[claim + 1:end]), around
        assert recorded(rc, name) == ["0"]


def is_completion(line: str, complete_sha: str, task_id: str) -> bool:
    """Whether a MONITOR line is the completion of ``task_id`` (an ``until_executed`` lock:
    the swap from running to the FINISHED tombstone, or the script)."""
    if line.startswith(f"EVALSHA {complete_sha}"):
        return task_id in line
    return line.startswith("SET ") and f" F||{task_id} IFEQ " in line


@pytest.fixture
def holding_worker(redis_url: str, capp: Any) -> Iterator[CeleryWorker]:
    """A solo worker whose held completions wait up to 0.5 s for the next record
    (``HOLD_FOR``): long enough for any machine's next fetch, short enough to see."""
    yield from CeleryWorker(redis_url, queue=f"{QUEUE}-held", concurrency=1, pool="solo",
                            env={"TASKDEDUP_TEST_HOLD_FOR": "0.5"}).running()


def _run_staged(rc: redis.Redis, redis_url: str, queue: str,
                calls: list[tuple[str, str]], names: list[str]) -> list[str]:
    """Deliver the staged calls to ``queue``; the MONITOR lines until each ran, its lock
    completed and its message was acked (an ``acks_late`` one's ack follows its completion)."""
    with Monitor(redis.Redis.from_url(redis_url)) as monitor:
        rc.rename(STAGE, queue)
        for name, (task_id, key) in zip(names, calls, strict=True):
            wait_for(lambda name=name: recorded(rc, name), timeout=30, what="the body ran")
            wait_for(lambda key=key: released(rc, key), timeout=30, what="the lock completed")
            wait_for(lambda task_id=task_id: not any(
                task_id.encode() in record for record in rc.hvals("unacked")),
                timeout=30, what="the message acked")
    return monitor.lines


def _record(lines: list[str], task_id: str) -> tuple[int, int, str]:
    """kombu's record of ``task_id``'s message: the indexes of its ``MULTI`` and ``EXEC``,
    and the message's delivery tag."""
    at = next(i for i, line in enumerate(lines)
              if line.startswith("HSET unacked ") and task_id in line)
    start = max(i for i in range(at) if lines[i] == "MULTI")
    return start, lines.index("EXEC", at), lines[at].split(" ")[2]


def test_a_completion_nobody_sees_rides_the_next_record(
    holding_worker: CeleryWorker, capp: Any, rc: redis.Redis, redis_url: str,
) -> None:
    """A call whose outcome nobody sees (no result stored, no callbacks), acked before its
    body: its completion is held for kombu's record of the next message, which carries it
    (no command of its own); the last one, with no next message, goes out on its own
    within ``HOLD_FOR``."""
    from taskdedup.celery import get_deduplicator

    complete_sha = get_deduplicator(capp.app).store._complete.sha
    names = [label() for _ in range(3)]
    calls = [staged(capp, rc, capp.record_unseen, name) for name in names]
    lines = _run_staged(rc, redis_url, holding_worker.queue, calls, names)
    records = [_record(lines, task_id) for task_id, _ in calls]
    for n, (task_id, _) in enumerate(calls):
        done = [i for i, line in enumerate(lines) if is_completion(line, complete_sha, task_id)]
        assert done, f"no completion of call {n}"
        if n + 1 < len(calls):  # inside the next message's record
            start, end, _ = records[n + 1]
            assert start < done[0] < end, lines[start:end + 1]
        else:
            assert done[0] > records[n][1]
            assert not any(start < done[0] < end for start, end, _ in records)
    assert [len(recorded(rc, name)) for name in names] == [1] * len(names)  # each ran once


def test_a_completion_acked_after_its_body_is_never_held(
    holding_worker: CeleryWorker, capp: Any, rc: redis.Redis, redis_url: str,
) -> None:
    """``acks_late``: the message stays in the broker until after the body, and kombu may
    hand out a copy; the completion goes out before the ack, never later in another
    record (a worker killed between them would leave the copy a running lock)."""
    from taskdedup.celery import get_deduplicator

    complete_sha = get_deduplicator(capp.app).store._complete.sha
    names = [label() for _ in range(2)]
    calls = [staged(capp, rc, capp.record_unseen_late, name) for name in names]
    lines = _run_staged(rc, redis_url, holding_worker.queue, calls, names)
    records = [_record(lines, task_id) for task_id, _ in calls]
    for (task_id, _), (_, _, tag) in zip(calls, records, strict=True):
        done = next(i for i, line in enumerate(lines)
                    if is_completion(line, complete_sha, task_id))
        ack = next(i for i, line in enumerate(lines) if line == f"HDEL unacked {tag}")
        assert done < ack
        assert not any(start < done < end for start, end, _ in records)


def test_a_claim_sent_ahead_that_finds_another_holder_skips_the_body(
    capp: Any, rc: redis.Redis,
) -> None:
    name = label()
    task_id, key = staged(capp, rc, capp.record_until_executed, name)
    ttl = rc.pttl(key)
    rc.set(key, "R||other-holder", px=ttl)  # another execution runs this identity now
    deliver(rc)
    result = capp.app.AsyncResult(task_id).get(timeout=30)
    assert result["taskdedup"] == "skipped duplicate"
    assert result["existing_id"] == "other-holder"
    assert recorded(rc, name) == []
    assert rc.get(key) == b"R||other-holder"  # never touched


def test_a_claim_sent_ahead_for_a_body_that_never_runs_gives_the_lock_back(
    capp: Any, rc: redis.Redis, worker: CeleryWorker,
) -> None:
    """A message whose body does not decode fails before ``before_start``: the claim sent
    ahead had turned the lock to running; it is released, not left for its lease."""
    name = label()
    task_id, key = staged(capp, rc, capp.record_until_executed, name)
    message = json.loads(rc.lindex(STAGE, 0))
    message["body"] = base64.b64encode(b"{not json").decode()
    rc.lset(STAGE, 0, json.dumps(message))
    deliver(rc)
    wait_for(lambda: task_id in worker.output(), timeout=30, what="the worker took it")
    wait_for(lambda: not (rc.get(key) or b"").startswith(b"R|"), timeout=10,
             what="the lock no longer running")
    # and the worker still runs the next call, guarded
    after = label()
    assert capp.record_until_executed.delay(after).get(timeout=30) == after
    assert recorded(rc, after) == ["0"]
    assert recorded(rc, name) == []


@pytest.fixture
def apart_worker(redis_url: str, capp: Any) -> Iterator[CeleryWorker]:
    """A solo worker whose locks are in another database than its broker's."""
    lock_url = redis_url.rsplit("/", 1)[0] + "/1"
    yield from CeleryWorker(redis_url, queue=f"{QUEUE}-apart", concurrency=1, pool="solo",
                            env={"TASKDEDUP_TEST_LOCK_URL": lock_url}).running()


def test_with_the_locks_apart_the_claim_goes_out_before_the_record_on_its_own(
    capp: Any, rc: redis.Redis, redis_url: str, apart_worker: CeleryWorker,
) -> None:
    """Locks in another database than the broker's: the claim still goes out before kombu's
    record, on a connection of its own, and guards the body."""
    from taskdedup.celery import get_deduplicator

    claim_sha = get_deduplicator(capp.app).store._claim.sha
    locks = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/1")
    name = label()
    task_id, key = staged(capp, rc, capp.record_until_executed, name)
    with Monitor(redis.Redis.from_url(redis_url)) as monitor:
        rc.rename(STAGE, apart_worker.queue)
        assert capp.app.AsyncResult(task_id).get(timeout=30) == name
        wait_for(lambda: released(locks, key), timeout=30, what="the lock completed")
    lines = monitor.lines
    claim = next(i for i, line in enumerate(lines)
                 if is_claim(line, claim_sha, task_id))
    record = next(i for i, line in enumerate(lines)
                  if line.startswith("HSET unacked ") and task_id in line)
    assert claim < record, lines[claim - 2:record + 2]
    assert lines[claim - 1] != "MULTI", lines[claim - 2:record + 2]
    assert recorded(rc, name) == ["0"]


def test_a_threads_pool_worker_guards_each_body(
    capp: Any, rc: redis.Redis, redis_url: str,
) -> None:
    """A threads pool (its claims sent as the pool accepts each task: ``DedupRequest``): a
    call that finds another holder is skipped, the others run once each."""
    queue = f"{QUEUE}-threads"
    names = [label() for _ in range(4)]
    calls = [staged(capp, rc, capp.record_until_executed, name) for name in names]
    held_id, held_key = calls[0]
    rc.set(held_key, "R||other-holder", px=rc.pttl(held_key))
    worker = CeleryWorker(redis_url, queue=queue, concurrency=2, pool="threads").start()
    try:
        rc.rename(STAGE, worker.queue)
        skipped = capp.app.AsyncResult(held_id).get(timeout=30)
        assert skipped["existing_id"] == "other-holder"
        for name, (task_id, key) in zip(names[1:], calls[1:], strict=True):
            assert stored_result(capp.app, task_id, worker, about=lambda name=name, key=key: (
                f"ran {recorded(rc, name)}, lock {rc.get(key)!r}, "
                f"queue {rc.llen(worker.queue)}")) == name
            wait_for(lambda key=key: released(rc, key), timeout=30, what="completed")
            assert recorded(rc, name) == ["0"]
    finally:
        worker.stop()
    assert recorded(rc, names[0]) == []
    assert rc.get(held_key) == b"R||other-holder"


def test_a_fresh_threads_pool_runs_its_first_calls_at_once_each_without_waiting(
    capp: Any, rc: redis.Redis, redis_url: str,
) -> None:
    """Eight threads take their first gated calls at the same moment: each call runs once, at
    once — none is put off as a copy of itself (its threads once built a deduplicator each, and
    a claim sent ahead on one was claimed again on the other: ``tests/test_celery_ahead.py``).
    The worker takes 0.2 s more to build the app's deduplicator, so the threads ask together."""
    queue = f"{QUEUE}-threads8"
    names = [label() for _ in range(16)]
    calls = [staged(capp, rc, capp.record_until_executed, name) for name in names]
    worker = CeleryWorker(redis_url, queue=queue, concurrency=8, pool="threads",
                          env={"TASKDEDUP_TEST_SLOW_BUILD": "0.2"}).start()
    try:
        rc.rename(STAGE, worker.queue)
        states: dict[str, Any] = {}

        def all_stored() -> bool:
            for task_id, _ in calls:
                states[task_id] = capp.app.backend.get_task_meta(task_id, cache=False)
            return all(meta.get("status") == "SUCCESS" for meta in states.values())

        try:  # a call put off as a copy is republished a quarter of its lease (60 s) later
            wait_for(all_stored, timeout=15, interval=0.2, what="every result stored")
        except TimeoutError as exc:
            waiting = [t for t, meta in states.items() if meta.get("status") != "SUCCESS"]
            raise AssertionError(f"not run at once: {waiting}; worker log:\n"
                                 f"{worker.output()[-4000:]}") from exc
        for name, (task_id, _) in zip(names, calls, strict=True):
            assert states[task_id]["result"] == name
            assert recorded(rc, name) == ["0"]
        assert "in another copy of its message" not in worker.output()
    finally:
        worker.stop()
