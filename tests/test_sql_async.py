"""The asyncio forms of the durable tier: ``async with effects(aconn)`` and ``await
outbox.add(aconn, ...)`` on ``AsyncConnection`` and ``AsyncSession`` — on a real PostgreSQL
through psycopg 3's async driver (``postgresql+psycopg://`` with ``create_async_engine``) and
on SQLite through aiosqlite.

Each test runs its coroutine with ``asyncio.run`` (no pytest plugin needed). A published RQ
call is a job hash in Redis; a published Celery call a message in the test's queue.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from taskdedup import ConfigurationError, running
from taskdedup.rq import DedupQueue
from taskdedup.running import Running
from taskdedup.sql import effects, init, outbox
from taskdedup.sql.outbox_async import add as add_async
from taskdedup.sql.schema import OUTBOX, TABLE
from tests import outbox_apps
from tests.outbox_apps import record, rq_record
from tests.sqldb import DIALECTS, postgres_url


def sync_url(dialect: str, directory: Path) -> str:
    return f"sqlite:///{directory / 'db.sqlite'}" if dialect == "sqlite" else postgres_url()


def async_url(dialect: str, directory: Path) -> str:
    if dialect == "sqlite":
        return f"sqlite+aiosqlite:///{directory / 'db.sqlite'}"
    return postgres_url()  # postgresql+psycopg://: create_async_engine picks psycopg's async


@pytest.fixture(params=DIALECTS)
def urls(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Fresh tables (effects and outbox); the sync URL (for checks) and the async one."""
    plain = sa.create_engine(sync_url(request.param, tmp_path))
    with plain.begin() as conn:
        OUTBOX.drop(conn, checkfirst=True)
        TABLE.drop(conn, checkfirst=True)
    init(plain)
    plain.dispose()
    yield sync_url(request.param, tmp_path), async_url(request.param, tmp_path)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def engine_for(url: str, **kwargs: Any) -> AsyncEngine:
    return create_async_engine(url, **kwargs)


def table_rows(url: str, t: sa.Table) -> list[Any]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.select(t)))
    finally:
        engine.dispose()


@pytest.fixture
def queue(rc: redis.Redis) -> DedupQueue:
    return DedupQueue(f"aobx-{uuid.uuid4().hex[:8]}", connection=rc)


@pytest.fixture(scope="module")
def celery_queue(redis_url: str) -> str:
    name = f"aobx-c-{uuid.uuid4().hex[:8]}"
    outbox_apps.configure(redis_url, name)
    return name


def published(rc: redis.Redis, job_id: str) -> bool:
    return bool(rc.exists(f"rq:job:{job_id}"))


def label() -> str:
    return f"A-{uuid.uuid4().hex[:10]}"


# -- effects ----------------------------------------------------------------------------------


@pytest.mark.parametrize("front", ["connection", "session"])
def test_async_effects_first_run_records_and_a_later_run_reads_its_result(
    urls: tuple[str, str], front: str
) -> None:
    plain, url = urls
    key = f"order:{label()}"

    async def once(value: int) -> tuple[bool, Any]:
        engine = await engine_for(url)
        try:
            if front == "connection":
                async with engine.begin() as conn, effects(conn, key=key) as fx:
                    if fx.first:
                        fx.result = {"charged": value}
                    return fx.first, fx.result
            async with AsyncSession(engine) as session, session.begin():
                async with effects(session, key=key) as fx:
                    if fx.first:
                        fx.result = {"charged": value}
                    return fx.first, fx.result
        finally:
            await engine.dispose()

    assert run(once(100)) == (True, {"charged": 100})
    assert run(once(200)) == (False, {"charged": 100})  # the first run's, not redone
    [row] = table_rows(plain, TABLE)
    assert (row.key, row.result) == (key, {"charged": 100})


def test_async_effects_rolled_back_with_the_work_leaves_the_next_run_first(
    urls: tuple[str, str],
) -> None:
    plain, url = urls
    key = f"order:{label()}"

    async def main() -> bool:
        engine = await engine_for(url)
        try:
            with pytest.raises(RuntimeError, match="work failed"):
                async with engine.begin() as conn, effects(conn, key=key) as fx:
                    assert fx.first
                    fx.result = {"charged": 1}
                    raise RuntimeError("work failed")
            assert table_rows(plain, TABLE) == []
            async with engine.begin() as conn, effects(conn, key=key) as fx:
                return fx.first
        finally:
            await engine.dispose()

    assert run(main()) is True


def test_the_async_claim_is_one_statement(urls: tuple[str, str]) -> None:
    _, url = urls
    statements: list[str] = []

    async def main() -> None:
        engine = await engine_for(url)
        event.listen(engine.sync_engine, "before_cursor_execute",
                     lambda *a: statements.append(a[2].split()[0].upper()))
        try:
            async with engine.begin() as conn:
                await conn.execute(sa.text("select 1"))  # the connection's own set-up first
                statements.clear()
                async with effects(conn, key=f"k:{label()}") as fx:
                    assert fx.first
                    assert len(statements) == 1
        finally:
            await engine.dispose()

    run(main())
    assert statements[0] in ("INSERT", "WITH")


def test_a_concurrent_async_claim_waits_for_the_first_and_reads_its_result(
    urls: tuple[str, str],
) -> None:
    """Two event-loop tasks, one identity: the second waits on the unique index until the
    first commits, then it is not first and reads the stored result (PostgreSQL: on the row;
    SQLite: on the database's write lock, waited for in aiosqlite's thread)."""
    _, url = urls
    key = f"order:{label()}"

    async def main() -> list[tuple[bool, Any]]:
        engine = await engine_for(url, **({"connect_args": {"timeout": 30}}
                                          if url.startswith("sqlite") else {}))
        claimed = asyncio.Event()
        release = asyncio.Event()
        answers: list[tuple[bool, Any]] = []

        async def first() -> None:
            async with engine.begin() as conn, effects(conn, key=key) as fx:
                fx.result = {"by": "first"}
                answers.append((fx.first, fx.result))
                claimed.set()
                await release.wait()

        async def second() -> None:
            await claimed.wait()
            async with engine.begin() as conn, effects(conn, key=key) as fx:
                answers.append((fx.first, fx.result))

        try:
            one = asyncio.create_task(first())
            two = asyncio.create_task(second())
            await claimed.wait()
            await asyncio.sleep(0.3)  # the second is blocked on the first's row (or lock)
            assert len(answers) == 1
            release.set()
            await asyncio.wait_for(asyncio.gather(one, two), timeout=30)
        finally:
            await engine.dispose()
        return answers

    assert run(main()) == [(True, {"by": "first"}), (False, {"by": "first"})]


def test_in_a_task_the_async_claim_takes_the_running_identity(urls: tuple[str, str]) -> None:
    _, url = urls
    key = f"tests.charge:{label()}"

    async def main() -> Any:
        engine = await engine_for(url)
        try:
            async with engine.begin() as conn, effects(conn) as fx:
                return fx.key, fx.first, fx.task_id
        finally:
            await engine.dispose()

    token = running.enter(Running("tests.charge", "tid-1", key, 60.0))
    try:
        assert run(main()) == (key, True, "tid-1")
    finally:
        running.leave(token)


def test_async_misuse_is_refused_with_the_right_form(urls: tuple[str, str]) -> None:
    plain, url = urls

    async def main() -> None:
        engine = await engine_for(url)
        auto = await engine_for(url, isolation_level="AUTOCOMMIT")
        try:
            async with engine.begin() as conn:
                with pytest.raises(ConfigurationError, match="outside a gated"):
                    async with effects(conn):
                        pass
                with pytest.raises(ConfigurationError, match="async with effects"):
                    with effects(conn, key="k"):  # type: ignore[arg-type]
                        pass
            async with engine.connect() as conn:
                options = await conn.execution_options(isolation_level="AUTOCOMMIT")
                with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
                    async with effects(options, key="k"):
                        pass
            async with auto.connect() as conn:
                with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
                    async with effects(conn, key="k"):
                        pass
            async with AsyncSession(auto) as session:
                with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
                    async with effects(session, key="k"):
                        pass
            sync_engine = sa.create_engine(plain)
            with sync_engine.begin() as sync_conn:
                with pytest.raises(ConfigurationError, match="sync Connection"):
                    async with effects(sync_conn, key="k"):
                        pass
                with pytest.raises(ConfigurationError, match="AsyncConnection or AsyncSession"):
                    await add_async(sync_conn, record, "x")
            sync_engine.dispose()
            with pytest.raises(ConfigurationError, match="not AsyncEngine"):
                async with effects(engine, key="k"):  # type: ignore[arg-type]
                    pass
        finally:
            await engine.dispose()
            await auto.dispose()

    run(main())
    assert table_rows(plain, TABLE) == []


# -- outbox.add ---------------------------------------------------------------------------------


def test_await_add_on_an_async_connection_publishes_after_the_commit_and_deletes_the_row(
    urls: tuple[str, str], queue: DedupQueue, rc: redis.Redis
) -> None:
    plain, url = urls

    async def main() -> str:
        engine = await engine_for(url)
        try:
            async with engine.begin() as conn:
                job_id = await outbox.add(conn, queue, rq_record, label(), value=2)
                assert not published(rc, job_id)  # not before the commit
            return job_id
        finally:
            await engine.dispose()

    job_id = run(main())
    assert published(rc, job_id)
    assert rc.lrange(f"rq:queue:{queue.name}", 0, -1) == [job_id.encode()]
    assert table_rows(plain, OUTBOX) == []


def test_await_add_on_an_async_session_publishes_a_celery_call_after_the_commit(
    urls: tuple[str, str], celery_queue: str, rc: redis.Redis
) -> None:
    plain, url = urls
    name = label()

    async def main() -> str:
        engine = await engine_for(url)
        try:
            async with AsyncSession(engine) as session:
                async with session.begin():
                    task_id = await outbox.add(session, record.s(name, 3))
                    assert rc.llen(celery_queue) == 0
                return task_id
        finally:
            await engine.dispose()

    task_id = run(main())
    messages = [json.loads(m) for m in rc.lrange(celery_queue, 0, -1)]
    assert [m["headers"]["id"] for m in messages] == [task_id]
    assert table_rows(plain, OUTBOX) == []
    rc.delete(celery_queue)


@pytest.mark.parametrize("front", ["connection", "session"])
def test_an_async_rollback_publishes_nothing_and_leaves_no_row(
    urls: tuple[str, str], queue: DedupQueue, rc: redis.Redis, front: str
) -> None:
    plain, url = urls
    added: list[str] = []

    async def main() -> None:
        engine = await engine_for(url)
        try:
            with pytest.raises(RuntimeError, match="order refused"):
                if front == "connection":
                    async with engine.begin() as conn:
                        added.append(await outbox.add(conn, queue, rq_record, label()))
                        raise RuntimeError("order refused")
                async with AsyncSession(engine) as session, session.begin():
                    added.append(await outbox.add(session, queue, rq_record, label()))
                    raise RuntimeError("order refused")
            async with AsyncSession(engine) as session:  # explicit rollback
                await session.begin()
                added.append(await outbox.add(session, queue, rq_record, label()))
                await session.rollback()
            async with engine.connect() as conn:  # the pooled connection, reused, commits
                await conn.execute(sa.text("select 1"))
                await conn.commit()
        finally:
            await engine.dispose()

    run(main())
    assert len(added) == 2
    assert not any(published(rc, job_id) for job_id in added)
    assert rc.llen(f"rq:queue:{queue.name}") == 0
    assert table_rows(plain, OUTBOX) == []


def test_an_async_savepoint_rolled_back_takes_only_its_rows(
    urls: tuple[str, str], queue: DedupQueue, rc: redis.Redis
) -> None:
    plain, url = urls

    async def main() -> tuple[str, str]:
        engine = await engine_for(url)
        try:
            async with AsyncSession(engine) as session, session.begin():
                kept = await outbox.add(session, queue, rq_record, label())
                nested = await session.begin_nested()
                dropped = await outbox.add(session, queue, rq_record, label())
                await nested.rollback()
            return kept, dropped
        finally:
            await engine.dispose()

    kept, dropped = run(main())
    assert published(rc, kept) and not published(rc, dropped)
    assert table_rows(plain, OUTBOX) == []


def test_async_add_refuses_autocommit_and_bad_targets_and_leaves_no_row(
    urls: tuple[str, str], queue: DedupQueue
) -> None:
    plain, url = urls

    async def main() -> None:
        engine = await engine_for(url)
        auto = await engine_for(url, isolation_level="AUTOCOMMIT")
        try:
            async with auto.connect() as conn:
                with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
                    await outbox.add(conn, queue, rq_record, label())
            async with engine.begin() as conn:
                with pytest.raises(ConfigurationError, match="Celery task or signature"):
                    await outbox.add(conn, object(), 1)
                with pytest.raises(ConfigurationError, match="dedup policy"):
                    await outbox.add(conn, outbox_apps.plain, label())
        finally:
            await engine.dispose()
            await auto.dispose()

    run(main())
    assert table_rows(plain, OUTBOX) == []
