"""The Celery app of the fault tests, imported by the test process and by the worker
subprocess (``celery -A tests.fault_celery_app worker``, see :class:`FaultCeleryWorker`).

Bodies record ``start:<task id>:<pid>`` and ``end:<task id>`` in ``fx:<label>`` on the test
Redis (see :mod:`tests.fault_jobs`). The broker is ``TASKDEDUP_TEST_REDIS_URL`` (no result
backend: tests read ``state:<task id>``); the lock store is ``TASKDEDUP_TEST_LOCK_URL`` when
set (a separate server the test can kill or reach through a proxy), else the same Redis.
``TASKDEDUP_TEST_VISIBILITY`` sets the broker's visibility timeout (how soon a killed
worker's unacknowledged messages are redelivered).
"""

from __future__ import annotations

import os

import redis
from celery import Celery, signals

from taskdedup import Policy
from taskdedup.celery import DedupTask, skipped_info
from tests.fault_jobs import r, wait_gate
from tests.workers import CeleryWorker

URL = os.environ.get("TASKDEDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
VISIBILITY = float(os.environ.get("TASKDEDUP_TEST_VISIBILITY", "3600"))
LEASE = 1.5

app = Celery("faults", broker=URL)
app.conf.update(
    taskdedup_url=os.environ.get("TASKDEDUP_TEST_LOCK_URL", URL),
    taskdedup_stats=False,
    task_default_queue=os.environ.get("TASKDEDUP_TEST_QUEUE", "faults"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    task_ignore_result=True,
    broker_transport_options={
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # kombu holds this mutex while it restores; a worker SIGKILLed holding it blocks every
        # restore for its expiry (300 s by default): the tests kill workers, so keep it short
        "unacked_mutex_expire": 10,
    },
)


def _body(task_id: str, label: str, gated: bool) -> str:
    r().rpush(f"fx:{label}", f"start:{task_id}:{os.getpid()}")
    if gated:
        wait_gate(label)
    r().rpush(f"fx:{label}", f"end:{task_id}")
    return label


@app.task(
    base=DedupTask, bind=True, dedup=Policy(ttl=60, lease=LEASE),
    acks_late=True, reject_on_worker_lost=True,
)
def work(self: DedupTask, label: str, gated: bool = False) -> str:
    """until_expired, lease 1.5 s, acks_late: a killed body is redelivered with its id."""
    return _body(self.request.id, label, gated)


@app.task(base=DedupTask, bind=True, dedup=Policy(ttl=60, lease=LEASE, on_store_error="allow"))
def work_allow(self: DedupTask, label: str, gated: bool = False) -> str:
    """As ``work``, failing open when the lock store is down (on_store_error='allow')."""
    return _body(self.request.id, label, gated)


@signals.task_postrun.connect
def _record_state(
    sender: object = None, task_id: str | None = None, state: str | None = None,
    retval: object = None, **_: object
) -> None:
    """The final state of every execution of this app, SKIPPED (a duplicate that
    ended as skipped, :func:`taskdedup.celery.skipped_info`) included."""
    if task_id and state and getattr(sender, "app", None) is app:
        state = "SKIPPED" if skipped_info(retval) else state
        r().set(f"state:{task_id}", state, ex=600)


class FaultCeleryWorker(CeleryWorker):
    """:class:`tests.workers.CeleryWorker` running this app instead of ``tests.celery_app``."""

    app_module = "tests.fault_celery_app"

    def child_pids(self) -> list[int]:
        """The pool processes (children of the main process)."""
        assert self.process is not None
        path = f"/proc/{self.process.pid}/task/{self.process.pid}/children"
        try:
            with open(path) as handle:
                return [int(pid) for pid in handle.read().split()]
        except OSError:
            return []


def configure(url: str, lock_url: str | None = None, queue: str = "faults") -> None:
    """Point this module's app (in the test process) at the test servers."""
    global URL
    os.environ["TASKDEDUP_TEST_REDIS_URL"] = url
    URL = url
    app.conf.update(
        broker_url=url, taskdedup_url=lock_url or url,
        task_default_queue=queue,
    )
    app.__dict__.pop("_taskdedup", None)


def client() -> redis.Redis:
    return r()
