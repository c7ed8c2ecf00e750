"""The least-privilege ACL rule of docs/how-to/operating.md, applied as written to a real
server, runs everything taskdedup does (SPEC §8): a real Celery worker and a real RQ worker
running gated tasks (their brokers on the default user, the locks on the ACL user), the
stats flush, an approximate window, ``doctor`` (no problem reported), ``list``, ``inspect``,
``clear``, ``stats`` and the dashboard — on database 3, not 0.
"""

from __future__ import annotations

import json
import os
import re
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from taskdedup import Approximate, Deduplicator, Policy
from taskdedup.cli import main
from taskdedup.core import Verdict
from taskdedup.rq import DedupQueue
from taskdedup.stores.redis import RedisStore
from taskdedup.testing import RedisServer, wait_for
from taskdedup.web import create_app
from taskdedup.web.app import TOKEN_HEADER
from tests import rq_jobs
from tests.test_topologies import ACL_COMMANDS
from tests.workers import CeleryWorker, RqWorker

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

DOC = Path(__file__).resolve().parent.parent / "docs" / "how-to" / "operating.md"
PASSWORD = "acl-s3cret"
DB = 3
TOKEN = "acl-token-for-the-dashboard"


def documented_rule() -> list[str]:
    """The ``ACL SETUSER`` line of the how-to, split into words (PASSWORD filled in)."""
    lines = re.findall(r"^ACL SETUSER .*$", DOC.read_text(), re.MULTILINE)
    assert len(lines) == 1, "docs/how-to/operating.md shows one ACL SETUSER rule"
    return lines[0].replace("PASSWORD", PASSWORD).split()


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A server of this module's own: its ACL is changed here."""
    with RedisServer() as own:
        admin = redis.Redis(port=own.port)
        admin.execute_command(*documented_rule())
        admin.close()
        yield own


@pytest.fixture(scope="module")
def store_url(server: RedisServer) -> str:
    return f"redis://taskdedup:{PASSWORD}@127.0.0.1:{server.port}/{DB}"


@pytest.fixture(scope="module")
def admin(server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=server.port, db=DB)
    yield client
    client.close()


def cli(store_url: str, *args: str) -> str:
    result = CliRunner().invoke(main, ["--url", store_url, *args], catch_exceptions=False)
    assert result.exit_code == 0, (args, result.output)
    return result.stdout


def test_the_rule_is_the_scripts_set_and_more() -> None:
    rule = documented_rule()
    assert set(ACL_COMMANDS) <= set(rule)  # the minimal set tests/test_topologies.py proves
    assert "~taskdedup:*" in rule and "-@all" in rule and "+time" in rule


def test_workers_the_stats_flush_and_the_operators_tools_run_with_the_documented_user(
    server: RedisServer, store_url: str, admin: redis.Redis,
) -> None:
    broker = server.url  # database 0, default user: the workers' queues
    user = redis.Redis.from_url(store_url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.set("elsewhere:key", "x")  # nothing outside the prefix
    user.close()
    label = f"acl-{uuid.uuid4().hex[:8]}"
    queue = f"acl-{uuid.uuid4().hex[:6]}"
    saved_env = os.environ.get("TASKDEDUP_TEST_REDIS_URL")
    from tests import celery_app

    celery = CeleryWorker(broker, queue=queue, concurrency=1,
                          env={"TASKDEDUP_TEST_LOCK_URL": store_url})
    rq = RqWorker(broker, [queue], scheduler=False, env={"TASKDEDUP_URL": store_url})
    try:
        celery_app.configure(broker, queue)
        celery_app.app.conf.update(taskdedup_url=store_url)
        celery_app.app.__dict__.pop("_taskdedup", None)
        celery.start()
        rq.start()
        effects = redis.Redis.from_url(broker)

        # Celery: two identical calls, one run
        first = celery_app.record.delay(f"{label}-c", 1)
        second = celery_app.record.delay(f"{label}-c", 1)
        assert first.id == second.id
        # RQ: two identical calls, one job, one run
        with redis.Redis.from_url(broker) as rq_client:
            dq = DedupQueue(queue, connection=rq_client, dedup=Policy(ttl=60),
                            dedup_store=store_url)
            job = dq.enqueue(rq_jobs.record, f"{label}-r", 1)
            again = dq.enqueue(rq_jobs.record, f"{label}-r", 1)
            assert job is not None and again is not None and again.id == job.id
            wait_for(lambda: effects.llen(f"effects:{label}-c") == 1
                     and effects.llen(f"effects:{label}-r") == 1,
                     timeout=60, what="each task to run once")

            # the workers' stats flush (HINCRBY) reaches database 3 under the ACL user
            def flushed() -> bool:
                return all(admin.hget(f"taskdedup:stats:{task}", "completed")
                           for task in ("tests.celery_app.record", "tests.rq_jobs.record"))
            wait_for(flushed, timeout=60, what="the workers' stats in database 3")
            locks = {k.decode() for k in admin.scan_iter(match="taskdedup:*")
                     if not k.startswith(b"taskdedup:stats:")}
            assert len(locks) == 2, locks  # one lock per identity, in database 3
            assert not list(effects.scan_iter(match="taskdedup:*"))  # none in database 0
        effects.close()
        assert "NOPERM" not in celery.output() and "NOPERM" not in rq.output()
        assert "permission" not in celery.output() and "permission" not in rq.output()
    finally:
        celery.stop()
        rq.stop()
        if saved_env is not None:
            os.environ["TASKDEDUP_TEST_REDIS_URL"] = saved_env
        else:  # configure() set it to this module's server, stopped after the module
            os.environ.pop("TASKDEDUP_TEST_REDIS_URL", None)
        celery_app.app.__dict__.pop("_taskdedup", None)

    # an approximate window: its scripts' bitmaps and the server's clock
    store = RedisStore.from_url(store_url)
    dedup = Deduplicator(store)
    window = Policy(mode="until_expired", ttl=60,
                    window=Approximate(capacity=1000, error_rate=0.01, partitions=2))
    identity = dedup.identity("acl.window", window, (1,))
    assert dedup.gate("acl.window", window, identity, "w-1").verdict is Verdict.ACCEPTED
    assert dedup.start("acl.window", window, identity.key, "w-1").verdict is Verdict.ACCEPTED
    dedup.finish("acl.window", window, identity.key, "w-1", success=True)  # remembered
    assert dedup.gate("acl.window", window, identity, "w-2").verdict is Verdict.DUPLICATE
    assert admin.keys("taskdedup:bloom:*")  # the window's slices

    # doctor: no problem with this user
    report = json.loads(cli(store_url, "doctor", "--json"))
    assert report["ok"] is True, report
    assert {c["check"] for c in report["checks"]} >= {"scripts", "acl", "commands", "windows"}

    # the operators' tools
    listed = json.loads(cli(store_url, "list", "--json"))
    rq_lock = next(row["key"] for row in listed if row["task"] == "tests.rq_jobs.record")
    assert json.loads(cli(store_url, "inspect", rq_lock, "--json"))["exists"] is True
    stats = json.loads(cli(store_url, "stats", "--json"))
    assert "acl.window" in stats and "window" in stats["acl.window"]
    assert "tests.rq_jobs.record" in cli(store_url, "stats")
    app = create_app(store_url, allow_clear=True, token=TOKEN)
    try:
        web = TestClient(app, base_url="http://127.0.0.1")
        for path in ("/", "/locks", "/api/stats", "/api/series"):
            assert web.get(path).status_code == 200, path
        assert web.get("/lock", params={"key": rq_lock}).status_code == 200
        owner = web.get("/api/lock", params={"key": rq_lock}).json()["owner"]
        cleared = web.post("/api/clear", json={"key": rq_lock, "owner": owner},
                           headers={TOKEN_HEADER: TOKEN})
        assert cleared.status_code == 200, cleared.text
    finally:
        app.state.dashboard.history.stop()
    assert "deleted 1 lock" in cli(store_url, "clear", "--task", "tests.celery_app.record",
                                   "--yes")
    assert "deleted" in cli(store_url, "clear", "--all", "--yes")
    left = [k for k in admin.scan_iter(match="taskdedup:*")
            if not k.startswith((b"taskdedup:stats:", b"taskdedup:bloom:"))]
    assert left == []
    store.close()
