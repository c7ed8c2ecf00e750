"""The Celery app of the durable tier's worker tests (``celery -A tests.sql_apps worker``).

Its task runs :func:`tests.sql_jobs.ledger_charge` (see there for what a body records). The
broker and lock store are ``TASKDEDUP_TEST_REDIS_URL``; ``TASKDEDUP_TEST_VISIBILITY`` sets the
broker's visibility timeout (how soon a killed worker's unacknowledged messages come back).
``TASKDEDUP_TEST_RELIABLE_FETCH=1`` turns on taskdedup's reliable fetch (SPEC §17; lease
``TASKDEDUP_TEST_FETCH_LEASE``, 10 s): a worker SIGKILLed between kombu's BRPOP and its unacked
write would otherwise lose the message.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from taskdedup.celery import DedupTask
from tests.sql_jobs import POLICY, ledger_charge
from tests.workers import CeleryWorker

URL = os.environ.get("TASKDEDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
VISIBILITY = float(os.environ.get("TASKDEDUP_TEST_VISIBILITY", "3600"))
RELIABLE_FETCH = os.environ.get("TASKDEDUP_TEST_RELIABLE_FETCH") == "1"

# -- Celery ----------------------------------------------------------------------------------

app = Celery("sqltests", broker=URL)
app.conf.update(
    taskdedup_url=URL,
    taskdedup_stats=False,
    task_default_queue=os.environ.get("TASKDEDUP_TEST_QUEUE", "sql"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    task_ignore_result=True,
    taskdedup_reliable_fetch=RELIABLE_FETCH,
    taskdedup_fetch_lease=float(os.environ.get("TASKDEDUP_TEST_FETCH_LEASE", "10")),
    broker_transport_options={
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # kombu holds this mutex while it restores; a worker SIGKILLed holding it blocks every
        # restore for its expiry (300 s by default): the tests kill workers, so keep it short
        "unacked_mutex_expire": 10,
    },
)


@app.task(base=DedupTask, dedup=POLICY, acks_late=True, reject_on_worker_lost=True)
def charge(order_id: str, cents: int, durable: bool = True) -> Any:
    """until_expired, lease 1.5 s, acks_late: a killed body's message comes back."""
    return ledger_charge(order_id, cents, durable)


class SqlCeleryWorker(CeleryWorker):
    """:class:`tests.workers.CeleryWorker` running this module's app."""

    app_module = "tests.sql_apps"


def configure(url: str, queue: str) -> None:
    """Point this module's app (in the test process) at the test's Redis."""
    os.environ["TASKDEDUP_TEST_REDIS_URL"] = url
    app.conf.update(broker_url=url, taskdedup_url=url, task_default_queue=queue)
    app.__dict__.pop("_taskdedup", None)
