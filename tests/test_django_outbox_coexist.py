"""taskdedup's Django outbox in a project that also uses django-celery-outbox
(docs/explanation/outbox-prior-art.md, "If your project already uses it").

A Django project of its own (written into the test's directory): an ``OutboxCelery`` app
(django-celery-outbox's ``Celery`` subclass), ``celery_outbox`` and ``taskdedup_outbox``
migrated on a real SQLite file, a gated ``DedupTask`` and a plain task, on the suite's Redis.

- With the gated task in ``CELERY_OUTBOX_EXCLUDE_TASKS``, ``taskdedup.django.outbox.add`` in
  ``transaction.atomic()`` is published once by the commit, through taskdedup's gate (one
  message on the broker and one lock, under the id ``add`` returned), and no ``celery_outbox``
  row.
- Without the exclusion, ``OutboxCelery`` turns taskdedup's after-commit publish into a
  ``celery_outbox`` row, and nothing reaches the broker (nor, with the locks in the broker's
  Redis, the lock): the doc's advice is needed.
- A plain task sent with ``.delay()`` on the same app is still a ``celery_outbox`` row.

Django runs in a subprocess, as in tests/test_django_outbox.py. django-celery-outbox is in the
``django`` dependency group: without it this module is skipped, except on CI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import redis

_MISSING = [name for name in ("django", "django_celery_outbox")
            if importlib.util.find_spec(name) is None]
if _MISSING:
    _WHY = f"not installed: {', '.join(_MISSING)} (the 'django' dependency group)"
    if os.environ.get("CI"):
        pytest.fail(_WHY, pytrace=False)
    pytest.skip(_WHY, allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent

SETTINGS = '''
import os

SECRET_KEY = "only-for-this-test"
INSTALLED_APPS = ["django.contrib.contenttypes", "taskdedup.django", "django_celery_outbox"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["DB"]}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True

CELERY_BROKER_URL = os.environ["REDIS_URL"]
CELERY_TASK_DEFAULT_QUEUE = os.environ["QUEUE"]  # a queue of this test's own
CELERY_TASKDEDUP_PREFIX = os.environ["QUEUE"]
CELERY_OUTBOX_APP = "coexist_app.app"
# What the doc advises: the tasks sent through taskdedup's outbox are not captured again.
CELERY_OUTBOX_EXCLUDE_TASKS = ["coexist.charge"]
'''

APP = '''
from django_celery_outbox.app import OutboxCelery

from taskdedup import Policy
from taskdedup.celery import DedupTask

app = OutboxCelery("coexist")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task(base=DedupTask, dedup=Policy(ttl=600), name="coexist.charge")
def charge(order: str, cents: int) -> None:
    """Gated, and sent through taskdedup's outbox."""


@app.task(name="coexist.receipt")
def receipt(order: str) -> None:
    """Plain, and sent with .delay(): django-celery-outbox's."""
'''

SCENARIO = '''
import json

import django

django.setup()

from django.core.management import call_command
from django.db import transaction
from django.test import override_settings

call_command("migrate", verbosity=0)

from coexist_app import charge, receipt
from django_celery_outbox.models import CeleryOutbox

from taskdedup.django import outbox
from taskdedup.django.models import OutboxRow


def after(send):
    """Send in a transaction; then the rows of both outboxes."""
    with transaction.atomic():
        sent = send()
    return {"id": sent,
            "celery_outbox": [[r.task_id, r.task_name] for r in CeleryOutbox.objects.all()],
            "taskdedup_outbox": OutboxRow.objects.count()}


figures = {"excluded": after(lambda: outbox.add(charge, "A", 100))}
with override_settings(CELERY_OUTBOX_EXCLUDE_TASKS=[]):
    figures["not_excluded"] = after(lambda: outbox.add(charge, "B", 100))
CeleryOutbox.objects.all().delete()
figures["plain"] = after(lambda: receipt.delay("A").id)
print(json.dumps(figures))
'''


def _queued(broker: redis.Redis, queue: str) -> list[tuple[str, str]]:
    """(task id, task name) of every message on ``queue``."""
    return [(m["headers"]["id"], m["headers"]["task"])
            for m in map(json.loads, broker.lrange(queue, 0, -1))]


def test_taskdedup_outbox_beside_django_celery_outbox(tmp_path: Path, redis_url: str) -> None:
    for name, text in (("coexist_settings", SETTINGS), ("coexist_app", APP),
                       ("scenario", SCENARIO)):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    queue = f"coexist-{uuid.uuid4().hex[:12]}"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "coexist_settings", "REDIS_URL": redis_url,
           "QUEUE": queue, "DB": str(tmp_path / "db.sqlite3"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "scenario.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    broker = redis.Redis.from_url(redis_url)
    try:
        excluded, not_excluded, plain = (figures[k] for k in ("excluded", "not_excluded",
                                                              "plain"))
        # Excluded: the commit published it once, through taskdedup, under add()'s id.
        assert excluded["celery_outbox"] == []
        assert excluded["taskdedup_outbox"] == 0
        # Not excluded: OutboxCelery captured taskdedup's own publish as a second outbox row.
        assert not_excluded["celery_outbox"] == [[not_excluded["id"], "coexist.charge"]]
        assert not_excluded["taskdedup_outbox"] == 0
        # A plain .delay() on the same app is still django-celery-outbox's.
        assert plain["celery_outbox"] == [[plain["id"], "coexist.receipt"]]
        # On the broker: the excluded call only, once.
        assert _queued(broker, queue) == [(excluded["id"], "coexist.charge")]
        # The excluded call went through the gate: one lock, holding its id. The captured one
        # wrote none (with the locks in the broker's Redis the lock is written with the
        # publish, which OutboxCelery replaced by its row).
        locks = [broker.get(key) or b"" for key in broker.scan_iter(f"{queue}:coexist.*")]
        assert len(locks) == 1 and excluded["id"].encode() in locks[0], locks
    finally:
        broker.delete(queue)
        for key in broker.scan_iter(f"{queue}*"):
            broker.delete(key)
