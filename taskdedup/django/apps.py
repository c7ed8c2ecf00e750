"""The Django app's configuration: ``INSTALLED_APPS = [..., "taskdedup.django"]``."""

from __future__ import annotations

from django.apps import AppConfig

__all__ = ["TaskDedupConfig"]


class TaskDedupConfig(AppConfig):  # type: ignore[misc]
    """taskdedup's tables (``taskdedup_effects``, ``taskdedup_outbox``), their read-only admin
    pages and the outbox's management commands, under the app label ``taskdedup``."""

    name = "taskdedup.django"
    label = "taskdedup"
    verbose_name = "taskdedup"
    default_auto_field = "django.db.models.AutoField"  # unused: every primary key is given
