"""The SQLAlchemy outbox without workers: ``outbox.add``, when its rows are published (and
when never), the gate of a second publish, the relay's rows and backoff, and the CLI — on
SQLite and on a real PostgreSQL.

A published RQ call is a job hash in Redis (``rq:job:<id>``); a published Celery call is a
message in the test's queue. Nothing here runs a worker (tests/test_outbox_workers.py does).
"""

from __future__ import annotations

import json
import logging
import socket
import sqlite3
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.orm import Session

from taskdedup import ConfigurationError, Policy
from taskdedup.cli import main
from taskdedup.outbox import Envelope, Publisher, Relay, pack
from taskdedup.rq import DedupQueue
from taskdedup.sql import init, outbox
from taskdedup.sql.outbox import SqlRows, backlog, insert_row
from taskdedup.sql.schema import OUTBOX
from tests import outbox_apps
from tests.outbox_apps import POLICY, record, rq_record
from tests.sqldb import DIALECTS, postgres_url


@pytest.fixture(params=DIALECTS)
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sa.Engine]:
    if request.param == "sqlite":
        engine = sa.create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    else:
        engine = sa.create_engine(postgres_url())
        with engine.begin() as conn:
            OUTBOX.drop(conn, checkfirst=True)
    init(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def queue(rc: redis.Redis) -> DedupQueue:
    return DedupQueue(f"obx-{uuid.uuid4().hex[:8]}", connection=rc)


@pytest.fixture(scope="module")
def celery_queue(redis_url: str) -> str:
    name = f"obx-c-{uuid.uuid4().hex[:8]}"
    outbox_apps.configure(redis_url, name)
    return name


def ids(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(OUTBOX.c.id).order_by(OUTBOX.c.id)).scalars())


def published(rc: redis.Redis, job_id: str) -> bool:
    return bool(rc.exists(f"rq:job:{job_id}"))


def label() -> str:
    return f"L-{uuid.uuid4().hex[:10]}"


# -- add, and the publish after the commit ----------------------------------------------------


def test_commit_publishes_under_the_returned_id_and_deletes_the_row(
    engine: sa.Engine, queue: DedupQueue, rc: redis.Redis
) -> None:
    with engine.begin() as conn:
        job_id = outbox.add(conn, queue, rq_record, label(), value=2, job_timeout=30)
        assert ids(engine) == [] or engine.dialect.name == "sqlite"  # not visible outside
        assert not published(rc, job_id)  # not before the commit
    assert published(rc, job_id)
    assert ids(engine) == []
    job = queue.fetch_job(job_id)
    assert job is not None
    assert (job.func_name, job.kwargs, job.timeout) == ("tests.outbox_apps.rq_record",
                                                        {"value": 2}, 30)
    assert rc.lrange(f"rq:queue:{queue.name}", 0, -1) == [job_id.encode()]


def test_explicit_rollback_publishes_nothing(
    engine: sa.Engine, queue: DedupQueue, rc: redis.Redis
) -> None:
    with engine.connect() as conn:
        trans = conn.begin()
        job_id = outbox.add(conn, queue, rq_record, label())
        trans.rollback()
    assert not published(rc, job_id)
    assert ids(engine) == []


def test_exception_rolls_back_and_publishes_nothing(
    engine: sa.Engine, queue: DedupQueue, rc: redis.Redis
) -> None:
    added: list[str] = []
    with pytest.raises(RuntimeError), engine.begin() as conn:
        added.append(outbox.add(conn, queue, rq_record, label()))
        raise RuntimeError("the business transaction failed")
    assert not published(rc, added[0])
    assert ids(engine) == []


def test_savepoint_rolled_back_takes_only_its_rows(
    engine: sa.Engine, queue: DedupQueue, rc: redis.Redis
) -> None:
    with engine.begin() as conn:
        kept = outbox.add(conn, queue, rq_record, label())
        savepoint = conn.begin_nested()
        dropped = outbox.add(conn, queue, rq_record, label())
        inner = conn.begin_nested()
        dropped_inner = outbox.add(conn, queue, rq_record, label())
        inner.commit()  # released into the savepoint that rolls back
        savepoint.rollback()
        released = conn.begin_nested()
        kept_released = outbox.add(conn, queue, rq_record, label())
        released.commit()
    assert [published(rc, i) for i in (kept, dropped, dropped_inner, kept_released)] == [
        True, False, False, True]
    assert ids(engine) == []


def test_savepoint_begun_before_the_first_add_rolls_back_its_rows(
    tmp_path: Path, queue: DedupQueue, rc: redis.Redis
) -> None:
    """A new engine: taskdedup listens from the first add on, inside a savepoint begun
    before it (its begin was not seen)."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'fresh.sqlite'}")
    init(engine)
    with engine.begin() as conn:
        savepoint = conn.begin_nested()
        dropped = outbox.add(conn, queue, rq_record, label())
        savepoint.rollback()
        kept = outbox.add(conn, queue, rq_record, label())
    assert (published(rc, dropped), published(rc, kept)) == (False, True)
    engine.dispose()


def test_pooled_connection_reused_after_a_rollback_publishes_only_the_committed_call(
    engine: sa.Engine, queue: DedupQueue, rc: redis.Redis
) -> None:
    pooled = sa.create_engine(engine.url.render_as_string(hide_password=False),
                              pool_size=1, max_overflow=0)
    try:
        with pooled.connect() as conn:
            first_dbapi = conn.connection.dbapi_connection
            conn.begin()
            rolled_back = outbox.add(conn, queue, rq_record, label())
            conn.rollback()
        with pooled.connect() as conn:
            assert conn.connection.dbapi_connection is first_dbapi  # the same, from the pool
            with conn.begin():
                committed = outbox.add(conn, queue, rq_record, label())
        assert (published(rc, rolled_back), published(rc, committed)) == (False, True)
        assert ids(engine) == []
    finally:
        pooled.dispose()


def test_commit_as_you_go_twice_publishes_each_commit(
    engine: sa.Engine, queue: DedupQueue, rc: redis.Redis
) -> None:
    conn = engine.connect()
    try:
        first = outbox.add(conn, queue, rq_record, label())
        conn.commit()
        second = outbox.add(conn, queue, rq_record, label())  # its transaction begins: the
        assert published(rc, first)                            # first commit is published
        conn.commit()
    finally:
        conn.close()
    assert published(rc, second)
    assert ids(engine) == []


def test_a_commit_the_database_refuses_publishes_nothing(
    engine: sa.Engine, queue: DedupQueue, rc: redis.Redis, tmp_path: Path
) -> None:
    added: list[str] = []
    if engine.dialect.name == "postgresql":
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP TABLE IF EXISTS obx_child, obx_parent")
            conn.exec_driver_sql("CREATE TABLE obx_parent (id int primary key)")
            conn.exec_driver_sql(
                "CREATE TABLE obx_child (id int primary key, parent int REFERENCES "
                "obx_parent (id) DEFERRABLE INITIALLY DEFERRED)")
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO obx_child VALUES (1, 42)")  # checked at COMMIT
            added.append(outbox.add(conn, queue, rq_record, label()))
    else:
        # A reader's open transaction holds SQLite's SHARED lock: the COMMIT cannot get its
        # EXCLUSIVE lock and fails "database is locked" (the INSERT itself succeeded).
        locked = sa.create_engine(engine.url, connect_args={"timeout": 0.2})
        reader = sqlite3.connect(str(engine.url.database), isolation_level=None)
        try:
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM taskdedup_outbox").fetchall()
            with pytest.raises(sa.exc.OperationalError, match="locked"), \
                    locked.begin() as conn:
                added.append(outbox.add(conn, queue, rq_record, label()))
        finally:
            reader.execute("ROLLBACK")
            reader.close()
            locked.dispose()
    assert not published(rc, added[0])
    assert ids(engine) == []


def test_session_commit_rollback_and_savepoint(
    engine: sa.Engine, queue: DedupQueue, rc: redis.Redis
) -> None:
    with Session(engine) as session, session.begin():
        committed = outbox.add(session, queue, rq_record, label())
        nested = session.begin_nested()
        dropped = outbox.add(session, queue, rq_record, label())
        nested.rollback()
    with Session(engine) as session:
        session.begin()
        rolled_back = outbox.add(session, queue, rq_record, label())
        session.rollback()
    assert [published(rc, i) for i in (committed, dropped, rolled_back)] == [True, False, False]
    assert ids(engine) == []


def test_autocommit_is_refused(engine: sa.Engine, queue: DedupQueue) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn, \
            pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
        outbox.add(conn, queue, rq_record, label())
    assert ids(engine) == []


def test_bad_input_is_refused_at_add_and_leaves_no_row(
    engine: sa.Engine, queue: DedupQueue, rc: redis.Redis, celery_queue: str
) -> None:
    from rq import Queue

    sock = socket.socket()
    cases: list[tuple[Any, tuple[Any, ...], dict[str, Any], str]] = [
        (outbox_apps.plain, ("x",), {}, "no dedup policy"),
        (record, ({1, 2},), {}, "cannot be serialized"),  # an identity, but not JSON
        (record.s("x").set(dedup=False), (), {}, "no dedup policy"),
        (Queue("plain", connection=rc), (rq_record, "x"), {}, "DedupQueue"),
        (DedupQueue("off", connection=rc, dedup=False), (rq_record, "x"), {}, "no dedup"),
        (queue, (rq_record, "x"), {"value": sock, "dedup": Policy(include=["label"])},
         "cannot be serialized"),  # no part of the identity, and pickle refuses it
        (queue, ("tests.outbox_apps.nothing_here", 1), {}, "does not import"),
        (queue, (rq_record, "x"), {"dedup": Policy(mode="until_executing")}, "guard"),
        ("a string", (), {}, "takes a Celery task"),
    ]
    for target, args, kwargs, message in cases:
        with engine.begin() as conn, pytest.raises(ConfigurationError, match=message):
            outbox.add(conn, target, *args, **kwargs)
    sock.close()
    with engine.begin() as conn, pytest.raises(TypeError, match="fingerprint"):
        outbox.add(conn, queue, rq_record, {"no": {1, 2.5, float("nan")}})
    assert ids(engine) == []


def test_a_publish_that_fails_after_the_commit_leaves_the_row_for_the_relay(
    engine: sa.Engine, rc: redis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"  # nothing listens there
    down = DedupQueue(f"obx-{uuid.uuid4().hex[:8]}", connection=redis.Redis.from_url(dead),
                      dedup_store=redis_url)
    with caplog.at_level(logging.WARNING, "taskdedup"), engine.begin() as conn:
        job_id = outbox.add(conn, down, rq_record, label())  # committed: no error here
    assert ids(engine) == [job_id]
    assert f"outbox row {job_id}" in caplog.text and "the relay publishes it" in caplog.text
    relay = Relay(SqlRows(engine), Publisher(rq_connection=rc), grace=0)
    assert relay.run_once() == 1
    assert published(rc, job_id)
    assert rc.lrange(f"rq:queue:{down.name}", 0, -1) == [job_id.encode()]
    assert ids(engine) == []


# -- a second publish of one row ----------------------------------------------------------------


def test_celery_second_publish_sends_a_copy_while_queued_or_running_and_nothing_once_done(
    rc: redis.Redis, celery_queue: str
) -> None:
    """A row published again (a relay after a producer that died before its DELETE) keeps
    the lock as it is: queued or running by its own id, a copy is sent (the worker runs one
    of them); done, nothing is sent. A running lock never turns back to queued (the copy
    would then run beside the original)."""
    envelope = pack(record.s(label()).set(expires=300, headers={"tenant": "t1"}))
    publisher = Publisher(celery_app=outbox_apps.app)
    publisher.publish(envelope)
    (lock,) = [k for k in rc.scan_iter("taskdedup:outbox.record:*")
               if rc.get(k) == f"Q||{envelope.id}".encode()]
    assert rc.llen(celery_queue) == 1
    message = json.loads(rc.lindex(celery_queue, 0))  # type: ignore[arg-type]
    headers = message["headers"]
    assert (headers["id"], headers["tenant"]) == (envelope.id, "t1")
    expires = datetime.fromisoformat(headers["expires"]) - datetime.now(UTC)
    assert timedelta(seconds=290) < expires <= timedelta(seconds=300)  # absolute at add
    publisher.publish(envelope)
    assert (rc.llen(celery_queue), rc.get(lock)) == (2, f"Q||{envelope.id}".encode())
    rc.set(lock, f"R||{envelope.id}", px=60_000)
    publisher.publish(envelope)
    assert (rc.llen(celery_queue), rc.get(lock)) == (3, f"R||{envelope.id}".encode())
    rc.set(lock, f"D||{envelope.id}", px=60_000)
    publisher.publish(envelope)
    assert (rc.llen(celery_queue), rc.get(lock)) == (3, f"D||{envelope.id}".encode())
    rc.delete(celery_queue, lock)


def test_the_call_options_travel_with_the_row(
    rc: redis.Redis, queue: DedupQueue, celery_queue: str
) -> None:
    """What the issue lists travels from ``add`` to the publish: Celery's queue, countdown
    (stored as the moment it stands for: a later publish does not push it), priority and
    ``dedup_key`` (the lock's identity); RQ's enqueue options and ``dedup_key``."""
    from taskdedup.celery import get_deduplicator

    routed, key = f"{celery_queue}-routed", f"K-{uuid.uuid4().hex[:8]}"
    added, celery_label, rq_label = datetime.now(UTC), label(), label()
    envelope = pack(record.s(celery_label).set(queue=routed, countdown=30, priority=5,
                                               dedup_key=key))
    Publisher(celery_app=outbox_apps.app).publish(envelope)
    (found,) = [k for k in rc.scan_iter(f"{routed}*") if rc.type(k) == b"list"]
    message = json.loads(rc.lindex(found, 0))  # type: ignore[arg-type]
    rc.delete(found)
    assert message["headers"]["id"] == envelope.id
    eta = datetime.fromisoformat(message["headers"]["eta"])
    assert added + timedelta(seconds=29) < eta <= datetime.now(UTC) + timedelta(seconds=30)
    assert message["properties"]["priority"] == 5
    lock = get_deduplicator(outbox_apps.app).identity(
        record.name, POLICY, (celery_label,), {}, func=record._func(), dedup_key=key).key
    held = rc.get(lock)  # queued by the row's id (the middle field: the arguments' digest)
    assert held is not None and held.startswith(b"Q|") and held.endswith(envelope.id.encode())
    rc.delete(lock)

    rq_key = f"K-{uuid.uuid4().hex[:8]}"
    rq_row = pack(queue, rq_record, rq_label, job_timeout=77, result_ttl=123,
                  description="charge it", meta={"tenant": "t1"}, dedup_key=rq_key)
    Publisher(rq_connection=rc).publish(rq_row)
    job = queue.fetch_job(rq_row.id)
    assert job is not None
    assert (job.timeout, job.result_ttl, job.description) == (77, 123, "charge it")
    assert job.meta.get("tenant") == "t1"
    rq_lock = queue.dedup.identity("tests.outbox_apps.rq_record", queue.dedup_policy,
                                   (rq_label,), {}, func=rq_record, dedup_key=rq_key).key
    held = rc.get(rq_lock)
    assert held is not None and held.startswith(b"Q|") and held.endswith(rq_row.id.encode())


def test_rq_second_publish_of_an_alive_or_finished_job_enqueues_nothing(
    rc: redis.Redis, queue: DedupQueue
) -> None:
    envelope = pack(queue, rq_record, label())
    publisher = Publisher(rq_connection=rc)
    publisher.publish(envelope)
    publisher.publish(envelope)  # alive: the job itself
    assert rc.lrange(f"rq:queue:{queue.name}", 0, -1) == [envelope.id.encode()]


# -- the relay ------------------------------------------------------------------------------------


def insert(engine: sa.Engine, envelope: Envelope, age: float = 60.0) -> None:
    """A row as a producer that died after its commit left it (never published)."""
    statement, values = insert_row(envelope, datetime.now(UTC) - timedelta(seconds=age))
    with engine.begin() as conn:
        conn.execute(statement, values)


def test_relay_takes_rows_past_the_grace_only(
    engine: sa.Engine, queue: DedupQueue, rc: redis.Redis
) -> None:
    old, young = pack(queue, rq_record, label()), pack(queue, rq_record, label())
    insert(engine, old, age=30)
    insert(engine, young, age=1)
    relay = Relay(SqlRows(engine), Publisher(rq_connection=rc), grace=10)
    assert relay.run_once() == 1
    assert (published(rc, old.id), published(rc, young.id)) == (True, False)
    assert ids(engine) == [young.id]


def test_a_row_that_cannot_be_published_stays_backs_off_and_is_reported(
    engine: sa.Engine, queue: DedupQueue, rc: redis.Redis, celery_queue: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    unknown = Envelope(str(uuid.uuid4()), "celery", "outbox.gone",
                       json.dumps({"v": 1, "task": "outbox.gone"}))
    good = pack(queue, rq_record, label())
    insert(engine, unknown)
    insert(engine, good)
    relay = Relay(SqlRows(engine), Publisher(celery_app=outbox_apps.app, rq_connection=rc),
                  grace=0)
    with caplog.at_level(logging.WARNING, "taskdedup"):
        assert relay.run_once() == 2
    assert published(rc, good.id)
    assert ids(engine) == [unknown.id]
    assert unknown.id in caplog.text and "not registered" in caplog.text
    assert relay.run_once() == 0  # backed off: not taken again at once (no hot loop)
    (status,) = backlog(engine)
    assert (status.kind, status.target, status.rows, status.failing, status.attempts) == (
        "celery", "outbox.gone", 1, 1, 1)
    assert status.last_error is not None and "not registered" in status.last_error
    with engine.begin() as conn:  # its next attempt comes: tried again, pushed back further
        conn.execute(sa.update(OUTBOX).values(next_attempt=datetime.now(UTC)))
    assert relay.run_once() == 1
    with engine.connect() as conn:
        row = conn.execute(sa.select(OUTBOX)).one()
    assert row.attempts == 2
    wait = row.next_attempt.replace(tzinfo=UTC) - datetime.now(UTC)
    assert timedelta(seconds=0.5) < wait <= timedelta(seconds=2)


def test_an_rq_row_whose_queue_cannot_be_rebuilt_here_stays_and_says_why(
    engine: sa.Engine, queue: DedupQueue, rc: redis.Redis, caplog: pytest.LogCaptureFixture,
) -> None:
    """A job class, serializer or ``Policy.key`` the relay cannot import (the producer's code
    is not beside the relay, or was renamed) is a row that cannot be published: it stays,
    with the path in its error. Publishing it with RQ's default class, serializer or
    identity instead would give the job another class, or another lock key than the
    producer's (a second publish of it no longer runs once)."""
    broken = {"job_class": "tests.nowhere.Job", "serializer": "tests.nowhere.serializer",
              "policy.key": "tests.nowhere.key"}
    envelopes = []
    for field, path in broken.items():
        data = pack(queue, rq_record, label()).data()
        if field == "policy.key":
            data["policy"]["key"] = path
        else:
            data[field] = path
        envelopes.append(Envelope(str(uuid.uuid4()), "rq", queue.name, json.dumps(data)))
        insert(engine, envelopes[-1])
    relay = Relay(SqlRows(engine), Publisher(rq_connection=rc), grace=0)
    with caplog.at_level(logging.WARNING, "taskdedup"):
        assert relay.run_once() == 3
    assert ids(engine) == sorted(e.id for e in envelopes)  # every row stays
    assert not any(published(rc, e.id) for e in envelopes)
    assert rc.llen(f"rq:queue:{queue.name}") == 0
    with engine.connect() as conn:
        errors = dict(conn.execute(sa.select(OUTBOX.c.id, OUTBOX.c.last_error)).all())
    for envelope, path in zip(envelopes, broken.values(), strict=True):
        assert path in errors[envelope.id] and "does not import" in errors[envelope.id]
        assert envelope.id in caplog.text


# -- the CLI ---------------------------------------------------------------------------------------


def test_status_cli(engine: sa.Engine, queue: DedupQueue, tmp_path: Path) -> None:
    url = engine.url.render_as_string(hide_password=False)
    runner = CliRunner()
    out = runner.invoke(main, ["outbox", "status", "--url", url])
    assert (out.exit_code, out.output) == (0, "the outbox is empty\n")
    out = runner.invoke(main, ["outbox", "status", "--url", url, "--json"])
    assert (out.exit_code, json.loads(out.output)) == (
        0, {"rows": 0, "oldest_age_s": None, "failing": 0, "targets": []})
    for _ in range(2):
        insert(engine, pack(queue, rq_record, label()), age=90)
    insert(engine, pack(record, label()), age=5)
    with engine.begin() as conn:  # one of them failed once: counted at the top, for a probe
        conn.execute(sa.update(OUTBOX).where(OUTBOX.c.kind == "celery").values(
            attempts=1, last_error="LookupError: gone"))
    out = runner.invoke(main, ["outbox", "status", "--url", url, "--json"],
                        env={"TASKDEDUP_SQL_URL": None})
    report = json.loads(out.output)
    assert out.exit_code == 0 and report["rows"] == 3 and 89 < report["oldest_age_s"] < 120
    assert report["failing"] == 1
    assert [(t["kind"], t["target"], t["rows"], t["failing"]) for t in report["targets"]] == [
        ("celery", "outbox.record", 1, 1), ("rq", queue.name, 2, 0)]
    out = runner.invoke(main, ["outbox", "status"], env={"TASKDEDUP_SQL_URL": url})
    assert out.exit_code == 0 and "3 rows, the oldest" in out.output
    assert queue.name in out.output and "outbox.record" in out.output
    missing = f"sqlite:///{tmp_path / 'none.sqlite'}"
    out = runner.invoke(main, ["outbox", "status", "--url", missing])
    assert out.exit_code == 1 and "no such table" in out.output
    out = runner.invoke(main, ["outbox", "status", "--url",
                               "postgresql://nobody@127.0.0.1:1/none"])
    assert out.exit_code == 1 and "OperationalError" in out.output
    out = runner.invoke(main, ["outbox", "status"], env={"TASKDEDUP_SQL_URL": None})
    assert out.exit_code == 1 and "no database URL" in out.output


def test_relay_cli_once_publishes_rq_and_celery_rows(
    engine: sa.Engine, queue: DedupQueue, rc: redis.Redis, redis_url: str, celery_queue: str
) -> None:
    rq_row, celery_row = pack(queue, rq_record, label()), pack(record, label())
    insert(engine, rq_row)
    insert(engine, celery_row)
    url = engine.url.render_as_string(hide_password=False)
    out = CliRunner().invoke(main, ["outbox", "relay", "--url", url, "--once", "--grace", "0"],
                             env={"CELERY_APP": "tests.outbox_apps", "RQ_REDIS_URL": redis_url})
    assert (out.exit_code, out.output) == (0, "took 2 rows\n"), out.output
    assert published(rc, rq_row.id)
    assert celery_row.id.encode() in b"".join(rc.lrange(celery_queue, 0, -1))
    assert ids(engine) == []
    out = CliRunner().invoke(main, ["outbox", "relay", "--url", url, "--once"],
                             env={"CELERY_APP": None, "RQ_REDIS_URL": None})
    assert out.exit_code == 1 and "nothing to publish with" in out.output
    rc.delete(celery_queue)


def test_relay_cli_takes_the_lock_store_from_the_global_url(
    engine: sa.Engine, queue: DedupQueue, rc: redis.Redis, redis_url: str
) -> None:
    """``taskdedup --url STORE outbox relay``: the RQ rows' locks go to STORE (as
    ``TASKDEDUP_URL`` would send them), the jobs to ``RQ_REDIS_URL``; without it, to RQ's
    own Redis."""
    store_url = redis_url.rsplit("/", 1)[0] + "/13"
    store = redis.Redis.from_url(store_url)
    store.flushdb()
    apart, together = label(), label()
    rows = {apart: pack(queue, rq_record, apart), together: pack(queue, rq_record, together)}
    keys = {name: queue.dedup.identity("tests.outbox_apps.rq_record", queue.dedup_policy,
                                       (name,), {}, func=rq_record).key for name in rows}
    url = engine.url.render_as_string(hide_password=False)
    env = {"TASKDEDUP_URL": None, "CELERY_APP": None, "RQ_REDIS_URL": redis_url}
    for name, prefix in ((apart, ["--url", store_url]), (together, [])):
        insert(engine, rows[name])
        out = CliRunner().invoke(main, [*prefix, "outbox", "relay", "--url", url, "--once",
                                        "--grace", "0"], env=env)
        assert (out.exit_code, out.output) == (0, "took 1 row\n"), out.output
        assert published(rc, rows[name].id)
    try:
        assert store.get(keys[apart]) is not None and rc.get(keys[apart]) is None
        assert store.get(keys[together]) is None and rc.get(keys[together]) is not None
    finally:
        store.flushdb()
        rc.delete(keys[together])


def test_sql_init_creates_both_tables(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'both.sqlite'}")
    url = engine.url.render_as_string(hide_password=False)
    out = CliRunner().invoke(main, ["sql", "init", "--url", url])
    assert (out.exit_code, out.output) == (0, "created taskdedup_effects, taskdedup_outbox\n")
    names = {i["name"] for i in sa.inspect(engine).get_indexes("taskdedup_outbox")}
    assert names == {"ix_taskdedup_outbox_next_attempt"}
    from taskdedup.sql import outbox_table, table

    metadata = sa.MetaData()
    assert table(metadata).name == "taskdedup_effects"
    assert outbox_table(metadata) is outbox_table(metadata)
    assert [c.name for c in outbox_table(metadata).columns] == [
        "id", "kind", "target", "body", "created", "next_attempt", "attempts", "last_error"]
    engine.dispose()


def test_a_lock_its_own_id_holds_with_no_message_behind_it_is_published(
    rc: redis.Redis, queue: DedupQueue, celery_queue: str
) -> None:
    """A producer killed between its reservation and its push leaves its id's lock queued
    and nothing in the broker: the relay's publish is never dropped as a duplicate of
    itself."""
    from taskdedup.celery import get_deduplicator

    celery_label, rq_label = label(), label()
    celery_row, rq_row = pack(record, celery_label), pack(queue, rq_record, rq_label)
    celery_key = get_deduplicator(outbox_apps.app).identity(
        record.name, POLICY, (celery_label,), {}, func=record._func()).key
    rq_key = queue.dedup.identity("tests.outbox_apps.rq_record", POLICY, (rq_label,), {},
                                  func=rq_record).key
    rc.set(celery_key, f"Q||{celery_row.id}", px=60_000)
    rc.set(rq_key, f"Q||{rq_row.id}", px=60_000)
    publisher = Publisher(celery_app=outbox_apps.app, rq_connection=rc)
    publisher.publish(celery_row)
    publisher.publish(rq_row)
    assert celery_row.id.encode() in rc.lindex(celery_queue, 0)  # type: ignore[operator]
    assert rc.lrange(f"rq:queue:{queue.name}", 0, -1) == [rq_row.id.encode()]
    assert rc.get(rq_key) == f"Q||{rq_row.id}".encode()
    rc.delete(celery_queue)


def test_a_session_closed_without_commit_carries_nothing_into_its_next_transaction(
    engine: sa.Engine, queue: DedupQueue, rc: redis.Redis
) -> None:
    session = Session(engine)
    try:
        forgotten = outbox.add(session, queue, rq_record, label())
        session.close()  # no commit: rolled back
        with session.begin():
            committed = outbox.add(session, queue, rq_record, label())
    finally:
        session.close()
    assert (published(rc, forgotten), published(rc, committed)) == (False, True)
    assert ids(engine) == []
