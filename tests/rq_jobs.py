"""Job functions for the RQ integration tests, imported by the test process and by the
``rq worker`` subprocess (so they must live in an importable module, never ``__main__``).

Every body records its side effect in Redis (``RPUSH effects:<label>``) so the test process
can count executions across processes; ``wait_gate`` holds a body until the test sets
``go:<label>`` (with a deadline).
"""

from __future__ import annotations

import os
import time
from typing import Any

from rq.job import Retry
from rq.worker import SpawnWorker

from taskdedup.rq import DedupWorker
from tests.effects import effect, r, wait_gate

URL = os.environ.get("TASKDEDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

def record(label: str, n: int = 0) -> str:
    effect(label, n)
    return f"{label}:{n}"


def echo_kwargs(label: str, **kwargs: Any) -> str:
    """Records the names of the keyword arguments it received."""
    effect(label, ",".join(sorted(kwargs)) or "-")
    return label


def gated(label: str) -> str:
    effect(label, "start")
    wait_gate(label)
    effect(label, "end")
    return label


def long_running(label: str) -> str:
    """Records the work-horse pid, then runs until the gate opens."""
    effect(label, f"start:{os.getpid()}")
    wait_gate(label, timeout=120)
    effect(label, "end")
    return label


def threads_then_wait(label: str) -> str:
    """Records the work-horse's pid and the names of its threads, then runs until the gate
    opens."""
    import threading

    names = ",".join(sorted(t.name for t in threading.enumerate()))
    effect(label, f"start:{os.getpid()}:{names}")
    wait_gate(label, timeout=120)
    effect(label, "end")
    return label


def fail_first(label: str) -> str:
    """Fails on its first execution."""
    attempt = int(r().incr(f"attempts:{label}"))
    effect(label, attempt)
    if attempt == 1:
        raise RuntimeError("first attempt fails")
    return label


def fail_first_counted(label: str) -> str:
    """:func:`fail_first` under a name of its own: a test reading this job's stats counters
    sees no counts that another test's jobs flush late (a worker flushes every ~5 s)."""
    return fail_first(label)


def return_retry_first(label: str) -> Any:
    """Asks for a retry by returning ``Retry`` on its first execution (RQ 2.x+)."""
    attempt = int(r().incr(f"attempts:{label}"))
    effect(label, attempt)
    if attempt == 1:
        return Retry(max=2, interval=2)
    return label


def slow(label: str) -> None:
    effect(label, "start")
    time.sleep(30)
    effect(label, "end")


def on_success_cb(job: Any, connection: Any, result: Any, *args: Any, **kwargs: Any) -> None:
    """A success callback that records that it ran."""
    r().rpush(f"callbacks:{job.id}", "success")


def enqueue_again_once(job: Any, connection: Any, *args: Any, **kwargs: Any) -> None:
    """A success or failure callback that enqueues the same call once more (until_executed)
    and records the id it got back (a new job's, or the original's when it was dropped)."""
    from taskdedup import Policy
    from taskdedup.rq import DedupQueue

    name = job.args[0]
    if int(r().incr(f"again:{name}")) == 1:
        queue = DedupQueue(job.origin, connection=connection,
                           dedup=Policy(mode="until_executed", ttl=60))
        again = queue.enqueue(job.func, *job.args)
        r().rpush(f"again-id:{name}", again.id if again is not None else "-")


class DedupSpawnWorker(DedupWorker, SpawnWorker):  # type: ignore[misc]
    """A DedupWorker whose work-horse is spawned (``posix_spawn``), not forked: it shares
    nothing with the worker, so it claims for itself."""


class FastStoreRetryWorker(DedupWorker):
    """A DedupWorker that puts a job back after 0.5 s when its lock store is down."""

    store_retry_delay = 0.5


def counted(label: str) -> str:
    """Run only by the stats hand-over test: its stats hash is its own."""
    effect(label)
    return label


def identity_probe(label: str, sql_url: str, inner: bool = False) -> str:
    """Records the running identity (``RPUSH ids:<label>`` ``[key, job id]`` or ``null``), runs
    a nested job on a synchronous queue when ``inner`` (and records the identity again after
    it), then records its own ``taskdedup.sql.effects`` row (``RPUSH fx:<label>``)."""
    import json

    import sqlalchemy as sa

    from taskdedup import running
    from taskdedup.rq import DedupQueue
    from taskdedup.sql import effects

    def note() -> None:
        now = running.current()
        r().rpush(f"ids:{label}", json.dumps([now.key, now.task_id, now.redelivery]
                                             if now else None))

    note()
    if inner:
        sync = DedupQueue(f"rq-sync-inner-{label}", connection=r(), is_async=False)
        job = sync.enqueue(identity_probe, f"{label}-inner", sql_url)
        assert job is not None and job.get_status() == "finished", job and job.exc_info
        note()
    engine = sa.create_engine(sql_url)
    try:
        with engine.begin() as conn, effects(conn) as fx:
            r().rpush(f"fx:{label}", json.dumps([fx.key, fx.task_id, fx.first]))
    finally:
        engine.dispose()
    return label


def freeze_count(label: str) -> int:
    """Records how many objects the work-horse's collector holds frozen (``gc.freeze``)."""
    import gc

    count = gc.get_freeze_count()
    effect(label, count)
    return count
