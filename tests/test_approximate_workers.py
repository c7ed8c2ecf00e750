"""Approximate windows (SPEC §12) through real workers.

Celery: the gated publish reserves inside the broker's push (``enqueue.lua``), filters
included; RQ: the fused enqueue does the same, and the worker reads the window from
``job.meta``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from taskdedup import Deduplicator, DuplicateTaskError, IdempotencyKeyMismatch, RedisStore
from taskdedup.core import Verdict
from taskdedup.rq import DedupQueue
from taskdedup.testing import wait_for
from tests import approximate_apps
from tests.counting import CommandCounter
from tests.workers import RqWorker


def effects(client: redis.Redis, label: str) -> int:
    return int(client.llen(f"effects:{label}"))


@pytest.fixture
def celery_worker(redis_url: str, rc: redis.Redis) -> Iterator[str]:
    queue = f"approx-{uuid.uuid4().hex[:8]}"
    approximate_apps.configure(redis_url, queue)
    worker = approximate_apps.ApproxCeleryWorker(redis_url, queue=queue, concurrency=1)
    worker.start()
    try:
        yield queue
    finally:
        worker.stop()


def test_celery_fused_publish_with_an_approximate_window_through_a_real_worker(
    celery_worker: str, rc: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    note = approximate_apps.note
    label = f"celery-{uuid.uuid4().hex[:8]}"
    note.delay("warm-" + label)  # producers connected, script loaded
    counter = CommandCounter(monkeypatch)
    first = note.delay(label)
    assert first is not None
    assert counter.commands == ["EVALSHA"]  # filters, lock and push: one script
    # queued or running: the exact lock answers with the original's handle; a worker fast
    # enough to have finished it already handed it to the window, which knows no id (None)
    again = note.delay(label)
    assert again is None or again.id == first.id
    wait_for(lambda: effects(rc, label) == 1, timeout=60, what="the body ran")
    # until the worker completes, the exact lock answers with the original's handle
    wait_for(lambda: note.delay(label) is None, timeout=30, what="the lock handed to the filter")
    counter.commands.clear()
    assert note.delay(label) is None  # remembered by the window: no id to hand back
    assert counter.commands == ["EVALSHA"]
    with pytest.raises(DuplicateTaskError) as caught:
        note.apply_async((label,), dedup={"on_duplicate": "raise"})
    assert caught.value.existing_id is None
    assert rc.llen(celery_worker) == 0  # the duplicates pushed nothing
    assert effects(rc, label) == 1


def test_celery_a_dedup_key_reused_with_other_arguments_after_success_raises(
    celery_worker: str, rc: redis.Redis
) -> None:
    """SPEC §3 on the approximate tier: once the worker's success is in the filter, the same
    idempotency key with other arguments raises IdempotencyKeyMismatch at the publish (not a
    silent None); with the same arguments it is a duplicate."""
    note = approximate_apps.note
    label = f"keyed-{uuid.uuid4().hex[:8]}"
    key = f"ORD-{uuid.uuid4().hex[:8]}"
    assert note.apply_async((label,), dedup_key=key) is not None
    wait_for(lambda: effects(rc, label) == 1, timeout=60, what="the body ran")
    wait_for(lambda: note.apply_async((label,), dedup_key=key) is None, timeout=30,
             what="the lock handed to the filter")
    with pytest.raises(IdempotencyKeyMismatch) as caught:
        note.apply_async((label + "-other",), dedup_key=key)
    assert caught.value.existing_id is None
    assert rc.llen(celery_worker) == 0  # nothing pushed
    assert effects(rc, label + "-other") == 0


def test_rq_enqueue_with_an_approximate_window_through_a_real_worker(
    redis_url: str, rc: redis.Redis
) -> None:
    queue_name = f"approx-rq-{uuid.uuid4().hex[:8]}"
    q = DedupQueue(queue_name, connection=rc, dedup=approximate_apps.POLICY)
    label = f"rq-{uuid.uuid4().hex[:8]}"
    job = q.enqueue(approximate_apps.note_job, label)
    assert job is not None
    assert job.meta["taskdedup"]["window"] == [10_000, 0.01, 4, 16]
    assert q.enqueue(approximate_apps.note_job, label).id == job.id
    # A second job whose reservation expired in the backlog (its lock is gone) while the same
    # identity succeeded elsewhere: the worker's claim finds it in the filter and skips it.
    late_label = label + "-late"
    late = q.enqueue(approximate_apps.note_job, late_label)
    assert late is not None
    late_key = late.meta["taskdedup"]["key"]
    rc.delete(late_key)
    dedup = Deduplicator(RedisStore(rc))
    policy = approximate_apps.POLICY
    assert dedup.start("elsewhere", policy, late_key, "other").verdict is Verdict.ACCEPTED
    dedup.finish("elsewhere", policy, late_key, "other", success=True)
    worker = RqWorker(redis_url, [queue_name], scheduler=False).start()
    try:
        wait_for(lambda: late.get_status(refresh=True) == "finished", timeout=60,
                 what="the late job ended")
        late.refresh()
        assert late.meta["taskdedup"]["skipped"] == {"existing_id": None, "state": "done"}
        assert effects(rc, late_label) == 0
        wait_for(lambda: effects(rc, label) == 1, timeout=60, what="the job ran")
        key = job.meta["taskdedup"]["key"]
        wait_for(lambda: not rc.exists(key), timeout=30, what="the lock handed to the filter")
        assert q.enqueue(approximate_apps.note_job, label) is None  # remembered: no job
        assert q.count == 0
        assert effects(rc, label) == 1
    finally:
        worker.stop()
        q.empty()
