"""The Celery app of the integration-level model test (``tests/test_celery_model.py``),
imported by the test process and by its worker (``celery -A tests.model_app worker``).

Every body records one run in Redis (``RPUSH model:runs:<name>:<key>``). All tasks ack late,
so "the queue is empty and nothing is unacked" means every message sent so far, and every
message its execution published (a retry, a chain's next step), has been dealt with. The worker
sends task events and tracks STARTED, as a worker watched by Flower does; a killed worker's
unacknowledged messages come back within seconds (a small visibility timeout), and so does every
countdown message a worker holds past it: kombu's copies of one message (SPEC §5).
"""

from __future__ import annotations

import os
import time
from functools import cache
from typing import Any

from celery import Celery, signals

from taskdedup import Approximate, Concurrency, Debounce, Policy, running
from taskdedup.celery import DedupTask
from tests.effects import r

URL = os.environ.get("TASKDEDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
QUEUE = os.environ.get("TASKDEDUP_TEST_QUEUE", "model")

app = Celery("model", broker=URL, backend=URL)
app.conf.update(
    task_default_queue=QUEUE,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    task_track_started=True,
    worker_send_task_events=True,
    broker_transport_options={
        "visibility_timeout": 4,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # kombu holds this mutex while it restores; a worker SIGKILLed holding it blocks every
        # restore for its expiry (300 s by default): the tests kill workers, so keep it short
        "unacked_mutex_expire": 10,
    },
)

WINDOW = Policy(mode="until_expired", ttl=300)   # longer than the test: a run is final
ONCE = Policy(mode="until_executed", ttl=300)    # released when it ends (then may run again)
STARTED = Policy(mode="until_executing", ttl=300)  # released when a worker starts it
# A killed body's lock lapses soon: its redelivered message, put off while the dead run's lock
# is still RUNNING by the same id (SPEC §5), runs within seconds rather than a minute.
SHORT_LEASE = Policy(mode="until_expired", ttl=300, lease=3)
# the window after success kept in rotating Bloom filters: the lock goes, the identity stays
REMEMBERED = Policy(mode="until_expired", ttl=300, window=Approximate(10_000, 0.001))


def ran(name: str, key: str) -> None:
    r().rpush(f"model:runs:{name}:{key}", str(time.time()))


# SPEC §15: a call finding its identity running waits for it, then runs with its own arguments
SERIAL = Policy(mode="while_executing", lease=10, include=["key"], on_busy="wait")


@app.task(base=DedupTask, dedup=SERIAL, name="model.serial")
def serial(key: str, n: int) -> int:
    """One of several calls of one identity that must all run, one at a time."""
    if r().incr(f"model:busy:serial:{key}") > 1:
        r().rpush(f"model:overlap:serial:{key}", n)
    ran("serial", key)
    time.sleep(0.3)
    r().decr(f"model:busy:serial:{key}")
    return n


# SPEC §15: duplicates of a running call become one follow-up, run after it with the latest
# arguments; a burst of debounced calls runs once, with its last call's arguments.
FOLLOW = Policy(mode="until_executed", lease=10, include=["key"], on_duplicate="coalesce")
BOUNCE = Policy(mode="until_expired", ttl=300, lease=10, include=["key"],
                debounce=Debounce(0.5))


@app.task(base=DedupTask, dedup=FOLLOW, name="model.follow")
def follow(key: str, n: int) -> int:
    """A call whose duplicates, while it runs, coalesce into one follow-up (never beside)."""
    if r().incr(f"model:busy:serial:{key}") > 1:
        r().rpush(f"model:overlap:serial:{key}", n)
    ran("follow", key)
    time.sleep(0.5)
    r().decr(f"model:busy:serial:{key}")
    return n


@app.task(base=DedupTask, dedup=BOUNCE, name="model.bounce")
def bounce(key: str, n: int) -> int:
    """A debounced call: only the burst's last runs."""
    ran("bounce", key)
    return n


# SPEC §16: at most one body per key at once, across the worker's processes; every call runs.
# Its slot is leased like a lock (3 s): a killed holder's slot lapses soon.
LIMITED = Policy(mode="until_expired", ttl=300, lease=3)


def limited_key(key: str, n: int, seconds: float = 0.3) -> str:
    return key


@app.task(base=DedupTask, dedup=LIMITED, name="model.limited",
          limits=[Concurrency(1, key=limited_key)])
def limited(key: str, n: int, seconds: float = 0.3) -> int:
    """One of several calls of one limit key that must all run, one at a time."""
    if r().incr(f"model:busy:limited:{key}") > 1:
        r().rpush(f"model:overlap:limited:{key}", n)
    ran("limited", key)
    time.sleep(seconds)
    r().decr(f"model:busy:limited:{key}")
    return n


@app.task(base=DedupTask, dedup=WINDOW, name="model.charge")
def charge(key: str) -> str:
    """A payment: runs once per key for the test's whole length."""
    ran("charge", key)
    time.sleep(0.2)  # long enough for a second message of the same id to be fetched meanwhile
    return key


@app.task(base=DedupTask, dedup=SHORT_LEASE, name="model.slow")
def slow(key: str) -> str:
    """Long enough for the test to SIGKILL the worker while it runs."""
    ran("slow", key)
    time.sleep(1.5)
    return key


@app.task(base=DedupTask, dedup=WINDOW, name="model.eta_window")
def eta_window(key: str) -> str:
    """Sent with a countdown beyond the visibility timeout: kombu copies its message while a
    worker holds it, and the copies claim while it runs (RUNNING by this id) and after it
    succeeded (DONE by this id)."""
    ran("eta_window", key)
    time.sleep(1.0)
    return key


@app.task(base=DedupTask, dedup=ONCE, name="model.eta_once")
def eta_once(key: str) -> str:
    """As :func:`eta_window` under until_executed: the late copies find the tombstone
    (``F|``) its success leaves for one lease, where the lock was simply gone before."""
    ran("eta_once", key)
    time.sleep(1.0)
    return key


@app.task(name="model.errback")
def errback(key: str) -> None:
    """An errback (``link_error``, immutable): must not run for a call that succeeded."""
    ran("errback", key)


@cache
def _engine(db: str) -> Any:
    import sqlalchemy as sa

    return sa.create_engine(db)


def _identity(key: str, where: str, db: str) -> None:
    """Record the identity this code runs under (``model:identity:<key>``), and write the
    durable record of it (:func:`taskdedup.sql.effects` on ``db``: its own row)."""
    from taskdedup.sql import effects

    current = running.current()
    r().rpush(f"model:identity:{key}", f"{where}={current.key if current else None}")
    with _engine(db).begin() as conn, effects(conn) as fx:
        if fx.first:
            fx.result = where


@app.task(base=DedupTask, dedup=WINDOW, name="model.inner")
def inner(key: str, where: str, db: str) -> str:
    """Run inside :func:`nests`: under its own identity, never its caller's."""
    ran("inner", f"{key}-{where}")
    _identity(key, where, db)
    return where


@app.task(base=DedupTask, dedup=WINDOW, name="model.nests")
def nests(key: str, db: str) -> str:
    """Runs :func:`inner` with ``.apply()`` and then directly in-process, and records its own
    identity before, between and after them (and its durable row, last)."""
    ran("nests", key)
    before = running.current()
    r().rpush(f"model:identity:{key}", f"before={before.key if before else None}")
    inner.apply((key, "applied", db))
    between = running.current()
    r().rpush(f"model:identity:{key}", f"between={between.key if between else None}")
    inner(key, "direct", db)
    _identity(key, "after", db)
    return key


@app.task(base=DedupTask, dedup=REMEMBERED, name="model.remember")
def remember(key: str) -> str:
    ran("remember", key)
    return key


@app.task(base=DedupTask, dedup=WINDOW, name="model.receipt")
def receipt(key: str) -> str:
    ran("receipt", key)
    return key


@app.task(base=DedupTask, dedup=ONCE, name="model.log")
def log(key: str) -> str:
    ran("log", key)
    return key


@app.task(base=DedupTask, dedup=ONCE, name="model.fail_once")
def fail_once(key: str) -> str:
    """Fails finally on its first run for a key (no retries), succeeds after."""
    ran("fail_once", key)
    if r().incr(f"model:attempts:fail_once:{key}") == 1:
        raise RuntimeError("a final failure")
    return key


@app.task(base=DedupTask, dedup=WINDOW, bind=True, max_retries=2, name="model.retry_once")
def retry_once(self: DedupTask, key: str, throw: bool) -> str:
    """Asks for one retry on its first run: ``raise self.retry(...)``, or
    ``self.retry(..., throw=False)`` and a normal return. The retry must run."""
    ran("retry_once", key)
    if r().incr(f"model:attempts:retry_once:{key}") == 1:
        if throw:
            raise self.retry(countdown=0.3)
        self.retry(countdown=0.3, throw=False)
    return key


@app.task(base=DedupTask, dedup=WINDOW, name="model.total")
def total(results: list[object], key: str) -> int:
    """A chord body: runs once the header's results are in."""
    ran("total", key)
    return len(results)


@app.task(base=DedupTask, dedup=ONCE, name="model.spawn")
def spawn(key: str, child: str) -> str:
    """Publishes ``receipt(child)`` from its body (a duplicate when that receipt is held)."""
    ran("spawn", key)
    return str(receipt.delay(child).id)


@app.task(base=DedupTask, dedup=STARTED, bind=True, max_retries=2, name="model.retry_later")
def retry_later(self: DedupTask, key: str) -> str:
    """On its first run waits for the test's go (``model:go:<key>``), then asks for a retry."""
    ran("retry_later", key)
    if r().incr(f"model:attempts:retry_later:{key}") == 1:
        deadline = time.monotonic() + 20
        while not r().exists(f"model:go:{key}") and time.monotonic() < deadline:
            time.sleep(0.02)
        raise self.retry(countdown=0.2)
    return key


# -- the copies soak (tests/test_soak_copies.py) --------------------------------------------
# A killed body's lock lapses within the lease; a finished until_executed call's tombstone
# outlives the visibility timeout plus kombu's restore interval, so a copy restored from a
# killed worker still finds it (SPEC §5: the tombstone lives one lease).
SOAK_WINDOW = Policy(mode="until_expired", ttl=600, lease=3)
SOAK_ONCE = Policy(mode="until_executed", ttl=600, lease=6)


def _soak(task: DedupTask, key: str, seconds: float) -> str:
    """Record ``start``/``end`` with this execution's id, process group and pid."""
    tag = f"{task.request.id} {os.getpgrp()} {os.getpid()}"
    r().rpush(f"soak:{key}", f"start {tag}")
    time.sleep(seconds)
    r().rpush(f"soak:{key}", f"end {tag}")
    return key


@app.task(base=DedupTask, dedup=SOAK_WINDOW, bind=True, reject_on_worker_lost=True,
          name="model.soak_window")
def soak_window(self: DedupTask, key: str, seconds: float) -> str:
    return _soak(self, key, seconds)


@app.task(base=DedupTask, dedup=SOAK_ONCE, bind=True, reject_on_worker_lost=True,
          name="model.soak_once")
def soak_once(self: DedupTask, key: str, seconds: float) -> str:
    return _soak(self, key, seconds)


@signals.task_success.connect
def _completed(sender: Any = None, result: Any = None, **_: object) -> None:
    """A soak body's success, after taskdedup's own ``task_success`` receiver (connected
    first) completed its lock: a body killed before this line may run again, at least once."""
    if getattr(sender, "name", "") in ("model.soak_window", "model.soak_once"):
        r().rpush(f"soak:{result}", f"completed {sender.request.id} {os.getpgrp()} "
                                    f"{os.getpid()}")


@signals.task_postrun.connect
def _done(task_id: str | None = None, state: str | None = None, **_: object) -> None:
    """Every execution's end, by task id: the test waits for the ids it sent."""
    if task_id and state:
        r().rpush(f"model:done:{task_id}", state)
