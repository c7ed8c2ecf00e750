"""Real prefork Celery workers with ``taskdedup_prefork_handover``: the main process carries
each claim in kombu's record of the message and hands it to the pool process that runs the
body (``taskdedup.celery.handover``); a claim no pool process takes is given back, whatever
ends the request. Without the setting (the default), each pool process claims its own.

Messages are published to a staging queue no worker reads, prepared, then moved to the
worker's queue in one ``RENAME``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from taskdedup.testing import wait_for
from tests.effects import recorded, released
from tests.test_celery_solo import Monitor, label
from tests.workers import CeleryWorker, celery_test_app, staging

pytestmark = pytest.mark.slow

QUEUE = "it-prefork-carry"
STAGE = "it-prefork-carry-stage"


@pytest.fixture(scope="module")
def worker(redis_url: str) -> Iterator[CeleryWorker]:
    yield from CeleryWorker(redis_url, queue=QUEUE, concurrency=2,
                            env={"TASKDEDUP_TEST_HANDOVER": "1"}).running()


@pytest.fixture(scope="module")
def capp(redis_url: str, worker: CeleryWorker) -> Any:
    return celery_test_app(redis_url, worker.queue)


@pytest.fixture
def rc(redis_url: str) -> Iterator[redis.Redis]:
    yield from staging(redis_url, STAGE)


def staged(capp: Any, rc: redis.Redis, task: Any, *args: Any) -> tuple[str, str]:
    """Publish ``task(*args)`` to the staging queue: ``(task id, lock key)``."""
    result = task.apply_async(args, queue=STAGE)
    return result.id, capp.lock_key(task, *args)


def is_claim(line: str, claim_sha: str, task_id: str) -> bool:
    """Whether a MONITOR line is the claim of ``task_id``: its script, or the swap to
    ``running`` a server with SET IFEQ takes instead (not the completion, which swaps from
    it)."""
    if line.startswith(f"EVALSHA {claim_sha}"):
        return task_id in line
    return line.startswith("SET ") and f" R||{task_id} IFEQ " in line


def claims_and_record(lines: list[str], claim_sha: str, task_id: str
                      ) -> tuple[list[int], int, int]:
    """In MONITOR ``lines``: the indexes of ``task_id``'s claims, and of the ``HSET`` and
    the ``EXEC`` of kombu's record of its message."""
    claims = [i for i, line in enumerate(lines) if is_claim(line, claim_sha, task_id)]
    record = next(i for i, line in enumerate(lines)
                  if line.startswith("HSET unacked ") and task_id in line)
    return claims, record, lines.index("EXEC", record)


def running(rc: redis.Redis, key: str) -> bool:
    return (rc.get(key) or b"").startswith(b"R|")


def test_the_claim_rides_in_the_main_processs_record_and_the_pool_process_runs_the_body(
    capp: Any, rc: redis.Redis, redis_url: str,
) -> None:
    """Each claim is carried by the transaction of kombu's unacked record, which the main
    process sends anyway; the pool process that runs the body sends no claim of its own."""
    from taskdedup.celery import get_deduplicator

    claim_sha = get_deduplicator(capp.app).store._claim.sha
    names = [label() for _ in range(4)]
    calls = [staged(capp, rc, capp.record_until_executed, name) for name in names]
    with Monitor(redis.Redis.from_url(redis_url)) as monitor:
        rc.rename(STAGE, QUEUE)
        for name, (_, key) in zip(names, calls, strict=True):
            wait_for(lambda name=name: recorded(rc, name), timeout=30, what="the body ran")
            wait_for(lambda key=key: released(rc, key), timeout=30, what="the lock completed")
    lines = monitor.lines
    for name, (task_id, _) in zip(names, calls, strict=True):
        claims, record, end = claims_and_record(lines, claim_sha, task_id)
        around = lines[record - 3:end + 2]
        assert claims[0] == record + 1 and lines[record - 2] == "MULTI", around
        # and no claim of its own (Redis < 7 shows a transaction's script again after EXEC)
        assert claims[1:] in ([], [end + 1]), around
        assert recorded(rc, name) == ["0"]


def test_by_default_each_pool_process_claims_its_own_calls(
    capp: Any, rc: redis.Redis, redis_url: str,
) -> None:
    """Without ``taskdedup_prefork_handover`` the main process, a prefork worker's
    bottleneck, carries no claim: kombu's record is kombu's alone, and each call is claimed
    once, on its own, before its body runs."""
    from taskdedup.celery import get_deduplicator

    queue = f"{QUEUE}-default"
    claim_sha = get_deduplicator(capp.app).store._claim.sha
    names = [label() for _ in range(3)]
    calls = [staged(capp, rc, capp.record_until_executed, name) for name in names]
    plain = CeleryWorker(redis_url, queue=queue, concurrency=2).start()
    try:
        with Monitor(redis.Redis.from_url(redis_url)) as monitor:
            rc.rename(STAGE, queue)
            for name, (_, key) in zip(names, calls, strict=True):
                wait_for(lambda name=name: recorded(rc, name), timeout=30, what="the body ran")
                wait_for(lambda key=key: released(rc, key), timeout=30,
                         what="the lock completed")
    finally:
        plain.stop()
    lines = monitor.lines
    for name, (task_id, _) in zip(names, calls, strict=True):
        claims, record, end = claims_and_record(lines, claim_sha, task_id)
        assert claims and not any(record - 2 <= i <= end for i in claims), \
            lines[record - 3:end + 2]
        assert claims[0] > end and len(claims) == 1, [lines[i] for i in claims]
        assert recorded(rc, name) == ["0"]
    rc.delete(queue)


def test_a_claim_carried_for_a_message_that_never_becomes_a_request_is_given_back(
    capp: Any, rc: redis.Redis,
) -> None:
    """A message whose body does not decode never gets a request to take its claim: the
    claim its record carried is given back, not renewed for ever by the main process."""
    name = label()
    _, key = staged(capp, rc, capp.record_until_executed, name)
    message = json.loads(rc.lindex(STAGE, 0))
    message["body"] = base64.b64encode(b"{not json").decode()
    rc.lset(STAGE, 0, json.dumps(message))
    rc.rename(STAGE, QUEUE)
    wait_for(lambda: rc.get(key) is None or not running(rc, key), timeout=30,
             what="the lock no longer running")
    after = label()
    assert capp.record_until_executed.delay(after).get(timeout=30) == after
    assert recorded(rc, after) == ["0"]
    assert recorded(rc, name) == []


def test_a_handover_word_in_the_message_takes_nothing(capp: Any, rc: redis.Redis) -> None:
    """A message that brings the handover field itself (a forged or copied header) is
    claimed as any other: the lock another execution holds stays its own."""
    name = label()
    task_id, key = staged(capp, rc, capp.record_until_executed, name)
    message = json.loads(rc.lindex(STAGE, 0))
    message["headers"]["taskdedup_handover"] = [0, 1]
    rc.lset(STAGE, 0, json.dumps(message))
    rc.set(key, "R||other-holder", px=rc.pttl(key))
    rc.rename(STAGE, QUEUE)
    result = capp.app.AsyncResult(task_id).get(timeout=30)
    assert result["taskdedup"] == "skipped duplicate"
    assert recorded(rc, name) == []
    assert rc.get(key) == b"R||other-holder"


def test_a_stopping_worker_turns_back_the_claims_of_the_messages_it_did_not_start(
    capp: Any, rc: redis.Redis, redis_url: str,
) -> None:
    """One pool process, a prefetch of four: while the first body runs, the next messages
    wait in the main process, their claims carried (running). A warm stop turns the others' locks
    back to their own reservations as their messages go back, so the next worker runs each
    once at once, not a lease later, and a duplicate meanwhile is still one."""
    queue = f"{QUEUE}-stop"
    first = label()  # its pool process gets the stop's SIGTERM too (the process group's)
    staged(capp, rc, capp.slow_once_expiring, first, 3.0)
    names = [label() for _ in range(3)]
    calls = [staged(capp, rc, capp.record_until_executed, name) for name in names]
    stopping = CeleryWorker(redis_url, queue=queue, concurrency=1,
                            env={"TASKDEDUP_TEST_PREFETCH": "4",
                                 "TASKDEDUP_TEST_HANDOVER": "1"}).start()
    try:
        rc.rename(STAGE, queue)
        wait_for(lambda: recorded(rc, first), timeout=30, what="the first body started")
        wait_for(lambda: all(running(rc, key) for _, key in calls), timeout=10,
                 what="the waiting messages' claims carried")
        assert not any(recorded(rc, name) for name in names)
    finally:
        stopping.stop()
    # each back to its own reservation, as before its claim (SPEC §5)
    assert [rc.get(key) for _, key in calls] == [
        f"Q||{task_id}".encode() for task_id, _ in calls]
    assert not any(recorded(rc, name) for name in names)
    # back where they were published (the staging queue), moved to the next worker's
    wait_for(lambda: rc.llen(STAGE) == len(calls), timeout=10, what="the messages back")
    after = CeleryWorker(redis_url, queue=queue, concurrency=1).start()
    try:
        rc.rename(STAGE, queue)
        for name, (_, key) in zip(names, calls, strict=True):
            wait_for(lambda name=name: recorded(rc, name), timeout=20, what="ran after")
            wait_for(lambda key=key: released(rc, key), timeout=20, what="completed")
    finally:
        after.stop()
    assert [recorded(rc, name) for name in names] == [["0"]] * len(names)
    rc.delete(queue)
