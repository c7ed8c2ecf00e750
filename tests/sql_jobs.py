"""Task bodies of the durable tier's worker tests, for Celery and RQ alike, and the RQ jobs.

Imported by the test process and by the worker subprocesses (``rq worker``; the Celery app in
:mod:`tests.sql_apps` calls the same body). Light on purpose: no Celery import, so an RQ
work-horse forked per job does not pay for it. The database is ``TASKDEDUP_TEST_SQL_URL`` (a
SQLAlchemy URL), the broker and lock store ``TASKDEDUP_TEST_REDIS_URL``. A body records in
Redis what it did::

    sql:seen:<order>     RPUSH a JSON record per effects() block: key, first, task_id
    sql:attempt:<order>  INCR at the start of every run
    sql:pid:<order>      SET to the pid of the process that ran it (the last run)
    sql:ret:<order>      RPUSH the JSON value the body returned (it got that far)
    sql:at               RPUSH "<order>:<point>:<pid>" when a run pauses at its kill point

``sql:kill:<order>`` names the point where the *first* run of that order pauses until the
test SIGKILLs its process: ``before`` (the transaction), ``inside`` (after the ledger row,
before the commit) or ``after`` (committed, not yet returned).
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

import sqlalchemy as sa
from rq.worker import SimpleWorker

from taskdedup import Policy
from taskdedup.rq import DedupWorker
from taskdedup.sql import effects
from tests.effects import r
from tests.sqldb import LEDGER

POLICY = Policy(ttl=600, lease=1.5)

_engine: sa.Engine | None = None
_engine_pid = 0


def engine() -> sa.Engine:
    """This process's engine on ``TASKDEDUP_TEST_SQL_URL`` (a new one after a fork)."""
    global _engine, _engine_pid
    if _engine is None or _engine_pid != os.getpid():
        _engine = sa.create_engine(os.environ["TASKDEDUP_TEST_SQL_URL"], pool_size=64,
                                   max_overflow=16, pool_pre_ping=True)
        _engine_pid = os.getpid()
    return _engine


def _pause(order_id: str, point: str, attempt: int) -> None:
    """On the first run, at the point the test chose: say so and wait to be SIGKILLed."""
    if attempt != 1 or r().get(f"sql:kill:{order_id}") != point.encode():
        return
    r().rpush("sql:at", f"{order_id}:{point}:{os.getpid()}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)
    raise TimeoutError(f"{order_id}: never killed at {point}")


def _hold() -> None:
    """``TASKDEDUP_TEST_BODY_HOLD=<seconds>``: stay inside the transaction a random while up to
    that long (the outbox kill proof: a SIGKILL at a random moment lands inside it often)."""
    hold = float(os.environ.get("TASKDEDUP_TEST_BODY_HOLD") or 0)
    if hold > 0:
        time.sleep(random.uniform(0, hold))


def ledger_charge(order_id: str, cents: int, durable: bool = True) -> Any:
    """One ledger row per charge, in one transaction; with ``durable`` the identity is
    recorded in that transaction (taskdedup.sql.effects), without it the body is plain."""
    attempt = int(r().incr(f"sql:attempt:{order_id}"))
    r().set(f"sql:pid:{order_id}", os.getpid(), ex=600)
    _pause(order_id, "before", attempt)
    result: Any
    with engine().begin() as conn:
        if durable:
            with effects(conn) as fx:
                r().rpush(f"sql:seen:{order_id}", json.dumps(
                    {"key": fx.key, "first": fx.first, "task_id": fx.task_id}))
                if fx.first:
                    conn.execute(LEDGER.insert().values(order_id=order_id, cents=cents,
                                                        task_id=fx.task_id))
                    fx.result = {"charged": cents, "attempt": attempt}
                result = fx.result
                _pause(order_id, "inside", attempt)
                _hold()
        else:
            conn.execute(LEDGER.insert().values(order_id=order_id, cents=cents))
            result = {"charged": cents, "attempt": attempt}
            _pause(order_id, "inside", attempt)
    _pause(order_id, "after", attempt)
    r().rpush(f"sql:ret:{order_id}", json.dumps(result))
    return result


# -- RQ --------------------------------------------------------------------------------------


def rq_charge(order_id: str, cents: int, durable: bool = True) -> Any:
    """The RQ job of :func:`ledger_charge`."""
    return ledger_charge(order_id, cents, durable)


class LedgerWorker(DedupWorker):
    """DedupWorker with this module imported in the main process, so that every forked
    work-horse has it already (as an app's worker script imports its jobs)."""


class SimpleDedupWorker(SimpleWorker, DedupWorker):
    """DedupWorker running jobs in its own process: ``SimpleWorker.execute_job`` (no
    work-horse) first in the MRO, ``DedupWorker.perform_job`` and handlers after it."""
