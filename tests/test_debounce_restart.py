"""Debounce across a warm restart of a real Celery prefork worker (SPEC §15, issue #22 part
3): no revoke is sent, so the worker that comes back — with nothing in memory — gets the
burst's held countdown messages back from the broker and must tell the superseded ones by
their generation alone."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from taskdedup.flow import superseded_of
from taskdedup.testing import wait_for
from tests.effects import recorded
from tests.workers import CeleryWorker

pytestmark = pytest.mark.slow

QUEUE = "it-debounce-restart"


class FlowWorker(CeleryWorker):
    app_module = "tests.flow_app"


@pytest.fixture(scope="module")
def capp(redis_url: str) -> Any:
    from tests import flow_app

    flow_app.configure(redis_url, QUEUE)
    return flow_app


def label() -> str:
    return uuid.uuid4().hex[:12]


def test_a_warm_restarted_worker_resurrects_no_superseded_call(
    capp: Any, rc: redis.Redis, redis_url: str
) -> None:
    """A worker of its own holds a burst's countdown messages (unacked); it is stopped (warm
    shutdown: kombu restores them) and started again, with nothing in memory: the restored
    messages are recognised by generation alone; only the last call runs, once."""
    name = label()
    queue = QUEUE
    own = FlowWorker(redis_url, queue=queue, concurrency=2).start()
    try:
        handles = [capp.debounced.apply_async((name, n), queue=queue) for n in range(4)]
        wait_for(lambda: own.output()[own.log_start:].count("] received") >= 4,
                 timeout=20, interval=0.1, what="the worker holds the four messages")
        own.stop()
        assert recorded(rc, name) == []  # stopped before any was due
        own.start()
        assert handles[-1].get(timeout=30) == 3
        for handle in handles[:-1]:
            assert superseded_of(handle.get(timeout=30)) is not None
        # every message dealt with (the queue empty, nothing unacked): none ran but the last
        wait_for(lambda: rc.llen(queue) == 0 and rc.hlen("unacked") == 0, timeout=20,
                 interval=0.1, what="the worker settles")
        assert recorded(rc, name) == ["start3", "end3"]
    finally:
        own.kill()
