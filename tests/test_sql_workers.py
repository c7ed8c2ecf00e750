"""The durable tier under real workers: ``effects(conn)`` in a task body takes the identity
the message carried (Celery headers, RQ ``job.meta``), never one recomputed from arguments.

Each call passes ``dedup_key=``: the key built from it differs from the one the arguments
would give, so a worker that recomputed the identity would record another key. The database
is a SQLite file shared with the worker subprocesses.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from rq import Queue

from taskdedup.rq import DedupJob, DedupQueue
from taskdedup.testing import wait_for
from tests import sql_apps, sql_jobs
from tests.sqldb import LEDGER, METADATA, rows
from tests.workers import RqWorker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sa.Engine]:
    path = tmp_path_factory.mktemp("sqlw") / "db.sqlite"
    engine = sa.create_engine(f"sqlite:///{path}")
    METADATA.create_all(engine)
    os.environ["TASKDEDUP_TEST_SQL_URL"] = str(engine.url)  # the bodies' database
    yield engine
    engine.dispose()


def seen(rc: redis.Redis, order_id: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in rc.lrange(f"sql:seen:{order_id}", 0, -1)]


def returned(rc: redis.Redis, order_id: str) -> list[Any]:
    return wait_for(lambda: [json.loads(x) for x in rc.lrange(f"sql:ret:{order_id}", 0, -1)],
                    timeout=60, what=f"{order_id} returned")


def new_order() -> str:
    return f"ORD-{uuid.uuid4().hex[:10]}"


# -- Celery ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def celery_worker(redis_url: str, rc: redis.Redis, db: sa.Engine) -> Iterator[Any]:
    queue = f"sqlw-{uuid.uuid4().hex[:6]}"
    sql_apps.configure(redis_url, queue)
    worker = sql_apps.SqlCeleryWorker(redis_url, queue=queue, concurrency=1).start()
    yield worker
    worker.stop()


def test_celery_body_records_the_key_the_message_carried(
    celery_worker: Any, rc: redis.Redis, db: sa.Engine
) -> None:
    from taskdedup.celery import get_deduplicator

    task = sql_apps.charge
    dedup = get_deduplicator(sql_apps.app)
    order = new_order()
    carried = dedup.identity(task.name, task._dedup_policy, (order, 500), {},
                             func=task._func(), dedup_key=f"pay-{order}").key
    from_args = dedup.identity(task.name, task._dedup_policy, (order, 500), {},
                               func=task._func()).key
    assert carried != from_args
    result = task.apply_async((order, 500), dedup_key=f"pay-{order}")
    assert returned(rc, order) == [{"charged": 500, "attempt": 1}]
    assert seen(rc, order) == [{"key": carried, "first": True, "task_id": result.id}]
    (row,) = [r for r in rows(db) if r.key == carried]
    assert (row.task_id, row.result) == (result.id, {"charged": 500, "attempt": 1})


def test_celery_body_without_dedup_key_records_the_argument_identity(
    celery_worker: Any, rc: redis.Redis, db: sa.Engine
) -> None:
    from taskdedup.celery import get_deduplicator

    task = sql_apps.charge
    order = new_order()
    key = get_deduplicator(sql_apps.app).identity(
        task.name, task._dedup_policy, (order, 300), {}, func=task._func()).key
    result = task.apply_async((order, 300))
    returned(rc, order)
    assert seen(rc, order) == [{"key": key, "first": True, "task_id": result.id}]


# -- RQ ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("worker_class", ["taskdedup.rq.DedupWorker",
                                          "tests.sql_jobs.SimpleDedupWorker"])
def test_rq_job_records_the_key_its_meta_carried(
    redis_url: str, rc: redis.Redis, db: sa.Engine, worker_class: str
) -> None:
    name = f"sqlw-rq-{uuid.uuid4().hex[:6]}"
    q = DedupQueue(name, connection=rc, dedup=sql_jobs.POLICY)
    order = new_order()
    job = q.enqueue(sql_jobs.rq_charge, order, 200, dedup_key=f"pay-{order}")
    assert job is not None
    carried = job.meta["taskdedup"]["key"]
    policy = q.dedup_policy
    assert policy is not None
    assert carried != q.dedup.identity("tests.sql_jobs.rq_charge", policy, (order, 200), {},
                                       func=sql_jobs.rq_charge).key
    worker = RqWorker(redis_url, [name], scheduler=False, worker_class=worker_class).start()
    try:
        assert returned(rc, order) == [{"charged": 200, "attempt": 1}]
        worker_pid = worker.process.pid if worker.process else None
    finally:
        worker.stop()
    ran_in = int(rc.get(f"sql:pid:{order}") or 0)  # a work-horse, or the worker itself
    assert (ran_in == worker_pid) == worker_class.endswith("SimpleDedupWorker")
    assert seen(rc, order) == [{"key": carried, "first": True, "task_id": job.id}]
    (row,) = [r for r in rows(db) if r.key == carried]
    assert row.task_id == job.id


def test_rq_job_without_taskdedup_meta_gets_configuration_error(
    redis_url: str, rc: redis.Redis, db: sa.Engine
) -> None:
    name = f"sqlw-plain-{uuid.uuid4().hex[:6]}"
    order = new_order()
    job = Queue(name, connection=rc).enqueue(sql_jobs.rq_charge, order, 100)
    worker = RqWorker(redis_url, [name], scheduler=False).start()
    try:
        wait_for(lambda: DedupJob.fetch(job.id, connection=rc).get_status() == "failed",
                 timeout=60, what="the unguarded job failed")
    finally:
        worker.stop()
    latest = DedupJob.fetch(job.id, connection=rc).latest_result()
    error = latest.exc_string if latest is not None else ""
    assert "ConfigurationError" in (error or "")
    assert "outside a gated Celery/RQ task needs key" in (error or "")
    assert seen(rc, order) == [] and not [r for r in rows(db, LEDGER)
                                          if r.order_id == order]


