"""The Celery app used by the integration tests, imported by the test process and by the
worker subprocess (``celery -A tests.celery_app worker``).

Every task body records its side effect in Redis (``RPUSH effects:<label>``) so the test
process can count executions across processes. Gates (``go:<label>``) let a test hold a body
until it decides.
"""

from __future__ import annotations

import os
import time

from celery import Celery, signals
from celery.exceptions import Ignore, Reject

from taskdedup import Policy, running
from taskdedup.celery import DedupTask, skipped_info
from tests.effects import effect, r, wait_gate

URL = os.environ.get("TASKDEDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
VISIBILITY = float(os.environ.get("TASKDEDUP_TEST_VISIBILITY", "3600"))

app = Celery("tests", broker=URL, backend=URL)
app.conf.update(
    taskdedup_url=os.environ.get("TASKDEDUP_TEST_LOCK_URL", URL),
    task_default_queue=os.environ.get("TASKDEDUP_TEST_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=int(os.environ.get("TASKDEDUP_TEST_PREFETCH") or 1),
    worker_hijack_root_logger=False,
    result_expires=600,
    broker_transport=os.environ.get("TASKDEDUP_TEST_TRANSPORT") or None,
    taskdedup_prefork_handover=os.environ.get("TASKDEDUP_TEST_HANDOVER") == "1",
    broker_transport_options={
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # kombu holds this mutex while it restores; a worker SIGKILLed holding it blocks every
        # restore for its expiry (300 s by default): the tests kill workers, so keep it short
        "unacked_mutex_expire": 10,
    },
)
if os.environ.get("TASKDEDUP_TEST_HOLD_FOR"):  # test instrumentation: a held completion waits
    from taskdedup.stores import trail

    trail.HOLD_FOR = float(os.environ["TASKDEDUP_TEST_HOLD_FOR"])
if os.environ.get("TASKDEDUP_TEST_SLOW_BUILD"):  # test instrumentation, not a seam of taskdedup
    import taskdedup.celery.config
    from taskdedup.core import Deduplicator

    class _SlowToBuild(Deduplicator):
        """Built in ``TASKDEDUP_TEST_SLOW_BUILD`` seconds more: threads that ask for the app's
        deduplicator at once all find none built yet (``tests/test_celery_solo.py``)."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            time.sleep(float(os.environ["TASKDEDUP_TEST_SLOW_BUILD"]))
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    taskdedup.celery.config.Deduplicator = _SlowToBuild  # type: ignore[misc]


def configure(url: str, queue: str) -> None:
    """Point this module's app (in the test process) at the test server and a worker's queue:
    broker, result backend and locks on ``url``; a deduplicator made anew."""
    global URL
    os.environ["TASKDEDUP_TEST_REDIS_URL"] = url
    URL = url
    app.conf.update(broker_url=url, result_backend=url, taskdedup_url=url,
                    task_default_queue=queue)
    # What the app built on the server it had (a module may point it at a server of its own,
    # e.g. tests/test_acl.py): taskdedup's deduplicator, producer pool and cached choices,
    # Celery's producer pool and this thread's result backend.
    for name in [n for n in app.__dict__ if n.startswith("_taskdedup")]:
        app.__dict__.pop(name, None)
    app._pool = None  # not closed: kombu's registry may hand the same pool out again
    app.amqp._producer_pool = None
    app._local.__dict__.pop("backend", None)


def lock_key(task: DedupTask, *args: object) -> str:
    """The lock key the caller makes for ``task(*args)`` (what the message carries)."""
    from taskdedup.celery import get_deduplicator

    return get_deduplicator(app).identity(
        task.name, task._dedup_policy, args, {}, func=task._func()).key


@app.task(base=DedupTask, dedup=Policy(ttl=60))
def record(label: str, n: int = 0) -> str:
    effect(label, n)
    return f"{label}:{n}"


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60))
def record_until_executed(label: str, n: int = 0) -> str:
    effect(label, n)
    return label


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60), ignore_result=True)
def record_unseen(label: str) -> None:
    """No result stored, no callbacks: nobody sees its outcome, so its completion's reply
    is read later (and, on a solo worker, the completion may ride the next record)."""
    effect(label)


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60), ignore_result=True,
          acks_late=True)
def record_unseen_late(label: str) -> None:
    """:func:`record_unseen`, acked after its body."""
    effect(label)


@app.task(base=DedupTask, dedup=Policy(mode="until_expired", ttl=2))
def record_short_window(label: str) -> str:
    effect(label)
    return label


@app.task(base=DedupTask, dedup=Policy(mode="until_executing", ttl=60))
def record_until_executing(label: str) -> str:
    effect(label, "start")
    wait_gate(label)
    effect(label, "end")
    return label


@app.task(base=DedupTask, dedup=Policy(mode="while_executing", lease=30))
def record_while_executing(label: str, n: int = 0) -> str:
    effect(label, f"start{n}")
    wait_gate(label)
    effect(label, f"end{n}")
    return label


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60))
def gated(label: str) -> str:
    """Runs until the test opens the gate."""
    effect(label, "start")
    wait_gate(label)
    effect(label, "end")
    return label


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60))
def fail_first(label: str) -> str:
    """Fails on its first execution (no retries): a final failure."""
    attempt = r().incr(f"attempts:{label}")
    effect(label, attempt)
    if attempt == 1:
        raise RuntimeError("first attempt fails")
    return label


def _retry_once(task: DedupTask, label: str, countdown: float) -> str:
    attempt = r().incr(f"attempts:{label}")
    effect(label, attempt)
    if attempt == 1:
        raise task.retry(countdown=countdown)
    return label


@app.task(base=DedupTask, bind=True, dedup=Policy(mode="until_executed", ttl=60), max_retries=3)
def retry_once(self: DedupTask, label: str, countdown: float = 1.0) -> str:
    """Asks for a retry on the first attempt; the retry must run."""
    return _retry_once(self, label, countdown)


@app.task(base=DedupTask, bind=True, dedup=Policy(mode="until_executed", ttl=60), max_retries=3)
def retry_once_counted(self: DedupTask, label: str, countdown: float = 1.0) -> str:
    """:func:`retry_once` under a name of its own: a test reading this task's stats counters
    sees no counts that another test's calls flush late (a worker flushes every ~5 s)."""
    return _retry_once(self, label, countdown)


@app.task(base=DedupTask, bind=True, dedup=Policy(mode="while_executing"), max_retries=3)
def while_retry_once(self: DedupTask, label: str) -> str:
    """while_executing: the lock is held only while a body runs, not during a retry's wait."""
    attempt = r().incr(f"attempts:{label}")
    effect(label, attempt)
    if attempt == 1:
        wait_gate(label)
        raise self.retry(countdown=1)
    return label


@app.task(
    base=DedupTask, dedup=Policy(mode="until_executed", ttl=60),
    autoretry_for=(KeyError,), retry_kwargs={"max_retries": 2, "countdown": 0.2},
)
def autoretry_always(label: str) -> str:
    """Always fails with KeyError: two autoretries, then a final failure."""
    effect(label, r().incr(f"attempts:{label}"))
    raise KeyError(label)


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60))
def ignore_me(label: str) -> None:
    effect(label)
    raise Ignore()


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60), acks_late=True)
def reject_me(label: str) -> None:
    effect(label)
    raise Reject("no thanks", requeue=False)


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60, lease=3), time_limit=1)
def too_slow(label: str) -> None:
    effect(label, "start")
    time.sleep(30)


class HoldsItsCopy(DedupTask):
    """Test scaffolding: a copy of a running message that is put off (``_defer``, SPEC §5)
    records ``copy:<pid>`` and waits at the gate ``<label>:copy`` first, so a test can kill
    the pool process that holds only that copy."""

    def _defer(self, policy: Policy, delay: float | None = None,
               headers: object = None) -> Ignore:
        label = str(self.request.args[0])
        effect(label, f"copy:{os.getpid()}")
        wait_gate(f"{label}:copy", timeout=60)
        return super()._defer(policy, delay, headers)  # type: ignore[arg-type]


@app.task(base=HoldsItsCopy, dedup=Policy(mode="until_executed", ttl=60, lease=30),
          acks_late=True)
def held_with_copy(label: str) -> str:
    """Holds its lock until the test opens ``go:<label>``; a copy of its message waits in
    :class:`HoldsItsCopy`. No ``reject_on_worker_lost``: a killed process is a FAILURE."""
    effect(label, f"start:{os.getpid()}")
    wait_gate(label, timeout=120)
    effect(label, "end")
    return label


@app.task(
    base=DedupTask, dedup=Policy(mode="until_executed", ttl=60, lease=1.5),
    acks_late=True, reject_on_worker_lost=True,
)
def long_running(label: str) -> str:
    """Runs past its lease (heartbeat keeps it) until the test opens the gate."""
    effect(label, f"start:{os.getpid()}")
    wait_gate(label, timeout=120)
    effect(label, "end")
    return label


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60, lease=30), time_limit=1)
def too_slow_long_lease(label: str) -> None:
    """Killed by the hard time limit long before its lease would free the lock."""
    effect(label, "start")
    time.sleep(30)


class FlakyReporterTask(DedupTask):
    """``on_failure`` reports to an error tracker that is unreachable on the first report of
    each task: Celery's internal-error path (the hook's error is reported as the failure,
    after the request was popped)."""

    def on_failure(self, exc: Exception, task_id: str, args: object, kwargs: object,
                   einfo: object) -> None:
        if r().incr(f"reported:{task_id}") == 1:
            raise ConnectionError("error tracker unreachable")


@app.task(base=FlakyReporterTask, dedup=Policy(mode="until_executed", ttl=60, lease=3))
def fails_with_flaky_reporter(label: str) -> None:
    effect(label)
    raise RuntimeError("body fails")


@app.task(base=DedupTask, bind=True, dedup=Policy(mode="until_expired", ttl=60), max_retries=3)
def retry_without_throw(self: DedupTask, label: str, countdown: float = 1.0) -> str:
    """Asks for a retry with ``throw=False`` on its first attempt, then returns normally: the
    first execution is a SUCCESS and the retry must still run."""
    attempt = r().incr(f"attempts:{label}")
    effect(label, attempt)
    if attempt == 1:
        self.retry(countdown=countdown, throw=False)
    return f"{label}:{attempt}"


@app.task(base=DedupTask, dedup=Policy(ttl=60, on_duplicate="raise"))
def strict(label: str) -> str:
    effect(label)
    return label


@app.task(base=DedupTask, dedup=Policy(mode="until_executing", ttl=60, include=["user_id"],
                                       on_duplicate="replace"))
def debounced(user_id: int, version: int) -> int:
    effect(f"debounced:{user_id}", version)
    return version


@app.task(base=DedupTask, dedup=Policy(ttl=60, on_store_error="allow"))
def lenient(label: str) -> str:
    effect(label)
    return label


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60, lease=20))
def slow_once(label: str, seconds: float = 1.0) -> str:
    """A body that takes a while: copies of its message claim while it runs."""
    effect(label, os.getpid())
    time.sleep(seconds)
    return label


@app.task(base=DedupTask, dedup=Policy(ttl=60, lease=20))
def slow_once_expiring(label: str, seconds: float = 1.0) -> str:
    effect(label, os.getpid())
    time.sleep(seconds)
    return label


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60, lease=20),
          track_started=True)
def slow_once_tracked(label: str, seconds: float = 1.0) -> str:
    """slow_once with task_track_started: no copy may write STARTED over its SUCCESS."""
    effect(label, os.getpid())
    time.sleep(seconds)
    return label


@app.task(base=DedupTask, dedup=Policy(ttl=60), track_started=True)
def record_tracked(label: str, n: int = 0) -> str:
    effect(label, n)
    return f"{label}:{n}"


@app.task(base=DedupTask, dedup=Policy(ttl=60))
def report_identity(label: str) -> str:
    """Records the identity this execution runs under (taskdedup.running)."""
    current = running.current()
    key = current.key if current is not None else "none"
    effect(label, key)
    return key


@app.task(base=DedupTask, dedup=Policy(ttl=60))
def nests(label: str) -> str:
    """Runs other tasks inside its body: eagerly (.apply) and directly (in-process); records
    its own identity before and after, and what each inner execution ran under."""
    before = running.current()
    plain.apply((f"{label}-plain",))
    report_identity.apply((f"{label}-applied",))
    report_identity(f"{label}-direct")
    after = running.current()
    effect(label, before.key if before is not None else "none")
    effect(label, after.key if after is not None else "none")
    return label


@app.task
def plain(label: str) -> str:
    effect(label)
    return label


@app.task
def collect(results: list[str], label: str) -> str:
    effect(label, len(results))
    return label


@signals.task_postrun.connect
def _record_state(
    task_id: str | None = None, state: str | None = None, retval: object = None, **_: object
) -> None:
    """Test instrumentation: the final state of every execution, SKIPPED (a duplicate that ended as
    skipped, :func:`taskdedup.celery.skipped_info`) included."""
    if task_id and state:
        state = "SKIPPED" if skipped_info(retval) else state
        r().set(f"state:{task_id}", state, ex=600)
