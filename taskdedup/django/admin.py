"""Read-only admin pages for ``taskdedup_effects`` and ``taskdedup_outbox``: rows are written
by ``effects()``, ``outbox.add()`` and the relay, never by hand (a row edited or deleted in
the admin would let a task run twice, or lose a committed call)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from .models import Effect, OutboxRow

__all__ = ["EffectAdmin", "OutboxRowAdmin", "ReadOnlyAdmin"]


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[misc]
    """Lists and shows rows (to a user with the view permission); no add, change or delete."""

    actions = None

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Effect)
class EffectAdmin(ReadOnlyAdmin):
    list_display = ("key", "task_id", "created", "expires")
    search_fields = ("key", "task_id")


@admin.register(OutboxRow)
class OutboxRowAdmin(ReadOnlyAdmin):
    list_display = ("id", "kind", "target", "created", "next_attempt", "attempts", "last_error")
    list_filter = ("kind", "target")
    search_fields = ("id", "target")
    exclude = ("body",)  # the arguments: never shown (they may hold personal data)
