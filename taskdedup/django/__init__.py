"""``taskdedup.django``: the durable tier and the transactional outbox on Django's ORM.

A Django app (``INSTALLED_APPS = [..., "taskdedup.django"]``, app label ``taskdedup``):
``manage.py migrate`` creates ``taskdedup_effects`` and ``taskdedup_outbox`` (the SQLAlchemy
tier's tables, column for column), with read-only admin pages for both::

    from django.db import transaction
    from taskdedup.django import effects, outbox

    with transaction.atomic():                  # the task's own transaction
        with effects() as fx:                   # key: the running task's identity
            if not fx.first:
                return fx.result                # an earlier run committed: nothing is redone
            Charge.objects.create(order=order, cents=cents)
            fx.result = {"charged": cents}      # stored with the row, same transaction

    with transaction.atomic():                  # a view's transaction
        order = Order.objects.create(ref="ORD-7", cents=5000)
        outbox.add(charge.s(order.ref, 5000))   # published after the commit, at least once

Modules: ``recorder`` (``effects``), ``outbox`` (``add`` and the relay's row source
over the ORM), ``models``, ``admin``, ``settings`` (the project's Celery app and RQ
connection for the relay), ``management/commands`` (``taskdedup_relay``,
``taskdedup_outbox_status``). Importing this package does not import Django's ORM: Django
imports it while it loads its apps.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .recorder import DEFAULT_TTL, Effects, effects

__all__ = ["DEFAULT_TTL", "Effects", "effects"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module(f"{__name__}.recorder"), name)
        globals()[name] = value
        return value
    if name == "outbox":
        return importlib.import_module(f"{__name__}.outbox")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
