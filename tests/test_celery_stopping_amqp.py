"""A stopping worker on a RabbitMQ broker acks a message whose gated body ran but was never
acked (taskdedup/celery/stopping.py): RabbitMQ puts every unacked message back when the
worker's connection closes, and by then the lock's tombstone may have lapsed. Needs Debian's
``rabbitmq-server`` (CI installs it: noxfile.py); skipped without it elsewhere."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection

from benchmarks.rabbitmq import RabbitMQ, find_rabbitmq
from tests.fetch_workers import FetchWorker, lose_an_ack_and_stop, ran

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rabbit() -> Iterator[RabbitMQ]:
    binary = find_rabbitmq()
    if binary is None:
        message = "RabbitMQ is not installed (apt-get install rabbitmq-server)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with RabbitMQ(binary) as node:
        yield node


@pytest.fixture
def aapp(redis_url: str, rabbit: RabbitMQ, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``tests.fetch_app`` publishing to RabbitMQ, its locks and results in the test Redis."""
    from tests import fetch_app

    monkeypatch.setenv("TASKDEDUP_URL", redis_url)
    fetch_app.configure(redis_url, "fetch")
    fetch_app.app.conf.broker_url = rabbit.url
    yield fetch_app
    fetch_app.configure(redis_url, "fetch")  # the Redis broker again, for the next module


def waiting(url: str, queue: str) -> int:
    """Messages ready in ``queue`` on RabbitMQ (what a stopping worker put back included)."""
    with Connection(url) as conn:
        return int(conn.default_channel.queue_declare(queue=queue, passive=True).message_count)


@pytest.mark.parametrize("by_name", [False, True])
def test_a_stopping_worker_on_rabbitmq_acks_a_message_that_ran_but_was_never_acked(
    aapp: Any, rc: redis.Redis, redis_url: str, rabbit: RabbitMQ, by_name: bool
) -> None:
    """As tests/test_celery_fetch_workers.py's test of the same name on Redis: Celery's closing
    prefork pool can drop a job a pool process already started (``tests.fetch_app.AckLost``
    makes it happen every time), the body runs and its message stays unacked; the worker stops
    only once its 6 s task ends, after the gated call's tombstone (its 3 s lease) lapsed.
    RabbitMQ puts the unacked message back as the connection closes, and it would run again.
    The stopping worker notes it while the tombstone says it ran and acks it on the main
    thread before the connection closes: nothing is put back, and the body runs once. A call
    sent by name (``send_task``: no lock key in its header) is told by its arguments' lock."""
    queue = f"acklost-{uuid.uuid4().hex[:8]}"
    env = {"TASKDEDUP_TEST_BROKER_URL": rabbit.url, "TASKDEDUP_URL": redis_url}
    workers = [FetchWorker(redis_url, queue=queue, fetch="kombu", pool="prefork",
                           concurrency=2, env=env).start()]
    try:
        label, slow = lose_an_ack_and_stop(aapp, rc, workers[0], queue, by_name)
        assert waiting(rabbit.url, queue) == 0, "what ran was put back"
        assert "gated body already ran" in workers[0].output()
        workers.append(FetchWorker(redis_url, queue=queue, fetch="kombu", pool="prefork",
                                   concurrency=2, env=env).start())
        after = f"after-{uuid.uuid4().hex[:8]}"  # behind anything put back
        assert aapp.work.apply_async((after,), queue=queue).get(timeout=30) == after
        assert ran(rc, label) == 1 and ran(rc, slow) == 1
    finally:
        for worker in workers:
            worker.stop()
