"""Which lock each task id holds on this worker, so every release path finds it by task id.

Celery's signals do not all carry a usable request: ``task_failure`` from the internal-error
path comes after the request was popped, the worker's main process sends ``task_failure``
(lost worker, hard time limit) with the arguments only, and ``task_revoked`` gets a
``Context`` without the message. Recomputing the key from the arguments is wrong for a call
made with ``dedup_key``, and such a lock would stay held (renewed by the heartbeat while the
pool process lives). So:

- in the pool process, ``before_start`` records ``{task id: (task name, lock key)}`` for the
  lock it claimed, and whatever completes or releases it takes the entry out;
- in the main process, ``task_received`` keeps the received ``Request`` by task id, weakly:
  the entry goes when the worker lets the request go, so this cannot grow without bound.
"""

from __future__ import annotations

import weakref
from typing import Any

from . import _compat, holders
from ._message import HEADER, carried_key, is_off

__all__ = ["forget", "header_key", "lookup", "receive", "received_header", "record"]

_claimed: dict[str, tuple[str, str]] = {}
_received: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def record(task_id: str, name: str, key: str) -> None:
    """``task_id`` (of task ``name``) claimed ``key`` in this process (and, in a pool
    process, its slot in :mod:`~taskdedup.celery.holders` says so)."""
    _claimed[task_id] = (name, key)
    holders.hold(task_id)


def lookup(task_id: str | None, name: str) -> str | None:
    """The key ``task_id`` claimed in this process, if any (and if it is ``name``'s)."""
    entry = _claimed.get(task_id) if task_id else None
    return entry[1] if entry is not None and entry[0] == name else None


def forget(task_id: str | None) -> None:
    """The lock of ``task_id`` was completed or released: drop its entry."""
    if task_id:
        if _claimed.pop(task_id, None) is not None:
            holders.clear(task_id)


def receive(request: Any) -> None:
    """Keep a received request (main process) until the worker drops it."""
    task_id = getattr(request, "id", None)
    if task_id and HEADER in _compat.request_dict(request):
        try:
            _received[task_id] = request
        except TypeError:  # a request type without weak references: recompute instead
            pass


def received_header(task_id: str | None) -> Any:
    """The ``taskdedup`` header of the request received for ``task_id`` (main process)."""
    request = _received.get(task_id) if task_id else None
    return None if request is None else _compat.request_dict(request).get(HEADER)


def header_key(raw: Any, name: str) -> tuple[bool, str | None]:
    """``(known, key)`` from a header: known when the header speaks for task ``name`` (its
    lock key, or None for a bypassed call)."""
    if is_off(raw, name):
        return True, None
    key = carried_key(raw, name)
    return key is not None, key
