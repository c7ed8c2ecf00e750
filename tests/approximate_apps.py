"""The Celery app and RQ job of the approximate-window worker tests
(``celery -A tests.approximate_apps worker``, ``rq worker`` with ``taskdedup.rq.DedupWorker``).

Bodies record one effect per run in Redis (``effects:<label>``, see :mod:`tests.effects`) on
the server named by ``TASKDEDUP_TEST_REDIS_URL``; that server is also the broker and the
lock store, so a gated publish reserves inside the broker's push (one script).
"""

from __future__ import annotations

import os

from celery import Celery

from taskdedup import Approximate, Policy
from taskdedup.celery import DedupTask
from tests.effects import effect
from tests.workers import CeleryWorker

URL = os.environ.get("TASKDEDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

WINDOW = Approximate(capacity=10_000, error_rate=0.01)
POLICY = Policy(mode="until_expired", ttl=300, lease=30, window=WINDOW)

app = Celery("approxtests", broker=URL)
app.conf.update(
    taskdedup_stats=False,
    task_default_queue=os.environ.get("TASKDEDUP_TEST_QUEUE", "approx"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    task_ignore_result=True,
)


@app.task(base=DedupTask, dedup=POLICY, name="tests.approximate.note")
def note(label: str) -> str:
    effect(label)
    return label


def note_job(label: str) -> str:
    """The RQ job: one effect per run."""
    effect(label)
    return label


class ApproxCeleryWorker(CeleryWorker):
    """:class:`tests.workers.CeleryWorker` running this module's app."""

    app_module = "tests.approximate_apps"


def configure(url: str, queue: str) -> None:
    """Point this module's app (in the test process) at the test's Redis."""
    os.environ["TASKDEDUP_TEST_REDIS_URL"] = url
    app.conf.update(broker_url=url, task_default_queue=queue)
    app.__dict__.pop("_taskdedup", None)
