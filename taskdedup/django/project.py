"""What the relay publishes with, found the way a Django project configures it: the project's
Celery app and RQ's Redis connection."""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

from django.conf import settings

from ..exceptions import ConfigurationError

__all__ = ["celery_app", "publisher", "rq_connection"]


def _import(path: str) -> Any:
    """``"package.module:attr"`` (or ``"package.module.attr"``)."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigurationError(
            f"TASKDEDUP_CELERY_APP = {path!r} names no object ('package.module:app', e.g. "
            f"'mysite.celery:app'): {exc}"
        ) from exc


def celery_app() -> Any:
    """The project's Celery app: ``settings.TASKDEDUP_CELERY_APP`` (``"mysite.celery:app"``);
    else the app Celery's Django recipe makes current (``<settings package>/celery.py``,
    imported first if the package has one); None without Celery."""
    wanted = getattr(settings, "TASKDEDUP_CELERY_APP", None)
    if wanted:
        return wanted if not isinstance(wanted, str) else _import(wanted)
    if importlib.util.find_spec("celery") is None:
        return None
    package = os.environ.get("DJANGO_SETTINGS_MODULE", "").rpartition(".")[0]
    if package and importlib.util.find_spec(f"{package}.celery") is not None:
        module = importlib.import_module(f"{package}.celery")
        for name in ("app", "celery_app", "celery"):
            app = getattr(module, name, None)
            if app is not None and hasattr(app, "send_task"):
                return app
    import celery

    return celery.current_app


def rq_connection() -> Any:
    """RQ's Redis connection: django-rq's (the queue ``settings.TASKDEDUP_RQ_QUEUE``,
    default ``"default"``) when it is installed and configured, else one from
    ``settings.RQ_REDIS_URL``; None when neither is set."""
    from django.apps import apps

    if apps.is_installed("django_rq"):
        import django_rq

        return django_rq.get_connection(getattr(settings, "TASKDEDUP_RQ_QUEUE", "default"))
    url = getattr(settings, "RQ_REDIS_URL", None)
    if url:
        import redis

        return redis.Redis.from_url(url)
    return None


def publisher() -> Any:
    """The relay's :class:`taskdedup.outbox.Publisher`: the project's Celery app and RQ
    connection (a row of a kind with neither fails to publish, named, and stays)."""
    from ..outbox import Publisher

    app = celery_app()
    if app is not None:
        # Celery imports the tasks' modules (autodiscover_tasks(), CELERY_IMPORTS) when a
        # worker starts, not when the app loads: without this the relay would know only the
        # tasks something else happened to import (the URLconf, through the system checks).
        app.loader.import_default_modules()
    return Publisher(celery_app=app, rq_connection=rq_connection())
