"""The example project's package. The Celery app is loaded when Django starts, so that
``@shared_task`` (and ``DedupTask``) bind to it (Celery's "First steps with Django")."""

from .celery import app as celery_app

__all__ = ("celery_app",)
