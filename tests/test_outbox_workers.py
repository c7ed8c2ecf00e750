"""The outbox end to end: real Celery prefork and RQ workers, the relay as its command.

A committed call runs once; a row left by a producer that died after its commit (inserted
here without its publish, as that producer leaves it) is published by the relay and runs
once; a row published twice (the producer, then a relay) runs once, also when the relay's
copy arrives while the first still runs; the relay exits 0 on SIGTERM after its batch; two
relays on PostgreSQL (``FOR UPDATE SKIP LOCKED``) publish each row once.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from taskdedup.outbox import Envelope, Publisher, Relay, pack
from taskdedup.rq import DedupQueue
from taskdedup.sql import init, outbox
from taskdedup.sql.outbox import SqlRows, insert_row
from taskdedup.sql.schema import OUTBOX
from taskdedup.testing import wait_for
from tests import outbox_apps
from tests.outbox_apps import record, rq_record, slow
from tests.sqldb import postgres_url
from tests.workers import RqWorker

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sa.Engine]:
    engine = sa.create_engine(f"sqlite:///{tmp_path_factory.mktemp('obxw') / 'db.sqlite'}")
    init(engine)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def celery_queue(redis_url: str) -> Iterator[str]:
    queue = f"obxw-{uuid.uuid4().hex[:6]}"
    outbox_apps.configure(redis_url, queue)
    worker = outbox_apps.OutboxCeleryWorker(redis_url, queue=queue, concurrency=2).start()
    yield queue
    worker.stop()


def effects(rc: redis.Redis, label: str) -> list[str]:
    return [x.decode() for x in rc.lrange(f"effects:{label}", 0, -1)]


def new_label() -> str:
    return f"obx-{uuid.uuid4().hex[:10]}"


def left_by_a_dead_producer(engine: sa.Engine, envelope: Envelope, age: float = 60) -> None:
    """The row a producer SIGKILLed right after its commit leaves: committed, not published."""
    statement, values = insert_row(envelope, datetime.now(UTC) - timedelta(seconds=age))
    with engine.begin() as conn:
        conn.execute(statement, values)


def drained(rc: redis.Redis, queue: str) -> bool:
    """No message of ``queue`` waits or is held unacknowledged (a put-off copy included)."""
    return rc.llen(queue) == 0 and rc.hlen("unacked") == 0


def relay_process(url: str, redis_url: str, queue: str, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "TASKDEDUP_SQL_URL": url, "CELERY_APP": "tests.outbox_apps",
           "RQ_REDIS_URL": redis_url, "TASKDEDUP_TEST_REDIS_URL": redis_url,
           "TASKDEDUP_TEST_QUEUE": queue}
    return subprocess.Popen(
        [sys.executable, "-m", "taskdedup", "outbox", "relay", "--grace", "0", "--poll",
         "0.1", *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)


def running(proc: subprocess.Popen[str], timeout: float = 60) -> None:
    """Wait for a relay's banner (printed once its signal handlers are in place)."""
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            raise TimeoutError(f"the relay did not start (exit {proc.poll()})")
        ready, _, _ = select.select([proc.stderr], [], [], left)
        if ready and "taskdedup outbox relay on" in proc.stderr.readline():
            return


def rows(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(OUTBOX)).scalar_one())


# -- Celery ----------------------------------------------------------------------------------


def test_celery_committed_call_runs_once(
    celery_queue: str, db: sa.Engine, rc: redis.Redis
) -> None:
    label = new_label()
    with db.begin() as conn:
        outbox.add(conn, record.s(label, 7))
    assert wait_for(lambda: effects(rc, label), timeout=30, what="the task ran") == ["7"]
    wait_for(lambda: drained(rc, celery_queue), timeout=30, what="the queue drained")
    assert effects(rc, label) == ["7"] and rows(db) == 0


def test_celery_relay_publishes_a_dead_producers_row_and_a_second_publish_runs_once(
    celery_queue: str, db: sa.Engine, rc: redis.Redis
) -> None:
    lost, twice = new_label(), new_label()
    left_by_a_dead_producer(db, pack(record, lost))
    published = pack(record, twice)
    Publisher(celery_app=outbox_apps.app).publish(published)  # it published, then died
    left_by_a_dead_producer(db, published)                    # before its DELETE
    relay = Relay(SqlRows(db), Publisher(celery_app=outbox_apps.app), grace=10)
    assert relay.run_once() == 2
    wait_for(lambda: effects(rc, lost) and effects(rc, twice), timeout=30, what="both ran")
    wait_for(lambda: drained(rc, celery_queue), timeout=30, what="every copy was handled")
    assert (effects(rc, lost), effects(rc, twice), rows(db)) == (["1"], ["1"], 0)


def test_celery_relay_copy_of_a_running_call_does_not_run_beside_it(
    celery_queue: str, db: sa.Engine, rc: redis.Redis
) -> None:
    label = new_label()
    with db.begin() as conn:
        task_id = outbox.add(conn, slow.s(label))
    wait_for(lambda: effects(rc, label) == ["start"], timeout=30, what="the body started")
    # The producer died before its DELETE: the relay publishes the row again while it runs.
    left_by_a_dead_producer(db, pack(slow.s(label).set(task_id=task_id)))
    assert Relay(SqlRows(db), Publisher(celery_app=outbox_apps.app), grace=0).run_once() == 1
    # The copy found its own id running: put off, it waits held for its countdown (an ETA
    # message is acknowledged only when it runs) while the original still runs.
    wait_for(lambda: rc.llen(celery_queue) == 0 and rc.hlen("unacked") >= 1, timeout=30,
             what="the copy was put off")
    assert effects(rc, label) == ["start"]
    rc.set(f"go:{label}", 1)
    # the original first: while it runs, a put-off copy's republish leaves queue and unacked
    # hash empty for a moment (popped, not yet recorded), which ``drained`` would take for done
    wait_for(lambda: effects(rc, label) == ["start", "end"], timeout=60, what="the original")
    wait_for(lambda: drained(rc, celery_queue), timeout=60, what="the copy was put off, ended")
    assert effects(rc, label) == ["start", "end"]


def test_celery_relay_command_exits_0_on_sigterm_after_its_batch(
    celery_queue: str, db: sa.Engine, rc: redis.Redis, redis_url: str
) -> None:
    labels = [new_label() for _ in range(3)]
    for label in labels:
        left_by_a_dead_producer(db, pack(record, label))
    proc = relay_process(str(db.url), redis_url, celery_queue)
    try:
        wait_for(lambda: rows(db) == 0, timeout=60, what="the relay published the rows")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "taskdedup outbox relay stopped" in err
    wait_for(lambda: all(effects(rc, label) for label in labels), timeout=30, what="ran")
    assert [effects(rc, label) for label in labels] == [["1"]] * 3


def test_two_relays_on_postgresql_publish_each_row_once(rc: redis.Redis, redis_url: str) -> None:
    engine = sa.create_engine(postgres_url())
    with engine.begin() as conn:
        OUTBOX.drop(conn, checkfirst=True)
    init(engine)
    queue = f"obxw-nobody-{uuid.uuid4().hex[:6]}"  # no worker: every publish stays there
    outbox_apps.configure(redis_url, queue)
    try:
        url = engine.url.render_as_string(hide_password=False)
        relays = [relay_process(url, redis_url, queue, "--batch", "4") for _ in range(2)]
        try:
            for proc in relays:
                running(proc)  # both take rows from the start (and stop on SIGTERM)
            envelopes = [pack(record, new_label()) for _ in range(60)]
            for envelope in envelopes:
                left_by_a_dead_producer(engine, envelope)
            wait_for(lambda: rows(engine) == 0, timeout=60, what="the rows were published")
        finally:  # SIGTERM (a process manager) and SIGINT (Ctrl-C) both stop it: exit 0
            for proc, sig in zip(relays, (signal.SIGTERM, signal.SIGINT), strict=True):
                proc.send_signal(sig)
            codes = [proc.wait(timeout=30) for proc in relays]
        assert codes == [0, 0], [proc.stderr.read() for proc in relays if proc.stderr]
        messages = rc.lrange(queue, 0, -1)
        assert len(messages) == len(envelopes)  # a row taken twice would send a second copy
        assert {e.id for e in envelopes} == {
            m.split(b'"id": "')[1][:36].decode() for m in messages}
    finally:
        rc.delete(queue)
        engine.dispose()


# -- RQ ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rq_queue(redis_url: str, rc: redis.Redis) -> Iterator[DedupQueue]:
    name = f"obxw-rq-{uuid.uuid4().hex[:6]}"
    worker = RqWorker(redis_url, [name], scheduler=False).start()
    yield DedupQueue(name, connection=rc)
    worker.stop()


def test_rq_committed_call_runs_once(rq_queue: DedupQueue, db: sa.Engine, rc: redis.Redis) -> None:
    label = new_label()
    with db.begin() as conn:
        job_id = outbox.add(conn, rq_queue, rq_record, label, value=3)
    assert wait_for(lambda: effects(rc, label), timeout=30, what="the job ran") == ["3"]
    job = rq_queue.fetch_job(job_id)
    assert job is not None and wait_for(lambda: job.get_status() == "finished", timeout=30)
    assert rows(db) == 0


def test_rq_relay_publishes_a_dead_producers_row_and_a_second_publish_runs_once(
    rq_queue: DedupQueue, db: sa.Engine, rc: redis.Redis, redis_url: str
) -> None:
    lost, twice = new_label(), new_label()
    left_by_a_dead_producer(db, pack(rq_queue, rq_record, lost))
    published = pack(rq_queue, rq_record, twice)
    Publisher(rq_connection=rc).publish(published)
    left_by_a_dead_producer(db, published)
    wait_for(lambda: effects(rc, twice), timeout=30, what="the first publish ran")
    proc = relay_process(str(db.url), redis_url, "unused", "--once")
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out) == (0, "took 2 rows\n"), err
    wait_for(lambda: effects(rc, lost), timeout=30, what="the relayed job ran")
    assert (effects(rc, lost), effects(rc, twice), rows(db)) == (["1"], ["1"], 0)
    job: Any = rq_queue.fetch_job(published.id)
    assert job.get_status() == "finished"
