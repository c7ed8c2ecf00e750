"""taskdedup's Django app (``taskdedup.django``) in the example project, on SQLite and on a
real PostgreSQL: ``manage.py migrate`` creates the SQLAlchemy tier's tables, the admin pages
are read-only, ``effects()`` claims once on Django's connection, and the outbox's calls added
in a transaction run once on a real Celery prefork worker and a real RQ worker — published
after the commit by the committing process, or by ``manage.py taskdedup_relay`` when that
process was killed first.

Django runs only in subprocesses (``manage.py``), never in the test process, as in
tests/test_django.py. Django and django-rq are in the ``django`` dependency group: without
them this module is skipped, except on CI, where that is an error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from taskdedup.testing import wait_for

PROJECT = Path(__file__).resolve().parent.parent / "examples" / "django_project"
ROOT = PROJECT.parent.parent
BROKER_DB, LOCKS_DB = 10, 11  # databases of their own on the session's server

_MISSING = [name for name in ("django", "django_rq", "sqlalchemy", "psycopg")
            if importlib.util.find_spec(name) is None]
if _MISSING:
    _WHY = (f"not installed: {', '.join(_MISSING)} (the 'django' and 'test' dependency "
            "groups)")
    if os.environ.get("CI"):
        pytest.fail(_WHY, pytrace=False)
    pytest.skip(_WHY, allow_module_level=True)

import sqlalchemy as sa  # noqa: E402

from taskdedup.sql import table  # noqa: E402
from taskdedup.sql.outbox import backlog  # noqa: E402
from taskdedup.sql.schema import outbox_table  # noqa: E402
from taskdedup.sql.statements import READ  # noqa: E402
from tests.sqldb import postgres_url  # noqa: E402
from tests.test_django import ProjectCeleryWorker  # noqa: E402

pytestmark = pytest.mark.slow

def _url(base: str, db: int) -> str:
    return base.rsplit("/", 1)[0] + f"/{db}" if base.count("/") > 2 else f"{base}/{db}"


@dataclass
class Project:
    """The example project on one database: its environment, and a SQLAlchemy engine on the
    same database for the checks the test process makes itself."""

    dialect: str
    env: dict[str, str]
    engine: sa.Engine
    tmp: Path
    worker: ProjectCeleryWorker | None = None
    starting: Future[ProjectCeleryWorker] | None = None

    @property
    def broker(self) -> redis.Redis:
        return redis.Redis.from_url(self.env["REDIS_URL"])

    def run(self, *args: str, timeout: float = 90.0, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "manage.py", *args], cwd=PROJECT, env={**self.env, **(env or {})},
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )
        if check:
            assert done.returncode == 0, done.stdout + done.stderr
        return done

    def shell(self, code: str) -> Any:
        """Run ``code`` in ``manage.py shell -c``; the JSON it printed last."""
        out = self.run("shell", "-c", textwrap.dedent(code)).stdout
        return json.loads(out.strip().splitlines()[-1])

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "manage.py", *args], cwd=PROJECT, env={**self.env, **(env or {})},
            text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )

    def rows(self, sql: str) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.execute(sa.text(sql)))

    def start_celery(self) -> None:
        """Start the project's Celery prefork worker on this database in the background (it
        takes seconds: the module's first tests run meanwhile)."""
        self.worker = ProjectCeleryWorker(self.env["REDIS_URL"], queue="celery",
                                          concurrency=2, env=self.env)
        self.starting = ThreadPoolExecutor(1).submit(self.worker.start)

    def celery(self) -> ProjectCeleryWorker:
        """The worker, once ready."""
        if self.starting is None:
            self.start_celery()
        assert self.starting is not None
        return self.starting.result(timeout=120)

    def stop_celery(self) -> None:
        if self.starting is None or self.worker is None:
            return
        try:
            self.starting.result(timeout=120)
        except Exception:  # it failed to start (the test that needed it said so): kill it
            self.worker.kill()
            return
        self.worker.stop()

    def celery_done(self, task_id: str) -> dict[str, Any] | None:
        raw = self.broker.get(f"celery-task-meta-{task_id}")
        meta = None if raw is None else json.loads(raw)
        return meta if meta is not None and meta["status"] == "SUCCESS" else None


def _postgres_database() -> str:
    """A fresh database on the session's PostgreSQL (the other modules' tables stay apart)."""
    import psycopg

    server = postgres_url().replace("postgresql+psycopg://", "postgresql://")
    name = f"td_django_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def project(request: pytest.FixtureRequest, redis_url: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    """The example project, migrated, on a new SQLite file or PostgreSQL database, with two
    flushed Redis databases (broker and queues; Celery's locks)."""
    tmp = tmp_path_factory.mktemp(f"django-{request.param}")
    if request.param == "sqlite":
        database = f"sqlite:///{tmp / 'db.sqlite3'}"
        other = f"sqlite:///{tmp / 'other.sqlite3'}"
        engine = sa.create_engine(database)
    else:
        database, other = _postgres_database(), _postgres_database()
        engine = sa.create_engine(database.replace("postgresql://", "postgresql+psycopg://"))
    urls = {"REDIS_URL": _url(redis_url, BROKER_DB), "DEDUP_REDIS_URL": _url(redis_url, LOCKS_DB)}
    for url in urls.values():
        with redis.Redis.from_url(url) as client:
            client.flushdb()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKDEDUP_")}
    env.update(urls, TASKDEDUP_URL="", TASKDEDUP_PREFIX="", DJANGO_DATABASE_URL=database,
               DJANGO_OTHER_DATABASE_URL=other,  # the "other" alias; migrated by its test
               DJANGO_SETTINGS_MODULE="mysite.settings",
               PYTHONPATH=os.pathsep.join([str(PROJECT), str(ROOT)]))
    found = Project(request.param, env, engine, tmp)
    found.run("migrate", "-v0")
    found.start_celery()
    try:
        yield found
    finally:
        found.stop_celery()
        engine.dispose()


# -- migrate ------------------------------------------------------------------------------


def _generic(kind: Any) -> str:
    """A column type by its generic name: reflected (TEXT, VARCHAR, TIMESTAMP, ...) or
    defined (Text, String, DateTime, ...)."""
    name = type(kind).__name__.upper()
    return {"TIMESTAMP": "DATETIME", "STRING": "VARCHAR"}.get(name, name)


def _columns(inspector: Any, name: str) -> dict[str, tuple[str, bool, bool]]:
    pk = set(inspector.get_pk_constraint(name)["constrained_columns"])
    return {c["name"]: (_generic(c["type"]), bool(c["nullable"]), c["name"] in pk)
            for c in inspector.get_columns(name)}


def test_migrate_creates_the_sqlalchemy_tiers_tables(project: Project) -> None:
    """Column for column the SQLAlchemy tier's tables (reflected, compared with
    ``taskdedup.sql.table``'s), with its index names, and nothing else of Django's."""
    inspector = sa.inspect(project.engine)
    for name, defined in (("taskdedup_effects", table(sa.MetaData())),
                          ("taskdedup_outbox", outbox_table(sa.MetaData()))):
        wanted = {c.name: (_generic(c.type), bool(c.nullable), c.primary_key)
                  for c in defined.columns}
        assert _columns(inspector, name) == wanted, name
    outbox = {c["name"]: c for c in inspector.get_columns("taskdedup_outbox")}
    assert outbox["kind"]["type"].length == 16 and outbox["target"]["type"].length == 255
    assert str(outbox["attempts"]["default"]).strip("'()") == "0"
    indexes = {t: {i["name"]: i["column_names"] for i in inspector.get_indexes(t)}
               for t in ("taskdedup_effects", "taskdedup_outbox")}
    assert indexes == {
        "taskdedup_effects": {"ix_taskdedup_effects_expires": ["expires"]},
        "taskdedup_outbox": {"ix_taskdedup_outbox_next_attempt": ["next_attempt"]},
    }


# -- admin and effects, in one Django process ----------------------------------------------

_ADMIN_AND_EFFECTS = """
import json, math
from datetime import UTC, datetime, timedelta
from django.contrib.auth.models import User
from django.db import transaction
from django.test import Client
from taskdedup import running
from taskdedup.exceptions import ConfigurationError
from taskdedup.django import effects
from taskdedup.django.models import Effect, OutboxRow

out = {}
# effects: outside atomic, first, not first with the stored result, strict JSON
try:
    with effects(key="k-outside"):
        pass
except ConfigurationError as exc:
    out["outside"] = str(exc)
with transaction.atomic():
    with effects(key="k1") as fx:
        out["first"] = [fx.first, fx.task_id, fx.key]
        fx.result = {"charged": 5000, "items": [1, 2]}
        try:
            fx.result = {"bad": math.nan}
        except ValueError as exc:
            out["nan"] = str(exc)
with transaction.atomic():
    with effects(key="k1") as fx:
        out["second"] = [fx.first, fx.task_id, fx.result]
# the running task's identity and id; a rollback records nothing
token = running.enter(running.Running("orders.tasks.x", "task-7", "mysite:x:abc", 60.0))
try:
    with transaction.atomic():
        with effects() as fx:
            out["running"] = [fx.first, fx.key, fx.task_id]
    try:
        with transaction.atomic():
            with effects(key="k-rolled-back") as fx:
                fx.result = 1
                raise RuntimeError
    except RuntimeError:
        pass
finally:
    running.leave(token)
with transaction.atomic():
    with effects(key="k-rolled-back") as fx:
        out["after_rollback"] = fx.first
# an expired row is taken over
Effect.objects.filter(key="k1").update(expires=datetime.now(UTC) - timedelta(seconds=1))
with transaction.atomic():
    with effects(key="k1", ttl=60) as fx:
        out["expired"] = [fx.first, fx.result]
out["rows"] = {e.key: [e.task_id, e.result] for e in Effect.objects.all()}
# the statements: one claim (INSERT ... ON CONFLICT), one UPDATE for a stored result; a
# later run's claim reads the stored row in the same statement on PostgreSQL
from django.db import connection
from django.test.utils import CaptureQueriesContext
with transaction.atomic(), CaptureQueriesContext(connection) as first_run:
    with effects(key="k-count") as fx:
        fx.result = "done"
with transaction.atomic(), CaptureQueriesContext(connection) as later_run:
    with effects(key="k-count") as fx:
        out["string_result"] = [fx.first, fx.result]
out["statements"] = [[q["sql"].split()[0].upper() for q in run.captured_queries]
                     for run in (first_run, later_run)]
# a row shorter than the task's redelivery delay: warned once per task
import io, logging
log = io.StringIO()
logging.getLogger("taskdedup").addHandler(logging.StreamHandler(log))
token = running.enter(running.Running("orders.tasks.short", "t-9", "mysite:short:1", 60.0,
                                      redelivery=3600.0))
try:
    for _ in range(2):
        with transaction.atomic(), effects(ttl=60):
            pass
finally:
    running.leave(token)
out["short"] = log.getvalue()
# the admin: listed and shown to a superuser, never added, changed or deleted
OutboxRow.objects.create(id="row-1", kind="celery", target="orders.tasks.record_charge",
                         body='{"secret": "x"}', created=datetime.now(UTC),
                         next_attempt=datetime.now(UTC))
user = User.objects.create_superuser("admin-" + str(id(out)), "a@example.com", "pw")
web = Client(HTTP_HOST="localhost")
web.force_login(user)
pages = {}
for model, pk in (("effect", "k1"), ("outboxrow", "row-1")):
    base = f"/admin/taskdedup/{model}/"
    listing = web.get(base)
    detail = web.get(f"{base}{pk}/change/")
    pages[model] = {
        "list": listing.status_code, "detail": detail.status_code,
        "listed": pk in listing.content.decode(),
        "save_button": 'name="_save"' in detail.content.decode(),
        "add": web.get(f"{base}add/").status_code,
        "delete": web.get(f"{base}{pk}/delete/").status_code,
        "post": web.post(f"{base}{pk}/change/", {"key": pk}).status_code,
        "body_shown": "secret" in detail.content.decode(),
    }
pages["index"] = "taskdedup" in web.get("/admin/").content.decode()
OutboxRow.objects.all().delete()
out["admin"] = pages
# what the relay publishes with: the app TASKDEDUP_CELERY_APP names, else the settings
# package's celery.py; django-rq's connection
import mysite.celery
from django.test import override_settings
from taskdedup.django import project
out["relay_app"] = [project.celery_app() is mysite.celery.app]
with override_settings(TASKDEDUP_CELERY_APP=None):
    out["relay_app"].append(project.celery_app() is mysite.celery.app)
with override_settings(TASKDEDUP_CELERY_APP="mysite.celery:nope"):
    try:
        project.celery_app()
    except ConfigurationError as exc:
        out["relay_app"].append(str(exc))
out["relay_rq_db"] = project.rq_connection().connection_pool.connection_kwargs["db"]
# the models and the shipped migration agree (makemigrations would write nothing)
import io
from django.core.management import call_command
try:
    call_command("makemigrations", "taskdedup", "--check", "--dry-run", stdout=io.StringIO())
    out["migrations_in_sync"] = True
except SystemExit:
    out["migrations_in_sync"] = False
print(json.dumps(out))
"""


def test_admin_is_read_only_and_effects_claims_once(project: Project) -> None:
    out = project.shell(_ADMIN_AND_EFFECTS)
    assert "transaction.atomic" in out["outside"]
    assert out["first"] == [True, None, "k1"]
    assert "strict JSON" in out["nan"]
    assert out["second"] == [False, None, {"charged": 5000, "items": [1, 2]}]
    assert out["running"] == [True, "mysite:x:abc", "task-7"]
    assert out["after_rollback"] is True  # the rolled-back claim left no row
    assert out["expired"] == [True, None]  # taken over: first again, the old result gone
    assert out["rows"]["k1"] == [None, None]
    assert out["rows"]["mysite:x:abc"] == ["task-7", None]
    claim = "WITH" if project.dialect == "postgresql" else "INSERT"
    later = ["WITH"] if project.dialect == "postgresql" else ["INSERT", "SELECT"]
    assert out["statements"] == [[claim, "UPDATE"], later], out["statements"]
    assert out["string_result"] == [False, "done"]  # JSON "done", read back as the string
    assert out["short"].count("orders.tasks.short") == 1, out["short"]
    assert "3600" in out["short"]
    # the rows the Django app wrote are the SQLAlchemy tier's: read through it
    with project.engine.connect() as conn:
        row = conn.execute(READ, {"b_key": "mysite:x:abc", "b_now": datetime.now(UTC)}).first()
    assert row is not None and row.task_id == "task-7"
    for model in ("effect", "outboxrow"):
        page = out["admin"][model]
        assert page["list"] == 200 and page["detail"] == 200 and page["listed"], page
        assert not page["save_button"], page  # shown, not editable
        assert page["add"] == 403 and page["delete"] == 403 and page["post"] == 403, page
    assert not out["admin"]["outboxrow"]["body_shown"]  # the arguments are never shown
    assert out["admin"]["index"]
    assert out["relay_app"][:2] == [True, True] and "mysite.celery:nope" in out["relay_app"][2]
    assert out["relay_rq_db"] == BROKER_DB  # django-rq's "default" queue's Redis
    assert out["migrations_in_sync"]


# -- two processes, one identity ----------------------------------------------------------

_HOLDER = """
import json, time
from pathlib import Path
from django.db import transaction
from taskdedup.django import effects
d = Path({tmp!r})
with transaction.atomic():
    with effects(key="k-race") as fx:
        fx.result = {{"by": "holder"}}
        (d / "claimed.tmp").write_text(json.dumps(fx.first))
        (d / "claimed.tmp").replace(d / "claimed")  # whole when it appears
        while not (d / "commit").exists():
            time.sleep(0.02)
    (d / "committing.tmp").write_text(repr(time.time()))
    (d / "committing.tmp").replace(d / "committing")
print(json.dumps("committed"))
"""

_CLAIMER = """
import json, time
from pathlib import Path
from django.db import transaction
from taskdedup.django import effects
d = Path({tmp!r})
(d / "claiming.tmp").write_text(repr(time.time()))
(d / "claiming.tmp").replace(d / "claiming")  # whole when it appears
with transaction.atomic():
    with effects(key="k-race") as fx:
        print(json.dumps([fx.first, fx.result, time.time()]))
"""


def _last_json(process: subprocess.Popen[str]) -> Any:
    out, _ = process.communicate(timeout=90)
    assert process.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def test_a_concurrent_run_waits_for_the_first_to_commit_then_is_not_first(
    project: Project,
) -> None:
    """The second claim of an identity blocks until the first transaction commits (on the
    primary key on PostgreSQL, on the database lock on SQLite), then reads its result."""
    tmp = project.tmp / f"race-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    holder = project.popen("shell", "-c", _HOLDER.format(tmp=str(tmp)))
    claimer = None
    try:
        wait_for(lambda: (tmp / "claimed").exists() or holder.poll() is not None,
                 timeout=60, what="the holder claimed")
        assert json.loads((tmp / "claimed").read_text()) is True
        claimer = project.popen("shell", "-c", _CLAIMER.format(tmp=str(tmp)))
        wait_for(lambda: (tmp / "claiming").exists() or claimer.poll() is not None,
                 timeout=60, what="the second run started its claim")
        if project.dialect == "postgresql":  # seen waiting on the first's row lock
            wait_for(lambda: project.rows(
                "select count(*) from pg_stat_activity where wait_event_type = 'Lock' "
                "and datname = current_database()")[0][0] == 1, timeout=30,
                what="the second claim waiting on a lock")
        else:
            time.sleep(0.5)  # SQLite: no view of a waiting writer; the times below tell
        assert claimer.poll() is None  # still waiting
        (tmp / "commit").touch()
        assert _last_json(holder) == "committed"
        first, result, claimed_at = _last_json(claimer)
    finally:
        for process in (holder, claimer):
            if process is not None and process.poll() is None:
                process.kill()
    assert first is False and result == {"by": "holder"}
    assert claimed_at >= float((tmp / "committing").read_text())  # answered after the commit


# -- the outbox, with a real Celery prefork worker and a real RQ worker ----------------------

_PLACE = """
import io, json, logging
import django_rq, redis
from django.db import transaction
from taskdedup.exceptions import ConfigurationError
from taskdedup.django import outbox
from taskdedup.django.models import OutboxRow
from taskdedup.rq.django import DjangoDedupQueue
from orders.jobs import record_charge_job
from orders.services import place_order
from orders.tasks import record_charge

log = io.StringIO()
logging.getLogger("taskdedup").addHandler(logging.StreamHandler(log))
out = {{}}
out["celery"] = place_order("ORD-C", 5000)             # committed: published at once
out["rq"] = place_order("ORD-R", 700, via="rq")
out["left"] = OutboxRow.objects.count()                  # published rows are deleted
try:                                                     # rolled back: no row, nothing sent
    with transaction.atomic():
        outbox.add(record_charge.s("ORD-X", 1))
        outbox.add(django_rq.get_queue("default"), record_charge_job, "ORD-X", 1)
        raise RuntimeError
except RuntimeError:
    pass
with transaction.atomic():                               # a savepoint rolled back: not sent
    out["kept"] = outbox.add(record_charge.s("ORD-S", 2))
    try:
        with transaction.atomic():
            out["dropped"] = outbox.add(record_charge.s("ORD-Y", 3))
            raise RuntimeError
    except RuntimeError:
        pass
try:
    outbox.add(record_charge.s("ORD-Z", 4))
except ConfigurationError as exc:
    out["outside"] = str(exc)
# a publish that fails after the commit (a queue on a Redis that is not there): logged,
# never raised, the row left to the relay
dead = DjangoDedupQueue("default", connection=redis.Redis(port={dead_port}))
with transaction.atomic():
    out["failed"] = outbox.add(dead, record_charge_job, "ORD-F", 9)
out["warned"] = log.getvalue()
out["rows"] = list(OutboxRow.objects.values_list("id", flat=True))
print(json.dumps(out))
"""

_AGAIN = """
import io, json
from django.core.management import call_command
from orders.tasks import record_charge
status, relayed = io.StringIO(), io.StringIO()
again = record_charge.delay("ORD-C", 5000).id   # its lock gone: the gate lets it through
call_command("taskdedup_relay", "--once", "--grace", "0", stdout=relayed)
call_command("taskdedup_outbox_status", stdout=status)
print(json.dumps({"again": again, "relayed": relayed.getvalue(), "status": status.getvalue()}))
"""


def _charges(project: Project) -> dict[str, int]:
    return {ref: n for ref, n in project.rows(
        "select order_ref, count(*) from orders_charge group by order_ref")}


def _rq_status(project: Project, job_id: str) -> bytes | None:
    return project.broker.hget(f"rq:job:{job_id}", "status")  # type: ignore[return-value]


def test_outbox_commit_publishes_once_rollback_and_savepoint_send_nothing(
    project: Project,
) -> None:
    from taskdedup.testing import free_port

    worker = project.celery()
    with project.engine.begin() as conn:  # this test's rows only
        conn.execute(sa.text("delete from taskdedup_outbox"))
    out = project.shell(_PLACE.format(dead_port=free_port()))
    assert out["left"] == 0, out
    assert "transaction.atomic" in out["outside"]
    assert out["rows"] == [out["failed"]]  # the rolled-back calls left no row
    assert out["failed"] in out["warned"] and "relay" in out["warned"], out["warned"]
    assert "ORD-F" not in out["warned"]  # ids and targets, never argument values
    wait_for(lambda: project.celery_done(out["celery"]) and project.celery_done(out["kept"]),
             timeout=60, what="the committed Celery calls ran")
    assert project.celery_done(out["celery"])["result"] == {"charged": 5000}  # type: ignore[index]
    assert project.broker.get(f"celery-task-meta-{out['dropped']}") is None

    # The Redis window gone (its locks flushed), the same call runs again in the worker:
    # effects() finds the committed row and does nothing. The relay publishes the row whose
    # publish failed at the commit.
    redis.Redis.from_url(project.env["DEDUP_REDIS_URL"]).flushdb()
    again = project.shell(_AGAIN)
    assert again["relayed"].strip() == "taskdedup relay: 1 row(s) taken", again
    assert "0 row(s) waiting" in again["status"], again
    wait_for(lambda: project.celery_done(again["again"]), timeout=60, what="the second run")
    assert project.celery_done(again["again"])["result"] == {  # type: ignore[index]
        "charged": 5000, "again": True}

    project.run("rqworker", "--burst", "default")
    assert _rq_status(project, out["rq"]) == b"finished"
    assert _rq_status(project, out["failed"]) == b"finished"
    charges = _charges(project)
    assert [charges.get(ref) for ref in ("ORD-C", "ORD-R", "ORD-S", "ORD-F")] == [1, 1, 1, 1]
    assert "ORD-X" not in charges and "ORD-Y" not in charges and "ORD-Z" not in charges
    assert worker.process is not None


_OTHER_VENDOR = """
import json
from django.db import connection, transaction
from taskdedup.exceptions import ConfigurationError
from taskdedup.django import outbox
from taskdedup.django.models import OutboxRow
from orders.tasks import record_charge
connection.vendor = "mysql"  # a database taskdedup is not tested on
out = {}
with transaction.atomic():
    try:
        outbox.add(record_charge.s("ORD-V", 1))
    except ConfigurationError as exc:
        out["refused"] = str(exc)
out["rows"] = OutboxRow.objects.count()
print(json.dumps(out))
"""


def test_add_refuses_a_database_it_is_not_tested_on(project: Project) -> None:
    """MySQL, Oracle: ``outbox.add`` refuses them (as ``effects()`` does), naming the alias and
    the vendor, and writes no row (the issue: "MySQL only if tested")."""
    with project.engine.begin() as conn:  # this test's rows only
        conn.execute(sa.text("delete from taskdedup_outbox"))
    out = project.shell(_OTHER_VENDOR)
    assert "PostgreSQL (psycopg 3) and SQLite" in out["refused"], out
    assert "'default' is 'mysql'" in out["refused"], out
    assert out["rows"] == 0


# -- a producer killed between its commit and its publish --------------------------------

_KILLED = """
import json, os, signal
from django.db import transaction
from orders.services import place_order
with transaction.atomic():
    transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))  # before the publish
    ids = [place_order("ORD-K", 11), place_order("ORD-KR", 12, via="rq")]
    print(json.dumps(ids), flush=True)
"""


def test_relay_publishes_what_a_killed_producer_committed_and_stops_on_sigterm(
    project: Project,
) -> None:
    worker = project.celery()
    with project.engine.begin() as conn:  # this test's rows only
        conn.execute(sa.text("delete from taskdedup_outbox"))
    killed = project.run("shell", "-c", _KILLED, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    celery_id, rq_id = json.loads(killed.stdout.strip().splitlines()[-1])
    assert sorted(r[0] for r in project.rows("select id from taskdedup_outbox")) == sorted(
        [celery_id, rq_id])  # committed, never published

    status = json.loads(project.run("taskdedup_outbox_status", "--json").stdout)
    assert status["rows"] == 2 and status["failing"] == 0, status
    targets = {("celery", "orders.tasks.record_charge"), ("rq", "default")}
    assert {(t["kind"], t["target"]) for t in status["targets"]} == targets
    # the SQLAlchemy tier reads the rows the Django app wrote (one table for both)
    assert {(b.kind, b.target, b.rows) for b in backlog(project.engine)} == {
        (*t, 1) for t in targets}

    relay = project.popen("taskdedup_relay", "--grace", "0", "--poll", "0.2")
    try:
        wait_for(lambda: not project.rows("select id from taskdedup_outbox")
                 or relay.poll() is not None, timeout=60, what="the relay published both")
        assert relay.poll() is None
        relay.send_signal(signal.SIGTERM)
        output, _ = relay.communicate(timeout=30)
    finally:
        if relay.poll() is None:
            relay.kill()
    assert relay.returncode == 0, output
    assert "stopped" in output, output
    wait_for(lambda: project.celery_done(celery_id), timeout=60, what="the relayed task ran")
    project.run("rqworker", "--burst", "default")
    assert _rq_status(project, rq_id) == b"finished"
    assert _charges(project).get("ORD-K") == 1 and _charges(project).get("ORD-KR") == 1
    assert worker.process is not None


_UNPUBLISHABLE = """
import io, json, logging
from datetime import UTC, datetime, timedelta
from django.core.management import call_command
from taskdedup.django.models import OutboxRow

log = io.StringIO()
logging.getLogger("taskdedup").addHandler(logging.StreamHandler(log))
row_id, old = {row_id!r}, datetime.now(UTC) - timedelta(hours=1)
OutboxRow.objects.create(id=row_id, kind="celery", target="orders.tasks.gone",
                         body=json.dumps({{"v": 1, "task": "orders.tasks.gone"}}),
                         created=old, next_attempt=old)
def relay():
    out = io.StringIO()
    call_command("taskdedup_relay", "--once", "--grace", "0", stdout=out)
    return out.getvalue().strip()
def row():
    found = OutboxRow.objects.get(id=row_id)
    return [found.attempts, found.last_error,
            (found.next_attempt - datetime.now(UTC)).total_seconds()]
out = {{"first": relay(), "after_first": row(), "at_once": relay()}}
OutboxRow.objects.filter(id=row_id).update(next_attempt=datetime.now(UTC))  # its time comes
out["second"], out["after_second"] = relay(), row()
status = io.StringIO()
call_command("taskdedup_outbox_status", "--json", stdout=status)
out["status"], out["log"] = json.loads(status.getvalue()), log.getvalue()
OutboxRow.objects.filter(id=row_id).delete()
print(json.dumps(out))
"""


def test_a_row_the_relay_cannot_publish_stays_backs_off_and_is_reported(
    project: Project,
) -> None:
    """``manage.py taskdedup_relay`` over a row whose task the project's app does not know:
    the row stays, its attempts counted and its error kept, tried again after 1 s then 2 s
    (not at once: no hot loop), logged at WARNING with its id, counted as failing by
    ``taskdedup_outbox_status``."""
    with project.engine.begin() as conn:  # this test's rows only
        conn.execute(sa.text("delete from taskdedup_outbox"))
    row_id = str(uuid.uuid4())
    out = project.shell(_UNPUBLISHABLE.format(row_id=row_id))
    assert out["first"] == "taskdedup relay: 1 row(s) taken", out
    attempts, error, wait = out["after_first"]
    assert attempts == 1 and "not registered" in error and 0.5 < wait <= 1.5, out
    assert out["at_once"] == "taskdedup relay: 0 row(s) taken", out  # backed off
    assert out["second"] == "taskdedup relay: 1 row(s) taken", out
    attempts, error, wait = out["after_second"]
    assert attempts == 2 and 1.5 < wait <= 2.5, out
    warnings = [line for line in out["log"].splitlines() if row_id in line]
    assert len(warnings) == 2 and "attempt 2" in warnings[1], out["log"]
    assert out["status"]["rows"] == 1 and out["status"]["failing"] == 1, out
    (target,) = out["status"]["targets"]
    assert target["target"] == "orders.tasks.gone" and target["attempts"] == 2, target
    assert "not registered" in target["last_error"], target


def test_relay_refuses_bad_options_and_stops_on_sigint(project: Project) -> None:
    """Options the relay cannot run with end in Django's one-line ``CommandError`` (exit 1,
    no traceback); SIGINT (Ctrl-C) stops it as SIGTERM does: exit 0."""
    for option, value in (("--batch", "0"), ("--grace", "-1"), ("--poll", "0")):
        done = project.run("taskdedup_relay", option, value, "--once", check=False)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "CommandError" in done.stderr and option in done.stderr, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
    relay = project.popen("taskdedup_relay", "--grace", "3600", "--poll", "0.2")
    try:
        assert relay.stdout is not None
        seen: list[str] = []
        while not seen or not seen[-1].startswith("taskdedup relay: database 'default'"):
            seen.append(relay.stdout.readline())
            assert seen[-1], "".join(seen)  # it exited before polling
        relay.send_signal(signal.SIGINT)
        output, _ = relay.communicate(timeout=30)
    finally:
        if relay.poll() is None:
            relay.kill()
    assert relay.returncode == 0, output
    assert "taskdedup relay: stopped" in output and "Traceback" not in output, output


def test_a_wrong_alias_or_a_database_without_the_table_is_one_line_and_exit_1(
    project: Project,
) -> None:
    """``taskdedup_relay`` and ``taskdedup_outbox_status`` on an alias that is not in
    ``DATABASES``, or on a database that was never migrated: Django's one-line
    ``CommandError`` and exit 1 at once (the relay does not start polling a table that is not
    there, warning forever)."""
    empty = {"DJANGO_OTHER_DATABASE_URL": f"sqlite:///{project.tmp / 'never-migrated.sqlite'}"}
    cases = [(("--database", "nope"), None, "'nope' is not a database"),
             (("--database", "other"), empty, "manage.py migrate taskdedup --database other")]
    for args, env, message in cases:
        for command in (("taskdedup_outbox_status", "--json"), ("taskdedup_relay",)):
            done = project.run(*command, *args, check=False, env=env, timeout=30)
            assert done.returncode == 1, done.stdout + done.stderr
            assert "CommandError" in done.stderr and message in done.stderr, done.stderr
            assert "Traceback" not in done.stderr and not done.stdout, done.stderr


# -- another database alias: using="other" -------------------------------------------------

def _held_ids(project: Project, queue: str) -> list[str]:
    """The task ids of the Celery messages waiting on ``queue`` (a queue no worker reads)."""
    return [json.loads(raw)["headers"]["id"] for raw in project.broker.lrange(queue, 0, -1)]


_OTHER = """
import json
import redis
from django.core.management import call_command
from django.db import transaction
from django.conf import settings
from taskdedup.exceptions import ConfigurationError
from taskdedup.django import effects, outbox
from taskdedup.django.models import Effect, OutboxRow
from orders.tasks import record_charge

held, ref = {held!r}, {ref!r}
broker = redis.Redis.from_url(settings.REDIS_URL)
def sent():
    return [json.loads(m)["headers"]["id"] for m in broker.lrange(held, 0, -1)]
def call(n):
    return record_charge.s(f"{{ref}}-{{n}}", n).set(queue=held)
def where(model, pk):
    return [alias for alias in ("default", "other")
            if model.objects.using(alias).filter(pk=pk).exists()]
call_command("migrate", "taskdedup", database="other", verbosity=0)  # its tables only
out = {{}}
# committed on "other" inside a block of "default" that then rolls back: published at
# "other"'s commit, the row written on "other" only
try:
    with transaction.atomic():
        with transaction.atomic(using="other"):
            a = out["a"] = outbox.add(call(1), using="other")
            out["a_rows"] = [OutboxRow.objects.using("other").filter(id=a).exists(),
                             OutboxRow.objects.using("default").filter(id=a).exists()]
            out["a_before_commit"] = a in sent()
        out["a_after_other_commit"] = a in sent()
        raise RuntimeError
except RuntimeError:
    pass
out["a_left"] = where(OutboxRow, a)
# "other" rolled back, "default" committed: nothing sent, no row
with transaction.atomic():
    try:
        with transaction.atomic(using="other"):
            b = out["b"] = outbox.add(call(2), using="other")
            raise RuntimeError
    except RuntimeError:
        pass
out["b_sent"], out["b_left"] = b in sent(), where(OutboxRow, b)
# "default" committed inside "other", which then rolls back: not sent at "default"'s
# commit, nor ever
try:
    with transaction.atomic(using="other"):
        with transaction.atomic():
            c = out["c"] = outbox.add(call(3), using="other")
        out["c_after_default_commit"] = c in sent()
        raise RuntimeError
except RuntimeError:
    pass
out["c_sent"], out["c_left"] = c in sent(), where(OutboxRow, c)
# "other" not in a transaction (only "default" is): refused, naming the alias
with transaction.atomic():
    for name, attempt in (("add_outside", lambda: outbox.add(call(4), using="other")),
                          ("effects_outside", lambda: effects(key="k", using="other")
                           .__enter__())):
        try:
            attempt()
        except ConfigurationError as exc:
            out[name] = str(exc)
# effects() on "other": claimed there, once, its result stored there
with transaction.atomic(using="other"), effects(key=f"{{ref}}-fx", using="other") as fx:
    out["fx_first"] = fx.first
    fx.result = {{"on": "other"}}
with transaction.atomic(using="other"), effects(key=f"{{ref}}-fx", using="other") as fx:
    out["fx_second"] = [fx.first, fx.result]
out["fx_rows"] = where(Effect, f"{{ref}}-fx")
with transaction.atomic():  # "default" commits, "other" rolls back: no claim kept
    try:
        with transaction.atomic(using="other"), effects(key=f"{{ref}}-rb", using="other"):
            raise RuntimeError
    except RuntimeError:
        pass
out["fx_rolled_back"] = where(Effect, f"{{ref}}-rb")
out["sent"] = sent()
print(json.dumps(out))
"""

_KILLED_OTHER = """
import json, os, signal
from django.db import transaction
from taskdedup.django import outbox
from orders.tasks import record_charge
with transaction.atomic(using="other"):
    transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL), using="other")
    print(json.dumps(outbox.add(record_charge.s({ref!r}, 5).set(queue={held!r}),
                                using="other")), flush=True)
"""

_RELAY_OTHER = """
import io, json
from django.core.management import call_command
from taskdedup.django.models import OutboxRow
import logging
log = io.StringIO()
logging.getLogger("taskdedup").addHandler(logging.StreamHandler(log))
# nothing imported orders.tasks (call_command runs no system checks, which would import the
# URLconf and, through it, the tasks): the relay's app must find them itself
import sys
out = {"imported_before": "orders.tasks" in sys.modules}
def left():
    return list(OutboxRow.objects.using("other").values_list("id", flat=True))
out["before"] = left()
call_command("taskdedup_relay", "--once", "--grace", "0", stdout=io.StringIO())  # "default"
out["after_default"] = left()
status, relayed = io.StringIO(), io.StringIO()
call_command("taskdedup_outbox_status", "--database", "other", "--json", stdout=status)
out["status"] = json.loads(status.getvalue())
call_command("taskdedup_relay", "--once", "--grace", "0", "--database", "other",
             stdout=relayed)
out["relayed"], out["after_other"] = relayed.getvalue(), left()
out["log"] = log.getvalue()
print(json.dumps(out))
"""


def test_using_another_database_publishes_after_that_databases_commit(
    project: Project,
) -> None:
    """``outbox.add(..., using="other")`` and ``effects(using="other")`` write on the
    "other" alias and follow ITS transaction, whatever "default"'s does; ``taskdedup_relay
    --database other`` relays a row committed there and not published."""
    held, ref = f"held-{uuid.uuid4().hex[:8]}", f"UO-{uuid.uuid4().hex[:8]}"
    out = project.shell(_OTHER.format(held=held, ref=ref))
    assert out["a_rows"] == [True, False], out  # written on "other" only
    assert not out["a_before_commit"] and out["a_after_other_commit"], out
    assert out["a_left"] == [], out  # published, then deleted
    assert not out["b_sent"] and out["b_left"] == [], out
    assert not out["c_after_default_commit"] and not out["c_sent"], out
    assert out["c_left"] == [], out
    for name in ("add_outside", "effects_outside"):
        assert "using='other'" in out[name], out
    assert out["fx_first"] is True
    assert out["fx_second"] == [False, {"on": "other"}]
    assert out["fx_rows"] == ["other"] and out["fx_rolled_back"] == [], out
    assert out["sent"] == [out["a"]]  # once, and nothing else

    killed = project.run("shell", "-c", _KILLED_OTHER.format(ref=f"{ref}-k", held=held),
                         check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    row_id = json.loads(killed.stdout.strip().splitlines()[-1])
    relay = project.shell(_RELAY_OTHER)
    assert relay["before"] == [row_id] and relay["after_default"] == [row_id], relay
    assert relay["status"]["rows"] == 1, relay
    assert relay["relayed"].strip() == "taskdedup relay: 1 row(s) taken", relay
    assert relay["imported_before"] is False, relay
    assert relay["after_other"] == [], relay["log"]
    assert sorted(_held_ids(project, held)) == sorted([out["a"], row_id])


# -- several relays at once (PostgreSQL: FOR UPDATE SKIP LOCKED) ----------------------------

_BACKLOG = """
import json, os, signal
from django.db import transaction
from taskdedup.django import outbox
from orders.tasks import record_charge
with transaction.atomic():
    transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))  # before publishing
    ids = [outbox.add(record_charge.s(f"{ref}-{{n}}", n).set(queue={held!r}))
           for n in range({rows})]
    print(json.dumps(ids), flush=True)
"""

_LOG_TAKES = """
create table relay_takes (id varchar(64), relay text);
create function relay_take() returns trigger language plpgsql as $$
begin
insert into relay_takes values (new.id, current_setting('application_name')); return new;
end $$;
create trigger relay_take after update of next_attempt on taskdedup_outbox
for each row execute function relay_take();
"""


def test_two_relays_on_postgresql_publish_each_row_once(project: Project) -> None:
    """Two ``taskdedup_relay`` processes over one backlog: each row taken by one relay only
    (a trigger logs each take's ``UPDATE`` of ``next_attempt`` with the relay's
    ``application_name``), both
    took some, each row's message sent once, no row left, both exit 0 on SIGTERM."""
    if project.dialect != "postgresql":
        pytest.skip("SKIP LOCKED is PostgreSQL's; on SQLite run one relay")
    rows, held, ref = 300, f"held-{uuid.uuid4().hex[:8]}", f"UR-{uuid.uuid4().hex[:8]}"
    with project.engine.begin() as conn:
        conn.execute(sa.text("delete from taskdedup_outbox"))
        conn.execute(sa.text(_LOG_TAKES))
    relays: list[subprocess.Popen[str]] = []
    try:
        for n in range(2):  # libpq's PGAPPNAME: the trigger's application_name
            relays.append(project.popen("taskdedup_relay", "--grace", "0", "--poll", "0.05",
                                        "--batch", "5", env={"PGAPPNAME": f"relay-{n}"}))
        for relay in relays:  # both polling before the backlog commits
            assert relay.stdout is not None
            seen = []
            while not seen or not seen[-1].startswith("taskdedup relay: database 'default'"):
                seen.append(relay.stdout.readline())
                assert seen[-1], "".join(seen)  # it exited before polling
        killed = project.run("shell", "-c", _BACKLOG.format(ref=ref, held=held, rows=rows),
                             check=False)
        assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
        ids = json.loads(killed.stdout.strip().splitlines()[-1])
        assert len(set(ids)) == rows
        wait_for(lambda: not project.rows("select id from taskdedup_outbox")
                 or any(r.poll() is not None for r in relays), timeout=60,
                 what="the relays emptied the outbox")
        assert all(r.poll() is None for r in relays)
        outputs = []
        for relay in relays:
            relay.send_signal(signal.SIGTERM)
        for relay in relays:
            outputs.append(relay.communicate(timeout=30)[0])
            assert relay.returncode == 0, outputs[-1]
            assert "stopped" in outputs[-1], outputs[-1]
        takes = project.rows("select id, relay from relay_takes")
    finally:
        for relay in relays:
            if relay.poll() is None:
                relay.kill()
        with project.engine.begin() as conn:
            conn.execute(sa.text("drop trigger if exists relay_take on taskdedup_outbox; "
                                 "drop function if exists relay_take(); "
                                 "drop table if exists relay_takes"))
    per_row: dict[str, int] = {}
    for row_id, _ in takes:
        per_row[row_id] = per_row.get(row_id, 0) + 1
    assert per_row == dict.fromkeys(ids, 1)  # each row taken once, by one relay
    assert {relay for _, relay in takes} == {"relay-0", "relay-1"}, "not both relays took rows"
    sent = _held_ids(project, held)
    assert sorted(sent) == sorted(ids)  # each row's message once
    assert project.rows("select count(*) from taskdedup_outbox")[0][0] == 0


def test_the_wheel_ships_the_migrations_and_the_commands() -> None:
    """pyproject.toml's package discovery (``include = ["taskdedup*"]``, regular packages)
    takes every directory of the app that has an ``__init__.py``: the migrations and the
    management commands must have one, or ``pip install taskdedup`` could not migrate or
    relay."""
    import fnmatch
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    app = ROOT / "taskdedup" / "django"
    for directory in (app, app / "migrations", app / "management",
                      app / "management" / "commands"):
        assert (directory / "__init__.py").is_file(), directory
        name = ".".join(directory.relative_to(ROOT).parts)
        assert any(fnmatch.fnmatchcase(name, pattern) for pattern in include), name
    shipped = {p.name for p in (app / "migrations").glob("0*.py")}
    assert shipped == {"0001_initial.py"}
    assert {p.name for p in (app / "management" / "commands").glob("taskdedup_*.py")} == {
        "taskdedup_relay.py", "taskdedup_outbox_status.py"}
