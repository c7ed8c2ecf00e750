"""What the committing process sends after its commit (SPEC §14, DESIGN): one gated publish
per row — one round trip to Redis — then one ``DELETE`` of the published rows, for Celery and
RQ calls, from a sync ``Connection`` and from an asyncio ``AsyncConnection``.

Celery: a default app (the locks in the broker's Redis) publishes each row in one EVALSHA,
the fused push. RQ: one EVALSHA per row too — an outbox row always gives its job id, and
``DedupQueue.enqueue_call`` reads that job's status inside the fused enqueue script (the
guard of ``enqueue.lua``), not with an ``HGET`` of its own before it.

Round trips are counted at redis-py's socket writes (``send_packed_command``: one per command
outside a pipeline, one per pipeline), from the test's thread only; the DELETE at the one
function that sends it on the idle DBAPI connection.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from redis.connection import AbstractConnection
from sqlalchemy.ext.asyncio import create_async_engine

from taskdedup import Policy
from taskdedup.celery import DedupTask
from taskdedup.rq import DedupQueue
from taskdedup.sql import init, outbox
from taskdedup.sql import outbox as sql_outbox_module
from taskdedup.sql.schema import OUTBOX
from tests.outbox_apps import rq_record
from tests.sqldb import DIALECTS, postgres_url

ROWS = 3


class Sends:
    """Counts redis-py's socket writes from the main thread, and the outbox's DELETEs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.redis: list[Any] = []
        self.deletes: list[int] = []
        original = AbstractConnection.send_packed_command
        delete_raw = sql_outbox_module._delete_raw

        def counting(conn: AbstractConnection, command: Any, check_health: bool = True) -> None:
            if threading.current_thread() is threading.main_thread():
                packed = b"".join(command) if isinstance(command, list) else bytes(command)
                name = packed.split(b"\r\n")[2].decode()  # the command's name
                # an earlier test's Celery AsyncResult, garbage-collected in this thread,
                # unsubscribes from its result: not a publish
                if name.upper() != "UNSUBSCRIBE":
                    self.redis.append(name)
            original(conn, command, check_health)

        def deleting(dialect: Any, dbapi_connection: Any, ids: Any) -> None:
            self.deletes.append(len(ids))
            delete_raw(dialect, dbapi_connection, ids)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
        monkeypatch.setattr(sql_outbox_module, "_delete_raw", deleting)

    def clear(self) -> None:
        self.redis.clear()
        self.deletes.clear()


@pytest.fixture(params=DIALECTS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    plain = (f"sqlite:///{tmp_path / 'db.sqlite'}" if request.param == "sqlite"
             else postgres_url())
    engine = sa.create_engine(plain)
    with engine.begin() as conn:
        OUTBOX.drop(conn, checkfirst=True)
    init(engine)
    engine.dispose()
    yield plain


def left(url: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(OUTBOX)).scalar_one())
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def celery_app(redis_url: str) -> Iterator[Celery]:
    """A default app: broker and locks in one Redis, so gated publishes are fused."""
    app = Celery("roundtrips", broker=redis_url, set_as_current=False)
    app.conf.update(task_default_queue=f"rt-c-{uuid.uuid4().hex[:8]}", task_ignore_result=True,
                    taskdedup_stats=False)

    @app.task(base=DedupTask, dedup=Policy(ttl=600), name="rt.record", shared=False)
    def record(label: str) -> None:
        """Never run: the test counts what publishing it costs."""

    yield app
    app.close()


def calls(kind: str, rc: redis.Redis, app: Celery) -> Any:
    """A function adding one call of ``kind`` to a connection (a fresh label each time)."""
    queue = DedupQueue(f"rt-{uuid.uuid4().hex[:8]}", connection=rc)
    task = app.tasks["rt.record"]

    def add(conn: Any) -> Any:
        name = f"rt-{uuid.uuid4().hex[:10]}"
        if kind == "celery":
            return outbox.add(conn, task.s(name))
        return outbox.add(conn, queue, rq_record, name)

    return add


KINDS = ["celery", "rq"]


def test_rq_costs_the_fused_enqueue_alone_per_row(
    url: str, rc: redis.Redis, celery_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the RQ publish sends: the fused script and nothing else (no status read first)."""
    engine = sa.create_engine(url)
    add = calls("rq", rc, celery_app)
    with engine.begin() as conn:
        add(conn)
    sends = Sends(monkeypatch)
    try:
        with engine.begin() as conn:
            for _ in range(ROWS):
                add(conn)
        assert sends.redis == ["EVALSHA"] * ROWS
        assert sends.deletes == [ROWS]
    finally:
        engine.dispose()


@pytest.mark.parametrize("kind", KINDS)
def test_the_publish_after_a_sync_commit_is_one_round_trip_per_row_and_one_delete(
    url: str, kind: str, rc: redis.Redis, celery_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = sa.create_engine(url)
    add = calls(kind, rc, celery_app)
    with engine.begin() as conn:  # warm up: connections, scripts loaded, queue declared
        add(conn)
    sends = Sends(monkeypatch)
    try:
        with engine.begin() as conn:
            for _ in range(ROWS):
                add(conn)
            assert sends.redis == []  # nothing before the commit
        assert len(sends.redis) == ROWS, sends.redis
        assert sends.deletes == [ROWS]
    finally:
        engine.dispose()
    assert left(url) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_the_publish_after_an_async_commit_is_one_round_trip_per_row_and_one_delete(
    url: str, kind: str, rc: redis.Redis, celery_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    aurl = url.replace("sqlite:", "sqlite+aiosqlite:")
    add = calls(kind, rc, celery_app)

    async def main() -> None:
        engine = create_async_engine(aurl)
        try:
            async with engine.begin() as conn:
                await conn.run_sync(add)  # warm up
            sends = Sends(monkeypatch)
            async with engine.begin() as conn:
                for _ in range(ROWS):
                    await conn.run_sync(add)
                assert sends.redis == []
            assert len(sends.redis) == ROWS, sends.redis
            assert sends.deletes == [ROWS]
        finally:
            await engine.dispose()

    asyncio.run(main())
    assert left(url) == 0
