"""The Celery app and the RQ job of the outbox's tests (``celery -A tests.outbox_apps worker``,
``taskdedup outbox relay -A tests.outbox_apps``).

Every body records its run in Redis (``RPUSH effects:<label>``, :mod:`tests.effects`) so the
test process counts executions across processes; ``slow`` holds its body at the gate
``go:<label>`` until the test opens it. Broker and lock store: ``TASKDEDUP_TEST_REDIS_URL``.
"""

from __future__ import annotations

import os

from celery import Celery

from taskdedup import Policy
from taskdedup.celery import DedupTask
from tests.effects import effect, wait_gate
from tests.workers import CeleryWorker

URL = os.environ.get("TASKDEDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POLICY = Policy(ttl=600, lease=3)

app = Celery("outboxtests", broker=URL)
app.conf.update(
    taskdedup_url=URL,
    taskdedup_stats=False,
    task_default_queue=os.environ.get("TASKDEDUP_TEST_QUEUE", "outbox"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    task_ignore_result=True,
)


@app.task(base=DedupTask, dedup=POLICY, name="outbox.record")
def record(label: str, value: int = 1) -> None:
    effect(label, value)


@app.task(base=DedupTask, dedup=POLICY, name="outbox.slow")
def slow(label: str) -> None:
    effect(label, "start")
    wait_gate(label)
    effect(label, "end")


@app.task(name="outbox.plain")
def plain(label: str) -> None:
    effect(label)


def rq_record(label: str, value: int = 1) -> None:
    """The RQ job: the same record as the Celery task's."""
    effect(label, value)


class OutboxCeleryWorker(CeleryWorker):
    """:class:`tests.workers.CeleryWorker` running this module's app."""

    app_module = "tests.outbox_apps"


def configure(url: str, queue: str) -> None:
    """Point this module's app (in the test process) at the test's Redis and a queue."""
    global URL
    os.environ["TASKDEDUP_TEST_REDIS_URL"] = url
    URL = url
    app.conf.update(broker_url=url, taskdedup_url=url, task_default_queue=queue)
    for name in [n for n in app.__dict__ if n.startswith("_taskdedup")]:
        app.__dict__.pop(name, None)
    app._pool = None
    app.amqp._producer_pool = None
