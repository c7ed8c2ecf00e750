"""The identity of the RQ job running in this thread (SPEC §11): a synchronous queue
(``is_async=False``, the documented test setup) sets it for the job it runs and restores the
outer one after it; a job run inside another job (a nested synchronous enqueue, in the test
process or in a real worker's horse) gets its own. ``taskdedup.sql.effects`` inside each job
records that job's own key (real Redis, SQLite)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa

from taskdedup import Policy, running
from taskdedup.rq import META_KEY, DedupQueue
from taskdedup.running import Running
from taskdedup.testing import wait_for
from tests import rq_jobs
from tests.sqldb import fresh_engine, rows
from tests.workers import RqWorker


def label() -> str:
    return uuid.uuid4().hex[:12]


def probe_key(queue: DedupQueue, name: str, url: str, inner: bool = False) -> str:
    args: tuple[Any, ...] = (name, url, True) if inner else (name, url)
    return queue.dedup.identity("tests.rq_jobs.identity_probe", Policy(), args,
                                func=rq_jobs.identity_probe).key


def records(rc: redis.Redis, kind: str, name: str) -> list[Any]:
    return [json.loads(x) for x in rc.lrange(f"{kind}:{name}", 0, -1)]


def sqlite_url(tmp_path: Path) -> str:
    engine = fresh_engine("sqlite", tmp_path)
    engine.dispose()
    return f"sqlite:///{tmp_path / 'db.sqlite'}"


def check_nested(rc: redis.Redis, queue: DedupQueue, name: str, url: str, outer_id: str) -> None:
    """The outer job saw its own identity before and after the nested one, which saw its own;
    each effects() row is its job's."""
    outer_key = probe_key(queue, name, url, inner=True)
    inner_key = probe_key(queue, f"{name}-inner", url)
    inner = records(rc, "fx", f"{name}-inner")
    assert len(inner) == 1
    inner_id = inner[0][1]
    assert inner == [[inner_key, inner_id, True]] and inner_id != outer_id
    assert records(rc, "ids", f"{name}-inner") == [[inner_key, inner_id, None]]
    assert records(rc, "ids", name) == [[outer_key, outer_id, None]] * 2  # restored after it
    assert records(rc, "fx", name) == [[outer_key, outer_id, True]]


def test_a_synchronous_queue_runs_each_job_under_its_own_identity_and_restores_the_outer(
    rc: redis.Redis, tmp_path: Path
) -> None:
    url, name = sqlite_url(tmp_path), label()
    sync = DedupQueue(f"rq-sync-{name}", connection=rc, is_async=False)
    outside = Running("caller.task", "caller-id", "taskdedup:caller.task:" + "0" * 32, 60)
    token = running.enter(outside)  # e.g. the test itself runs inside a task
    try:
        job = sync.enqueue(rq_jobs.identity_probe, name, url, True)
        assert job is not None and job.get_status() == "finished", job and job.exc_info
        assert job.meta[META_KEY]["key"] == probe_key(sync, name, url, inner=True)
        check_nested(rc, sync, name, url, job.id)
        assert running.current() == outside
    finally:
        running.leave(token)
    assert running.current() is None
    engine = sa.create_engine(url)
    try:
        assert sorted((row.key, row.task_id) for row in rows(engine)) == sorted([
            (probe_key(sync, name, url, inner=True), job.id),
            (probe_key(sync, f"{name}-inner", url), records(rc, "fx", f"{name}-inner")[0][1]),
        ])
    finally:
        engine.dispose()


def test_a_nested_synchronous_job_in_a_real_worker_gets_its_own_identity(
    rc: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    url, name = sqlite_url(tmp_path), label()
    queue_name = f"rq-running-{os.getpid()}-{name}"
    q = DedupQueue(queue_name, connection=rc)
    job = q.enqueue(rq_jobs.identity_probe, name, url, True)
    assert job is not None
    worker = RqWorker(redis_url, [queue_name], scheduler=False).start()
    try:
        wait_for(lambda: job.get_status() in ("finished", "failed"), timeout=30,
                 what="the job ran")
        assert job.get_status() == "finished", job.latest_result()
        check_nested(rc, q, name, url, job.id)
    finally:
        worker.stop()



def test_an_ungated_synchronous_job_inside_a_job_never_sees_the_enclosing_identity(
    rc: redis.Redis, tmp_path: Path
) -> None:
    """A ``dedup=False`` job run synchronously inside a gated one has no identity of its own:
    it must not take the caller's (its ``effects()`` would record the caller's row)."""
    url, name = sqlite_url(tmp_path), label()
    sync = DedupQueue(f"rq-sync-{name}", connection=rc, is_async=False)
    outside = Running("caller.task", "caller-id", "taskdedup:caller.task:" + "0" * 32, 60)
    token = running.enter(outside)
    try:
        job = sync.enqueue(rq_jobs.identity_probe, name, url, dedup=False)
        assert job is not None
        assert records(rc, "ids", name) == [None]
        assert records(rc, "fx", name) == []  # effects() outside a task: refused, not the caller's
        assert running.current() == outside
    finally:
        running.leave(token)
