"""A Celery app that accepts YAML, for the hostile-input worker tests
(``celery -A tests.bounds_celery_app worker``, see :class:`BoundsCeleryWorker`).

The broker and result backend are ``TASKDEDUP_TEST_REDIS_URL``. With
``TASKDEDUP_TEST_MEMORY_CAP`` (bytes) the worker caps its own address space (its pool
processes inherit the cap), so a regression that expands a message fails the test instead of
exhausting the machine.
"""

from __future__ import annotations

import os
import resource

from celery import Celery

from taskdedup import Policy
from taskdedup.celery import DedupTask
from tests.workers import CeleryWorker

URL = os.environ.get("TASKDEDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

_cap = int(os.environ.get("TASKDEDUP_TEST_MEMORY_CAP", "0"))
if _cap:
    resource.setrlimit(resource.RLIMIT_AS, (_cap, _cap))

app = Celery("bounds", broker=URL, backend=URL)
app.conf.update(
    taskdedup_url=URL,
    task_default_queue=os.environ.get("TASKDEDUP_TEST_QUEUE", "bounds"),
    accept_content=["json", "yaml"],
    result_accept_content=["json"],
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    result_expires=600,
)


@app.task(base=DedupTask, name="tests.bounds.take", dedup=Policy(ttl=60))
def take(value: object) -> str:
    """Takes any value; only its identity matters."""
    return "ran"


class BoundsCeleryWorker(CeleryWorker):
    """:class:`tests.workers.CeleryWorker` running this app."""

    app_module = "tests.bounds_celery_app"


def configure(url: str, queue: str) -> None:
    """Point this module's app (in the test process) at the test server and queue."""
    global URL
    os.environ["TASKDEDUP_TEST_REDIS_URL"] = url
    URL = url
    app.conf.update(broker_url=url, result_backend=url, taskdedup_url=url,
                    task_default_queue=queue)
    app.__dict__.pop("_taskdedup", None)
