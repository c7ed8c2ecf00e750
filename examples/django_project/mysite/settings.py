"""Settings of the example project: Celery and django-rq, both with taskdedup.

Secrets and URLs come from the environment, with defaults for a local Redis. See
docs/how-to/django.md for what each taskdedup setting does.
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "django-insecure-only-for-local-development")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1").split(",")

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_rq",
    "orders",
]

ROOT_URLCONF = "mysite.urls"
ASGI_APPLICATION = "mysite.asgi.application"  # Django and taskdedup's dashboard (asgi.py)

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": BASE_DIR / "db.sqlite3",
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"

# One Redis for the Celery broker and results, and for django-rq's queues.
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

# -- Celery (mysite/celery.py reads every CELERY_* setting) ----------------------------------

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ACKS_LATE = True

# taskdedup's settings, read by DedupTask through the same namespace. The locks live in the
# broker's Redis (where a gated call costs no extra round trip) unless DEDUP_REDIS_URL names
# another one.
CELERY_TASKDEDUP_URL = os.environ.get("DEDUP_REDIS_URL") or None
CELERY_TASKDEDUP_PREFIX = "mysite"  # the first component of every lock key

# -- django-rq --------------------------------------------------------------------------------

RQ_QUEUES = {
    "default": {"URL": REDIS_URL, "DEFAULT_TIMEOUT": 360},
}
RQ = {
    # get_queue() gates enqueue and enqueue_call, and keeps django-rq's COMMIT_MODE (default
    # "on_db_commit": a call made inside a transaction is enqueued when it commits).
    "QUEUE_CLASS": "taskdedup.rq.django.DjangoDedupQueue",
    "JOB_CLASS": "taskdedup.rq.DedupJob",  # cancel/delete release the lock
    "WORKER_CLASS": "taskdedup.rq.DedupWorker",  # manage.py rqworker guards each job
}
