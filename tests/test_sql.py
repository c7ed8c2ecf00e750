"""The durable tier (taskdedup.sql) against real databases: SQLite files and a real
PostgreSQL server started by the test session (see :mod:`tests.sqldb`).

Covered here: first / not first, the stored result read back by a later run, the key and ttl
taken from the running task, ConfigurationError outside a task, expiry (a row past it no longer
counts; prune deletes it in batches), Core Connection and ORM Session, ``table(metadata)`` for
Alembic, the ``taskdedup sql`` commands, and two processes racing for one identity (PostgreSQL:
the second waits on the index; SQLite: on the database lock). Real workers: test_sql_workers.py;
SIGKILLed workers: test_sql_faults.py.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.orm import Session

from taskdedup import ConfigurationError, running
from taskdedup.cli import main
from taskdedup.running import Running
from taskdedup.sql import DEFAULT_TTL, TABLE_NAME, effects, prune, table
from taskdedup.sql.statements import for_dialect
from taskdedup.testing import wait_for
from tests import sqldb
from tests.sqldb import EFFECTS, LEDGER, fresh_engine, rows

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture(params=sqldb.DIALECTS)
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sa.Engine]:
    engine = fresh_engine(request.param, tmp_path)
    yield engine
    engine.dispose()


@pytest.fixture
def task() -> Iterator[Running]:
    """A gated task running in this context, as a Celery/RQ worker marks it."""
    now = Running("payments.charge", f"tid-{uuid.uuid4().hex[:8]}",
                  f"taskdedup:payments.charge:{uuid.uuid4().hex}", 600.0)
    token = running.enter(now)
    yield now
    running.leave(token)


def charge(conn: sa.Connection | Session, order_id: str, cents: int, **kw: Any) -> Any:
    """The SPEC's body: the ledger row and the identity commit together, once."""
    with effects(conn, **kw) as fx:
        if not fx.first:
            return fx.result
        conn.execute(LEDGER.insert().values(order_id=order_id, cents=cents,
                                            task_id=fx.task_id))
        fx.result = {"charged": cents}
        return fx.result


# -- first, not first, result ----------------------------------------------------------------


def test_first_run_records_and_a_later_run_reads_its_result(
    engine: sa.Engine, task: Running
) -> None:
    with engine.begin() as conn:
        assert charge(conn, "ORD-1", 500) == {"charged": 500}
    with engine.begin() as conn, effects(conn) as fx:
        assert (fx.first, fx.task_id, fx.result, fx.key) == (
            False, task.task_id, {"charged": 500}, task.key)
    (row,) = rows(engine)
    assert (row.key, row.task_id, row.result) == (task.key, task.task_id, {"charged": 500})
    assert len(rows(engine, LEDGER)) == 1


def test_redelivered_run_with_another_id_gets_the_first_runs_id_and_result(
    engine: sa.Engine, task: Running
) -> None:
    with engine.begin() as conn:
        charge(conn, "ORD-2", 700)
    token = running.enter(Running(task.task, "tid-redelivered", task.key, task.ttl))
    try:
        with engine.begin() as conn:
            assert charge(conn, "ORD-2", 700) == {"charged": 700}
            with effects(conn) as fx:
                assert not fx.first and fx.task_id == task.task_id
    finally:
        running.leave(token)
    assert [r.order_id for r in rows(engine, LEDGER)] == ["ORD-2"]


def test_first_without_result_stores_null_and_later_runs_read_none(
    engine: sa.Engine, task: Running
) -> None:
    with engine.begin() as conn, effects(conn) as fx:
        assert fx.first and fx.result is None
    with engine.begin() as conn, effects(conn) as fx:
        assert not fx.first and fx.result is None and fx.task_id == task.task_id


def test_rolled_back_transaction_records_nothing(engine: sa.Engine, task: Running) -> None:
    with pytest.raises(RuntimeError, match="boom"), engine.begin() as conn:
        with effects(conn) as fx:
            assert fx.first
            fx.result = {"charged": 1}
            raise RuntimeError("boom")
    assert rows(engine) == []
    with engine.begin() as conn, effects(conn) as fx:
        assert fx.first  # the next delivery does the work


def test_block_that_raises_writes_no_result_even_if_the_caller_commits(
    engine: sa.Engine, task: Running
) -> None:
    with engine.begin() as conn:
        try:
            with effects(conn) as fx:
                fx.result = {"charged": 1}
                raise ValueError("failed half-way")
        except ValueError:
            pass  # the caller swallows it and commits: only the claim itself was written
    (row,) = rows(engine)
    assert row.result is None


def test_result_is_json_and_only_the_first_run_sets_it(engine: sa.Engine, task: Running) -> None:
    with engine.begin() as conn, effects(conn) as fx:
        with pytest.raises(TypeError, match="JSON"):
            fx.result = object()
        fx.result = {"n": [1, 2.5, "x", None, True]}
    with engine.begin() as conn, effects(conn) as fx:
        with pytest.raises(ConfigurationError, match="first run"):
            fx.result = {"other": 1}
        assert fx.result == {"n": [1, 2.5, "x", None, True]}


@pytest.mark.parametrize(
    "value",
    [math.nan, math.inf, -math.inf, {"a": [1, {"b": math.nan}]}, [1.5, math.inf]],
    ids=["nan", "inf", "-inf", "nested-nan", "nested-inf"],
)
def test_nan_and_infinity_in_a_result_are_refused_when_set(
    engine: sa.Engine, task: Running, value: Any
) -> None:
    """SQLite would store NaN; PostgreSQL fails the whole transaction at the block's end, on
    every retry. Refused at once, nothing stored."""
    with engine.begin() as conn, effects(conn) as fx:
        with pytest.raises(ValueError, match="NaN and Infinity"):
            fx.result = value
        assert fx.result is None
    (row,) = rows(engine)
    assert row.result is None


def test_orm_session_records_in_its_transaction(engine: sa.Engine, task: Running) -> None:
    with Session(engine) as session, session.begin():
        assert charge(session, "ORD-S", 300) == {"charged": 300}
    with Session(engine) as session:
        with effects(session) as fx:
            assert not fx.first and fx.result == {"charged": 300}
        session.rollback()
    with Session(engine) as session, session.begin():
        session.execute(sa.delete(EFFECTS))
    with Session(engine) as session:  # a rolled-back session records nothing
        with effects(session) as fx:
            assert fx.first
        session.rollback()
    assert rows(engine) == []


# -- the key and ttl -------------------------------------------------------------------------


def test_key_defaults_to_the_running_task_and_ttl_to_seven_days(
    engine: sa.Engine, task: Running
) -> None:
    """The row outlives every redelivery: its lifetime is not the policy's Redis window (600 s
    here, while kombu redelivers an unacked message after 3600 s)."""
    assert DEFAULT_TTL == 7 * 24 * 3600
    before = datetime.now(UTC)
    with engine.begin() as conn, effects(conn) as fx:
        assert fx.key == task.key and fx.task_id == task.task_id
    (row,) = rows(engine)
    window = _aware(row.expires) - _aware(row.created)
    assert window == timedelta(days=7) != timedelta(seconds=task.ttl)
    assert _aware(row.created) >= before - timedelta(seconds=1)


def test_outside_a_task_key_is_required_and_ttl_defaults_to_seven_days(engine: sa.Engine) -> None:
    assert running.current() is None
    with engine.begin() as conn:
        with pytest.raises(ConfigurationError, match="outside a gated Celery/RQ task needs key"):
            with effects(conn):
                pass
        with effects(conn, key="webhook:evt_1") as fx:
            assert fx.first and fx.task_id is None
        with effects(conn, key="webhook:evt_2", ttl=timedelta(minutes=5)):
            pass
    windows = {r.key: _aware(r.expires) - _aware(r.created) for r in rows(engine)}
    assert windows == {"webhook:evt_1": timedelta(seconds=DEFAULT_TTL),
                       "webhook:evt_2": timedelta(minutes=5)}


def test_explicit_key_inside_a_task_overrides_the_running_identity(
    engine: sa.Engine, task: Running
) -> None:
    with engine.begin() as conn, effects(conn, key="refund:ORD-9", ttl=30) as fx:
        assert fx.key == "refund:ORD-9" and fx.task_id == task.task_id
    assert [r.key for r in rows(engine)] == ["refund:ORD-9"]


def test_bad_arguments_are_configuration_errors(engine: sa.Engine, task: Running) -> None:
    with engine.begin() as conn:
        for ttl in (0, -1, timedelta(0), math.nan, math.inf):
            with pytest.raises(ConfigurationError, match="positive"), effects(conn, ttl=ttl):
                pass
        for ttl in (1e17, timedelta.max):
            with pytest.raises(ConfigurationError, match="at most"), effects(conn, ttl=ttl):
                pass
    with pytest.raises(ConfigurationError, match="not Engine"), effects(engine):  # type: ignore[arg-type]
        pass
    with pytest.raises(ConfigurationError, match=r"supports PostgreSQL .* and SQLite.*'mysql'"):
        for_dialect("mysql")


# -- AUTOCOMMIT: the claim would commit before the work ---------------------------------------


def test_autocommit_connection_is_refused_before_anything_is_written(
    engine: sa.Engine, task: Running
) -> None:
    """The claim would commit on its own: a failed run's retry would not be first and skip
    the work. Refused at once, whichever way AUTOCOMMIT was asked for."""
    auto = sa.create_engine(engine.url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as plain:
            options = plain.execution_options(isolation_level="AUTOCOMMIT")
            with pytest.raises(ConfigurationError, match="AUTOCOMMIT"), effects(options):
                pass
        with auto.connect() as conn:
            with pytest.raises(ConfigurationError, match="AUTOCOMMIT"), effects(conn):
                pass
        with Session(auto) as session:
            with pytest.raises(ConfigurationError, match="AUTOCOMMIT"), effects(session):
                pass
        with engine.connect() as plain:
            bound = plain.execution_options(isolation_level="AUTOCOMMIT")
            with Session(bind=bound) as session:
                with pytest.raises(ConfigurationError, match="AUTOCOMMIT"), effects(session):
                    pass
    finally:
        auto.dispose()
    assert rows(engine) == []
    # an explicit other isolation level on the same engine is fine
    with engine.connect() as plain:
        level = "SERIALIZABLE"
        with plain.execution_options(isolation_level=level).begin() as conn_tx:
            assert conn_tx.is_active
            with effects(plain) as fx:
                assert fx.first
    assert len(rows(engine)) == 1


# -- the row's lifetime against the broker's redelivery delay -------------------------------


def test_a_row_shorter_than_the_redelivery_delay_warns_once_per_task(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    name = f"payments.warn_{uuid.uuid4().hex[:6]}"

    def run(task_name: str, redelivery: float | None, **kw: Any) -> None:
        now = Running(task_name, f"tid-{uuid.uuid4().hex[:6]}",
                      f"taskdedup:{task_name}:{uuid.uuid4().hex}", 600.0, redelivery=redelivery)
        token = running.enter(now)
        try:
            with engine.begin() as conn, effects(conn, **kw):
                pass
        finally:
            running.leave(token)

    def warnings() -> list[logging.LogRecord]:
        return [r for r in caplog.records
                if r.levelno == logging.WARNING and r.name == "taskdedup"]

    caplog.set_level(logging.WARNING, logger="taskdedup")
    run(name, 3660.0)  # the default 7 days outlive visibility_timeout 3600 s + lease 60 s
    run(name, None)  # a broker that does not redeliver by time
    run(name, 3660.0, ttl=3660)
    assert warnings() == []
    run(name, 3660.0, ttl=600)
    (warned,) = warnings()
    message = warned.getMessage()
    assert name in message and "600" in message and "3660" in message
    assert "ttl" in message
    run(name, 3660.0, ttl=60)  # once per process and task
    run(name, 3660.0, ttl=600)
    assert len(warnings()) == 1
    run(name + "_other", 3660.0, ttl=600)
    assert len(warnings()) == 2


# -- expiry and prune ------------------------------------------------------------------------


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)  # SQLite returns naive UTC


def _past(engine: sa.Engine, key: str) -> None:
    """Wait until the row of ``key`` is past its expiry (by the clock effects uses)."""
    (expires,) = [_aware(r.expires) for r in rows(engine) if r.key == key]
    wait_for(lambda: datetime.now(UTC) > expires, timeout=5, what="row expired")


def test_a_row_past_its_expiry_no_longer_counts_and_is_taken_over(
    engine: sa.Engine, task: Running
) -> None:
    with engine.begin() as conn:
        charge(conn, "ORD-E", 100, ttl=0.05)
    _past(engine, task.key)
    token = running.enter(Running(task.task, "tid-later", task.key, task.ttl))
    try:
        with engine.begin() as conn, effects(conn) as fx:
            assert fx.first and fx.task_id == "tid-later" and fx.result is None
    finally:
        running.leave(token)
    (row,) = rows(engine)  # the same row, taken over: new owner, new window, no old result
    assert (row.task_id, row.result) == ("tid-later", None)
    assert _aware(row.expires) - _aware(row.created) == timedelta(seconds=DEFAULT_TTL)


def test_prune_deletes_expired_rows_in_batches_and_keeps_live_ones(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        for n in range(25):
            with effects(conn, key=f"old-{n}", ttl=0.01):
                pass
        for n in range(3):
            with effects(conn, key=f"live-{n}", ttl=600):
                pass
    for n in range(25):
        _past(engine, f"old-{n}")
    deletes: list[int] = []

    @sa.event.listens_for(engine, "after_execute")
    def count(conn: Any, clause: Any, multiparams: Any, params: Any, options: Any,
              result: Any) -> None:
        if isinstance(clause, sa.Delete):
            deletes.append(result.rowcount)

    assert prune(engine, batch=10) == 25
    assert deletes == [10, 10, 5]  # one short transaction per batch
    assert sorted(r.key for r in rows(engine)) == ["live-0", "live-1", "live-2"]
    assert prune(engine, batch=10) == 0


# -- table(metadata), the commands -----------------------------------------------------------


def test_table_for_alembic_is_the_definition_effects_uses(engine: sa.Engine) -> None:
    metadata = sa.MetaData()
    t = table(metadata)
    assert t is table(metadata) and t.name == TABLE_NAME
    assert [c.name for c in t.primary_key] == ["key"]
    assert {c.name for c in t.columns} == {"key", "task_id", "created", "expires", "result"}
    assert [[c.name for c in ix.columns] for ix in t.indexes] == [["expires"]]
    with engine.begin() as conn:  # a table created from it (as a migration would) works
        metadata.drop_all(conn)
        metadata.create_all(conn)
        with effects(conn, key="k") as fx:
            assert fx.first
        with effects(conn, key="k") as fx:
            assert not fx.first
    names = {ix["name"] for ix in sa.inspect(engine).get_indexes(TABLE_NAME)}
    assert f"ix_{TABLE_NAME}_expires" in names


def test_sql_init_is_idempotent_and_prune_reports_what_it_deleted(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = engine.url.render_as_string(hide_password=False)
    runner = CliRunner()
    with engine.begin() as conn:
        EFFECTS.drop(conn)
        conn.exec_driver_sql("DROP TABLE IF EXISTS taskdedup_outbox")
    out = runner.invoke(main, ["sql", "init", "--url", url], catch_exceptions=False)
    assert (out.exit_code, out.output) == (0, f"created {TABLE_NAME}, taskdedup_outbox\n")
    monkeypatch.setenv("TASKDEDUP_SQL_URL", url)
    out = runner.invoke(main, ["sql", "init"], catch_exceptions=False)
    assert (out.exit_code, out.output) == (
        0, f"{TABLE_NAME} and taskdedup_outbox exist: nothing to do\n")
    with engine.begin() as conn:
        for n in range(3):
            with effects(conn, key=f"gone-{n}", ttl=0.01):
                pass
    for n in range(3):
        _past(engine, f"gone-{n}")
    out = runner.invoke(main, ["sql", "prune", "--batch", "2"], catch_exceptions=False)
    assert (out.exit_code, out.output) == (0, "deleted 3 expired rows\n")


def test_sql_commands_say_what_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    monkeypatch.delenv("TASKDEDUP_SQL_URL", raising=False)
    out = runner.invoke(main, ["sql", "init"])
    assert out.exit_code == 1 and "no database URL" in out.output
    out = runner.invoke(main, ["sql", "init", "--url", "mysql://db/app"])
    assert out.exit_code == 1 and "supports PostgreSQL (psycopg 3) and SQLite" in out.output
    out = runner.invoke(main, ["sql", "prune", "--url", "sqlite:////nonexistent/dir/x.db"])
    assert out.exit_code == 1 and "OperationalError" in out.output
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # as if it were not installed
    out = runner.invoke(main, ["sql", "init", "--url", "sqlite://"])
    assert out.exit_code == 1 and "pip install 'taskdedup[sql]'" in out.output


# -- two processes, one identity -------------------------------------------------------------


class Claimer:
    """A spawned process running :func:`tests.sqldb.claimer`."""

    def __init__(self, url: str, key: str, task_id: str, **connect_args: Any) -> None:
        self.inbox, self.outbox = SPAWN.Queue(), SPAWN.Queue()
        self.process = SPAWN.Process(target=sqldb.claimer, args=(
            url, key, task_id, self.inbox, self.outbox, connect_args), daemon=True)
        self.process.start()
        self.backend_pid = self.expect("ready")[1]

    def expect(self, what: str, timeout: float = 60) -> tuple[Any, ...]:
        message = self.outbox.get(timeout=timeout)
        assert message[0] == what, message
        return tuple(message)

    def send(self, command: str) -> None:
        self.inbox.put(command)

    def close(self) -> None:
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


def _waiting_on_lock(engine: sa.Engine, backend_pid: int) -> bool:
    with engine.connect() as conn:
        return conn.execute(sa.text(
            "select wait_event_type from pg_stat_activity where pid = :pid"
        ), {"pid": backend_pid}).scalar() == "Lock"


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_postgresql_second_run_waits_on_the_index_until_the_first_ends(
    tmp_path: Path, outcome: str
) -> None:
    engine = fresh_engine("postgresql", tmp_path)
    url = engine.url.render_as_string(hide_password=False)
    key = f"race-{uuid.uuid4().hex[:8]}"
    a = Claimer(url, key, "tid-a")
    b = Claimer(url, key, "tid-b")
    try:
        a.send("claim")
        a.expect("claiming")
        assert a.expect("claimed")[1:4] == (True, "tid-a", None)
        b.send("claim")
        b.expect("claiming")
        wait_for(lambda: _waiting_on_lock(engine, b.backend_pid), timeout=20,
                 what="the second run waiting on the first's row")
        a.send(outcome)
        ended_at = a.expect("ending")[1]
        a.expect("ended")
        _, first, task_id, result, claimed_at = b.expect("claimed")
        assert claimed_at > ended_at  # it answered only once the first had ended
        if outcome == "commit":
            assert (first, task_id, result) == (False, "tid-a", {"by": "tid-a"})
        else:
            assert (first, task_id, result) == (True, "tid-b", None)
        b.send("commit")
        b.expect("ending")
        b.expect("ended")
    finally:
        a.close()
        b.close()
    (row,) = rows(engine)
    assert row.task_id == ("tid-a" if outcome == "commit" else "tid-b")
    engine.dispose()


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_sqlite_second_writer_waits_on_the_database_lock_then_sees_the_first(
    tmp_path: Path, outcome: str
) -> None:
    engine = fresh_engine("sqlite", tmp_path)
    url = str(engine.url)
    key = f"race-{uuid.uuid4().hex[:8]}"
    a = Claimer(url, key, "tid-a")
    b = Claimer(url, key, "tid-b", timeout=30.0)  # sqlite3's busy timeout, seconds
    try:
        a.send("claim")
        a.expect("claiming")
        assert a.expect("claimed")[1] is True
        b.send("claim")
        b.expect("claiming")
        a.send(outcome)
        ended_at = a.expect("ending")[1]
        a.expect("ended")
        _, first, task_id, result, claimed_at = b.expect("claimed")
        assert claimed_at > ended_at
        if outcome == "commit":
            assert (first, task_id, result) == (False, "tid-a", {"by": "tid-a"})
        else:
            assert (first, task_id, result) == (True, "tid-b", None)
        b.send("commit")
        b.expect("ending")
    finally:
        a.close()
        b.close()
    assert len(rows(engine)) == 1


def test_sqlite_second_writer_past_its_busy_timeout_fails_database_is_locked(
    tmp_path: Path
) -> None:
    engine = fresh_engine("sqlite", tmp_path)
    a = Claimer(str(engine.url), "k", "tid-a")
    b = Claimer(str(engine.url), "k", "tid-b", timeout=0.2)
    try:
        a.send("claim")
        a.expect("claiming")
        a.expect("claimed")
        b.send("claim")
        b.expect("claiming")
        _, error = b.expect("error")  # while the first still holds the database lock
        assert "database is locked" in error
        a.send("commit")
        a.expect("ending")
        a.expect("ended")
    finally:
        a.close()
        b.close()
    (row,) = rows(engine)
    assert row.task_id == "tid-a"


def test_result_of_a_stored_row_is_plain_json(engine: sa.Engine, task: Running) -> None:
    with engine.begin() as conn:
        charge(conn, "ORD-J", 42)
    with engine.connect() as conn:
        raw = conn.execute(sa.select(sa.cast(EFFECTS.c.result, sa.Text))).scalar()
    assert json.loads(raw) == {"charged": 42}

