"""The Django example project (``examples/django_project``) with real workers.

Celery configured from Django's settings (``CELERY_TASKDEDUP_*`` through the ``CELERY``
namespace) and django-rq with taskdedup's queue, job and worker classes (``RQ`` setting),
each driven from a ``manage.py shell -c`` subprocess: Django is never set up in the test
process, whose global state the rest of the suite shares.

Django and django-rq are in the ``django`` dependency group (the whole-suite nox session
only). Without them this module is skipped, except on CI, where that is an error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from taskdedup.stores.base import LockState
from taskdedup.stores.redis import RedisStore
from taskdedup.testing import wait_for
from tests.workers import CeleryWorker

PROJECT = Path(__file__).resolve().parent.parent / "examples" / "django_project"
BROKER_DB, LOCKS_DB = 12, 13  # databases of their own on the session's server

# Looked up, not imported: importing django_rq reads Django's settings.
_MISSING = [name for name in ("django", "django_rq") if importlib.util.find_spec(name) is None]
if _MISSING:
    _WHY = (f"not installed: {', '.join(_MISSING)} (the 'django' dependency group: "
            "pip install django django-rq)")
    if os.environ.get("CI"):  # as for a missing Redis binary: on CI an error, not a skip
        pytest.fail(_WHY, pytrace=False)
    pytest.skip(_WHY, allow_module_level=True)

pytestmark = pytest.mark.slow


def _db_url(url: str, db: int) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{db}"))


@pytest.fixture
def project_env(redis_url: str) -> Iterator[dict[str, str]]:
    """The environment the example project runs in: its Redis URLs point at two flushed
    databases of the session's server, and taskdedup's own environment variables are unset,
    so that only the project's settings can configure it."""
    urls = {"REDIS_URL": _db_url(redis_url, BROKER_DB),
            "DEDUP_REDIS_URL": _db_url(redis_url, LOCKS_DB)}
    for url in urls.values():
        with redis.Redis.from_url(url) as client:
            client.flushdb()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKDEDUP_")}
    # Empty, not only absent: the Celery worker's environment is laid over the test's own.
    env.update(urls, TASKDEDUP_URL="", TASKDEDUP_PREFIX="",
               DJANGO_SETTINGS_MODULE="mysite.settings", PYTHONPATH=str(PROJECT))
    yield env


def manage(env: dict[str, str], *args: str, timeout: float = 60.0) -> str:
    """``python manage.py <args>`` in the project's directory; its stdout (it must exit 0).

    One still running at ``timeout`` is sent SIGABRT: with PYTHONFAULTHANDLER it prints every
    thread's stack to its stderr, which the failure shows."""
    with subprocess.Popen(
        [sys.executable, "manage.py", *args], cwd=PROJECT,
        env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)
            try:
                stdout, stderr = process.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                stdout, stderr = process.communicate()
            raise AssertionError(f"manage.py {' '.join(args)} still running after {timeout} s "
                                 f"(sent SIGABRT):\n{stdout}{stderr}") from None
    assert process.returncode == 0, stdout + stderr
    return stdout


def shell(env: dict[str, str], code: str) -> object:
    """Run ``code`` in ``manage.py shell -c``; the JSON it printed last."""
    return json.loads(manage(env, "shell", "-c", code).strip().splitlines()[-1])


class ProjectCeleryWorker(CeleryWorker):
    """``celery -A mysite worker``: the project's app, loaded the way Celery's Django docs
    say (``mysite/__init__.py`` imports ``mysite/celery.py``)."""

    kind = "django-celery-worker"
    app_module = "mysite"

    def environment(self) -> dict[str, str]:
        return {"PYTHONPATH": str(PROJECT)}


def lock_keys(client: redis.Redis, pattern: str) -> list[str]:
    return sorted(k.decode() for k in client.scan_iter(match=pattern))


def test_celery_reads_taskdedup_settings_from_django(
    redis_url: str, project_env: dict[str, str]
) -> None:
    broker = redis.Redis.from_url(project_env["REDIS_URL"])
    locks = redis.Redis.from_url(project_env["DEDUP_REDIS_URL"])
    # The worker gets exactly the project's environment (extra_env overrides all of it).
    worker = ProjectCeleryWorker(redis_url, queue="celery", concurrency=2, env=project_env)
    try:
        worker.start()
        sent = shell(project_env, """
import json
from orders.tasks import charge_order, send_receipt
charges = [charge_order.delay("ORD-1", 5000).id for _ in range(4)]
charges.append(charge_order.delay(order_id="ORD-1", amount_cents=5000).id)
receipts = [send_receipt.delay("ORD-1").id for _ in range(3)]
print(json.dumps({"charges": charges, "receipts": receipts}))
""")
        assert isinstance(sent, dict)
        assert len(set(sent["charges"])) == 1, sent  # every duplicate got the original's id
        assert len(set(sent["receipts"])) == 3, sent  # the plain task is not gated

        def ledger(effect: str) -> list[bytes]:
            return broker.lrange(f"ledger:{effect}:ORD-1", 0, -1)  # type: ignore[return-value]

        def all_done() -> bool:
            results = [broker.get(f"celery-task-meta-{task_id}")
                       for task_id in {*sent["charges"], *sent["receipts"]}]
            return all(r is not None and json.loads(r)["status"] == "SUCCESS" for r in results)

        wait_for(all_done, timeout=30, what="the charge and the three receipts finished")
        assert broker.llen("celery") == 0  # nothing left queued
        assert ledger("charges") == [b"5000"]  # the gated body ran once
        assert ledger("receipts") == [b"1", b"1", b"1"]  # the plain one every time

        # CELERY_TASKDEDUP_URL and CELERY_TASKDEDUP_PREFIX took effect: the lock is in the
        # database DEDUP_REDIS_URL names, under the project's prefix, and the worker guard
        # completed it there; nothing of taskdedup's is in the broker's database.
        keys = lock_keys(locks, "mysite:orders.tasks.charge_order:*")
        assert len(keys) == 1, lock_keys(locks, "*")
        info = RedisStore(locks).get(keys[0])
        assert info is not None and info.state is LockState.DONE, info
        assert info.owner == sent["charges"][0]
        assert lock_keys(broker, "mysite:*") == [] and lock_keys(broker, "taskdedup:*") == []
        assert lock_keys(locks, "taskdedup:*") == []
    finally:
        worker.stop()


def test_django_rq_queue_job_and_worker_are_taskdedups(project_env: dict[str, str]) -> None:
    queues = redis.Redis.from_url(project_env["REDIS_URL"])
    sent = shell(project_env, """
import json
import django_rq
from orders.jobs import reserve_stock
queue = django_rq.get_queue("default")
jobs = [queue.enqueue(reserve_stock, "ORD-2", 1) for _ in range(3)]
jobs.append(queue.enqueue_call(reserve_stock, args=("ORD-2", 1)))
cancelled = queue.enqueue(reserve_stock, "ORD-3", 5)
cancelled.cancel()
print(json.dumps({"ids": [job.id for job in jobs], "cancelled": cancelled.id}))
""")
    assert isinstance(sent, dict)
    ids = sent["ids"]
    assert len(set(ids)) == 1, sent  # the default policy: a duplicate returns the original
    assert queues.lrange("rq:queue:default", 0, -1) == [ids[0].encode()]  # queued once

    # RQ["JOB_CLASS"] took effect: the cancelled DedupJob released its lock (a plain
    # rq.job.Job would leave it reserved for the policy's ttl).
    keys = lock_keys(queues, "taskdedup:orders.jobs.reserve_stock:*")
    assert len(keys) == 1, keys

    # The documented worker command; --burst returns once the queue is empty (or the
    # subprocess times out at the deadline).
    manage(project_env, "rqworker", "--burst", "default", timeout=60)

    assert queues.lrange("ledger:stock:ORD-2", 0, -1) == [b"1"]  # the body ran once
    assert queues.lrange("ledger:stock:ORD-3", 0, -1) == []
    assert queues.hget(f"rq:job:{ids[0]}", "status") == b"finished"
    # RQ["WORKER_CLASS"] took effect: DedupWorker claimed the lock and completed it (the
    # default policy keeps it ttl after success); a plain RQ worker would leave it QUEUED.
    info = RedisStore(queues).get(keys[0])
    assert info is not None and info.state is LockState.DONE, info
    assert info.owner == ids[0]


def test_django_rq_keeps_commit_mode_a_call_in_a_transaction_is_gated_when_it_commits(
    project_env: dict[str, str],
) -> None:
    """django-rq's default COMMIT_MODE ("on_db_commit") holds an enqueue made inside
    ``transaction.atomic()`` until the commit; DjangoDedupQueue holds the whole gated call,
    so a rollback leaves neither a job nor a lock, and the transaction's two identical calls
    make one job at the commit. (Plain DedupQueue enqueued at once, inside the transaction.)"""
    queues = redis.Redis.from_url(project_env["REDIS_URL"])
    sent = shell(project_env, """
import json
import django_rq
from django.db import transaction
from orders.jobs import reserve_stock
queue = django_rq.get_queue("default")
with transaction.atomic():
    inside = [queue.enqueue(reserve_stock, "ORD-4", 1) for _ in range(2)]
    queued_inside = queue.count
try:
    with transaction.atomic():
        queue.enqueue(reserve_stock, "ORD-5", 1)
        raise RuntimeError("rolled back")
except RuntimeError:
    pass
after = queue.enqueue(reserve_stock, "ORD-4", 1)  # outside a transaction: at once
print(json.dumps({"kind": type(queue).__name__, "inside": [j is None for j in inside],
                  "queued_inside": queued_inside, "count": queue.count, "after": after.id}))
""")
    assert isinstance(sent, dict)
    assert sent["kind"] == "DjangoDedupQueue"
    assert sent["inside"] == [True, True] and sent["queued_inside"] == 0  # held to the commit
    assert sent["count"] == 1  # the two calls of the transaction: one job
    assert queues.lrange("rq:queue:default", 0, -1) == [sent["after"].encode()]  # a duplicate
    keys = lock_keys(queues, "taskdedup:orders.jobs.reserve_stock:*")
    assert len(keys) == 1, keys  # ORD-4's; the rolled-back ORD-5 reserved nothing
    info = RedisStore(queues).get(keys[0])
    assert info is not None and info.owner == sent["after"] and info.state is LockState.QUEUED


def test_django_rq_request_finished_mode_enqueues_the_gated_calls_when_the_request_ends(
    project_env: dict[str, str],
) -> None:
    """COMMIT_MODE "request_finished": django-rq keeps the calls in a thread-local list and
    its request_finished handler (``thread_queue.commit``) enqueues them; DjangoDedupQueue's
    calls, gate included, wait there too, and two identical ones make one job."""
    queues = redis.Redis.from_url(project_env["REDIS_URL"])
    sent = shell(project_env, """
import json
import django_rq
from django_rq import thread_queue
from orders.jobs import reserve_stock
from taskdedup.rq.django import DjangoDedupQueue
queue = DjangoDedupQueue("default", connection=django_rq.get_connection("default"),
                         commit_mode="request_finished")
held = [queue.enqueue(reserve_stock, "ORD-6", 1) is None for _ in range(2)]
before = queue.count
thread_queue.commit()  # what django-rq connects to request_finished in this mode
print(json.dumps({"held": held, "before": before, "after": queue.count}))
""")
    assert sent == {"held": [True, True], "before": 0, "after": 1}
    keys = lock_keys(queues, "taskdedup:orders.jobs.reserve_stock:*")
    assert len(keys) == 1, keys
    (job_id,) = [j.decode() for j in queues.lrange("rq:queue:default", 0, -1)]
    info = RedisStore(queues).get(keys[0])
    assert info is not None and info.owner == job_id


def test_the_dashboard_is_served_beside_django_from_one_asgi_app(
    project_env: dict[str, str],
) -> None:
    """``mysite/asgi.py``: the dashboard under /ops/taskdedup shows the project's locks (its
    prefix, its lock store), and Django still answers every other path."""
    sent = shell(project_env, """
import json
from orders.tasks import charge_order
from starlette.testclient import TestClient
from mysite.asgi import application, dashboard
charge_order.delay("ORD-7", 700)  # a lock under the mysite prefix (no worker: it stays queued)
try:
    web = TestClient(application, base_url="http://localhost")  # in ALLOWED_HOSTS
    home = web.get("/ops/taskdedup/")
    locks = web.get("/ops/taskdedup/locks", params={"task": "orders.tasks.charge_order"})
    health, missing = web.get("/health/"), web.get("/no-such-page/")
    print(json.dumps({"home": home.status_code, "locks": locks.text,
                      "health": [health.status_code, health.text],
                      "missing": missing.status_code}))
finally:
    dashboard.state.dashboard.history.stop()
""")
    assert isinstance(sent, dict)
    assert sent["home"] == 200
    assert "orders.tasks.charge_order" in sent["locks"] and "queued" in sent["locks"]
    assert "mysite:orders.tasks.charge_order:" in sent["locks"]  # the project's prefix
    assert sent["health"] == [200, "ok"] and sent["missing"] == 404  # Django's own paths
