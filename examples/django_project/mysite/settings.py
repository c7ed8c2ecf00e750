"""Settings of the example project: Celery and django-rq, both with taskdedup, and taskdedup's
Django app (durable effects and the transactional outbox on the ORM).

Secrets and URLs come from the environment, with defaults for a local Redis and a SQLite file.
See docs/how-to/django.md for what each taskdedup setting does.
"""

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "django-insecure-only-for-local-development")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1").split(",")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_rq",
    "taskdedup.django",  # taskdedup_effects and taskdedup_outbox (manage.py migrate)
    "orders",
]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]

ROOT_URLCONF = "mysite.urls"
ASGI_APPLICATION = "mysite.asgi.application"  # Django and taskdedup's dashboard (asgi.py)



def _database(url: str) -> dict[str, object]:
    """``DATABASES["default"]`` from ``DJANGO_DATABASE_URL``: ``sqlite:///<path>`` or
    ``postgresql://user:password@host:port/name`` (psycopg 3); empty: ``db.sqlite3`` here."""
    if not url:
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "db.sqlite3"}
    if url.startswith("sqlite:///"):  # a worker and a producer share the file: wait for locks
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": url[len("sqlite:///"):],
                "OPTIONS": {"timeout": 30}}
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres", "postgresql+psycopg"):
        raise ValueError(f"DJANGO_DATABASE_URL: sqlite:/// or postgresql:// only, not {url!r}")
    return {"ENGINE": "django.db.backends.postgresql", "NAME": parts.path.lstrip("/"),
            "USER": unquote(parts.username or ""), "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "", "PORT": str(parts.port or "")}


DATABASES = {"default": _database(os.environ.get("DJANGO_DATABASE_URL", ""))}
if os.environ.get("DJANGO_OTHER_DATABASE_URL"):  # a second alias (the tests' using="other")
    DATABASES["other"] = _database(os.environ["DJANGO_OTHER_DATABASE_URL"])
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

# -- taskdedup's outbox relay (manage.py taskdedup_relay) -----------------------------------

# The Celery app the relay publishes with (default: the one mysite/celery.py makes current).
TASKDEDUP_CELERY_APP = "mysite.celery:app"

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
