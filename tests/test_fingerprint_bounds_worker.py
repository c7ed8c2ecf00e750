"""A real Celery worker given a hostile message by name (SPEC §8): it computes the identity
itself (no taskdedup header) and must end the task in a final state within seconds."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu.serialization import dumps

from taskdedup.testing import wait_for
from tests.bounds_celery_app import BoundsCeleryWorker
from tests.test_fingerprint_bounds import shared_tower

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker(redis_url: str) -> Iterator[BoundsCeleryWorker]:
    queue = f"bounds-{uuid.uuid4().hex[:6]}"
    w = BoundsCeleryWorker(
        redis_url, queue=queue, concurrency=1, env={"TASKDEDUP_TEST_MEMORY_CAP": str(3 * 2**30)}
    ).start()
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="module")
def bapp(redis_url: str, worker: BoundsCeleryWorker) -> Any:
    from tests import bounds_celery_app

    bounds_celery_app.configure(redis_url, worker.queue)
    return bounds_celery_app


def test_a_yaml_anchor_bomb_sent_by_name_ends_within_seconds(
    bapp: Any, worker: BoundsCeleryWorker, rc: redis.Redis
) -> None:
    bomb = (shared_tower(12),)  # 9**13 leaves once expanded
    _, _, body = dumps((bomb, {}, {}), serializer="yaml")
    assert len(body) < 4096  # the anchors keep the message small
    result = bapp.app.send_task("tests.bounds.take", args=bomb, serializer="yaml")
    wait_for(lambda: result.state in ("SUCCESS", "FAILURE"), timeout=20,
             what="the hostile task's final state")
    assert result.state == "FAILURE"
    assert isinstance(result.result, TypeError)
    assert "MAX_SHARED_BYTES" in str(result.result)
    assert "cannot fingerprint" in str(result.result)
    # the worker is still there, and an honest call by name still runs
    honest = bapp.app.send_task("tests.bounds.take", args=([1, 2, 3],), serializer="yaml")
    assert honest.get(timeout=20) == "ran"
    assert worker.process is not None and worker.process.poll() is None
