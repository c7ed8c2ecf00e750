"""Eager mode (``task_always_eager``): a duplicate's handle is its original's ``EagerResult``.

Celery runs an eager call in the caller's thread and hands back an ``EagerResult``, whose
``get()`` returns at once. A duplicate answered with ``AsyncResult(original id)`` would ask the
result backend instead: ``NotImplementedError`` without one (the usual test settings), a wait
with one. So this process keeps its latest eager results by task id, and a duplicate gets its
original's; an original that did not run eagerly here (its lock was taken elsewhere) gets an
``EagerResult`` in state PENDING, whose ``get()`` returns ``None`` at once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from celery import states
from celery.result import EagerResult

__all__ = ["handle", "remember"]

KEEP = 1000
"""How many eager results are kept (the latest): enough for a test, bounded for a process."""

_results: OrderedDict[str, Any] = OrderedDict()
_lock = threading.Lock()


def remember(result: Any) -> None:
    """Keep ``result`` when it is an eager one (anything else is left alone)."""
    if not isinstance(result, EagerResult):
        return
    with _lock:
        _results[result.id] = result
        _results.move_to_end(result.id)
        while len(_results) > KEEP:
            _results.popitem(last=False)


def handle(task_id: str) -> Any:
    """The handle of ``task_id`` for a duplicate made in eager mode."""
    with _lock:
        found = _results.get(task_id)
    return found if found is not None else EagerResult(task_id, None, states.PENDING)
