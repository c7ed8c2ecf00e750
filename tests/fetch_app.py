"""The Celery app of the reliable-fetch tests (SPEC §17), imported by the test process and by
the worker subprocesses (``celery -A tests.fetch_app worker``).

``TASKDEDUP_TEST_FETCH`` chooses the fetch: ``reliable`` (the default: ``taskdedup_reliable_fetch
= True``) or ``kombu`` (kombu's own ``BRPOP``). Every body records the process that ran it in
``fetch:ran:<label>``, so a test counts executions across workers that die.

``TASKDEDUP_TEST_PAUSE_AFTER_FETCH=<seconds>`` aims a kill at the moment after the pop: the
worker's consumer pauses right after a message left its queue, before the QoS records it
(kombu's ``QoS.append``, the second round trip of kombu's fetch; the reliable fetch's message is
in its processing list by then), after writing ``<pid> <task id>`` to ``fetch:popped``. A test
waits for that line, then SIGKILLs the worker. Test instrumentation, not a seam of taskdedup.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery
from celery.exceptions import Reject
from celery.worker import state as worker_state
from celery.worker.request import Request
from kombu.transport import redis as kombu_redis

from taskdedup import Policy
from taskdedup.celery import DedupTask
from taskdedup.celery.fetch import ReliableQoS
from tests.effects import r

URL = os.environ.get("TASKDEDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
FETCH = os.environ.get("TASKDEDUP_TEST_FETCH", "reliable")
VISIBILITY = float(os.environ.get("TASKDEDUP_TEST_VISIBILITY", "3600"))
LEASE = float(os.environ.get("TASKDEDUP_TEST_FETCH_LEASE", "3"))

# TASKDEDUP_TEST_BROKER_URL: a worker's broker of its own (rediss://, sentinel://), the results
# and the bodies' records staying on TASKDEDUP_TEST_REDIS_URL
BROKER = os.environ.get("TASKDEDUP_TEST_BROKER_URL") or URL
app = Celery("fetch", broker=BROKER, backend=URL)
app.conf.update(
    task_default_queue=os.environ.get("TASKDEDUP_TEST_QUEUE", "fetch"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    result_expires=600,
    taskdedup_stats=False,
    taskdedup_reliable_fetch=FETCH == "reliable",
    taskdedup_fetch_lease=LEASE,
    worker_send_task_events=True,
    broker_transport_options={
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # kombu holds this mutex while it restores; a worker SIGKILLed holding it blocks every
        # restore for its expiry (300 s by default), in this test and the ones after it on the
        # same Redis: the tests kill workers on kombu's fetch, so keep it short
        "unacked_mutex_expire": 10,
        **({"master_name": os.environ["TASKDEDUP_TEST_MASTER_NAME"]}
           if os.environ.get("TASKDEDUP_TEST_MASTER_NAME") else {}),
    },
)


def configure(url: str, queue: str) -> None:
    """Point the app (in the test process) at the test server and a queue."""
    global URL
    os.environ["TASKDEDUP_TEST_REDIS_URL"] = url
    URL = url
    app.conf.update(broker_url=url, result_backend=url, task_default_queue=queue)
    for name in [n for n in app.__dict__ if n.startswith("_taskdedup")]:
        app.__dict__.pop(name, None)
    app._pool = None
    app.amqp._producer_pool = None
    app._local.__dict__.pop("backend", None)


def first_run(label: str) -> bool:
    """Record this run (its process in ``fetch:ran:<label>``) and count it, in one ``MULTI``:
    whether it is the first. A test that sees the record and kills the process then knows
    the count went with it (apart, a kill between the two made the next run a first one,
    which waited out the test)."""
    with r().pipeline(transaction=True) as pipe:
        pipe.rpush(f"fetch:ran:{label}", os.getpid())
        pipe.incr(f"fetch:attempts:{label}")
        return int(pipe.execute()[1]) == 1


def ran(label: str) -> list[str]:
    """The processes that ran ``label``'s body, in order."""
    return [x.decode() for x in r().lrange(f"fetch:ran:{label}", 0, -1)]


def started(task: Any, label: str) -> None:
    """Record this run: its process in ``fetch:ran:<label>``, and the worker's node name and
    the time in ``fetch:started:<label>`` (what a warm-shutdown test tells a copy by)."""
    with r().pipeline(transaction=False) as pipe:
        pipe.rpush(f"fetch:ran:{label}", os.getpid())
        pipe.rpush(f"fetch:started:{label}", f"{task.request.hostname} {time.time():.6f}")
        pipe.execute()


def starts(label: str) -> list[tuple[str, float]]:
    """Where (the worker's node name) and when each run of ``label`` started, in order."""
    return [(node, float(at)) for node, at in (
        x.decode().rsplit(" ", 1) for x in r().lrange(f"fetch:started:{label}", 0, -1))]


@app.task(bind=True)
def work(self: Any, label: str, seconds: float = 0.0) -> str:
    started(self, label)
    if seconds:
        time.sleep(seconds)
    return label


@app.task(bind=True)
def requeue_once(self: Any, label: str) -> str:
    """Rejected with requeue on its first delivery, runs on the next."""
    if r().incr(f"fetch:attempts:{label}") == 1:
        raise Reject("not yet", requeue=True)
    r().rpush(f"fetch:ran:{label}", os.getpid())
    return label


@app.task(bind=True, max_retries=3)
def retry_once(self: Any, label: str) -> str:
    """Asks for a retry (a new message, the old one acked) on its first run."""
    if first_run(label):
        raise self.retry(countdown=0.5)
    return label


@app.task
def lost_once(label: str) -> str:
    """Waits to be SIGKILLed on its first run (its pool process: reject_on_worker_lost)."""
    if first_run(label):
        time.sleep(60)
    return label


@app.task
def in_order(label: str, run: str) -> str:
    """Records the order the bodies of one ``run`` ran in (``fetch:order:<run>``) and the run
    itself in one ``MULTI``: a test that waits for the order list then reads both complete."""
    with r().pipeline(transaction=True) as pipe:
        pipe.rpush(f"fetch:order:{run}", label)
        pipe.rpush(f"fetch:ran:{label}", os.getpid())
        pipe.execute()
    return label


@app.task(acks_on_failure_or_timeout=False)
def fails(label: str) -> None:
    """Fails: its message is rejected without requeue, never acked."""
    r().rpush(f"fetch:ran:{label}", os.getpid())
    raise RuntimeError(label)


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60, lease=20), bind=True)
def gated(self: Any, label: str, seconds: float = 0.0) -> str:
    started(self, label)
    if seconds:
        time.sleep(seconds)
    return label


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=120, lease=20))
def gated_lost_once(label: str) -> str:
    """A gated ``lost_once``: waits to be SIGKILLed on its first run (its pool process:
    ``reject_on_worker_lost`` requeues the message, its lock still running by its id)."""
    if first_run(label):
        time.sleep(60)
    return label


class AckLost(Request):  # type: ignore[misc]
    """A request whose outcome the main process never takes, as Celery's closing prefork
    pool leaves a job it wrote to a pool process before it read that the process started it
    (``AsynPool.flush``): the body runs, and the message stays held and unacked, the request
    in Celery's ``state.requests``."""

    def acknowledge(self) -> None:
        # a discarded job's callbacks never run: Celery's task_ready (which ran just before
        # this) is undone, and no ack goes out
        worker_state.requests[self.id] = self
        r().rpush("fetch:ack-lost", self.id)


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60, lease=3), bind=True,
          Request=AckLost)
def gated_ack_lost(self: Any, label: str) -> str:
    """A gated body whose message is never acked (:class:`AckLost`), its lock's finished
    tombstone living its 3 s lease."""
    started(self, label)
    return label


def _pause_after_fetch(seconds: float) -> None:
    """Pause every consumer right after the pop, before the QoS records the message."""

    def paused(append: Any) -> Any:
        def append_after_a_pause(self: Any, message: Any, delivery_tag: str) -> Any:
            if not getattr(self, "_paused_once", None) == delivery_tag:
                self._paused_once = delivery_tag
                task_id = (message.headers or {}).get("id", "?")
                r().rpush("fetch:popped", f"{os.getpid()} {task_id}")
                time.sleep(seconds)
            return append(self, message, delivery_tag)

        return append_after_a_pause

    kombu_redis.QoS.append = paused(kombu_redis.QoS.append)
    ReliableQoS.append = paused(ReliableQoS.append)


if os.environ.get("TASKDEDUP_TEST_PAUSE_AFTER_FETCH"):
    _pause_after_fetch(float(os.environ["TASKDEDUP_TEST_PAUSE_AFTER_FETCH"]))
