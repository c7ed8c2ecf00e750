"""A gated body whose pool process died, its message requeued by Celery
(``task_reject_on_worker_lost``): the worker first turns the lock back to ``queued`` by the
message's own id (SPEC §5), so the requeued message runs at once instead of being put off as a
copy until the lock's lease lapses.

Only where that lock can be known to be the dead process's own: on a worker with the reliable
fetch (SPEC §17), for a message delivered once (not redelivered). Such a message has no other
copy — the reliable fetch never hands out a held message again while its worker lives — so a
lock running by its id is the one its dead pool process claimed. On kombu's fetch a message
held past ``visibility_timeout`` has copies: this one may have been put off in its claim step
while another copy's body runs under the same id, and turning that lock back would let two
bodies run at once; there, and for a redelivered message, the lease decides as before.

Celery's seam: the task's ``Request`` class (:attr:`DedupTask.Request
<taskdedup.celery.DedupTask>`); the main process calls ``on_failure`` with
``WorkerLostError`` when a pool process dies, and ``reject`` with
``requeue=True`` when it puts the message back.
"""

from __future__ import annotations

from typing import Any

from celery.exceptions import WorkerLostError
from celery.worker.request import Request

from ..core import Identity, Verdict
from ..events import logger
from ..exceptions import StoreUnavailableError
from ..policy import Mode, OnDuplicate, is_disabled
from ..stores.base import LockState
from . import _compat
from ._message import HEADER, carried_key
from .config import get_deduplicator, reliable_fetch

__all__ = ["DedupRequest", "turn_back"]

_LOST = "_taskdedup_lost"


class DedupRequest(Request):  # type: ignore[misc]
    """Celery's worker request, turning a lost body's lock back before the message is
    requeued (see the module's documentation)."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> Any:
        exc = getattr(exc_info, "exception", None)
        if not isinstance(exc, WorkerLostError):  # billiard wraps it: ExceptionWithTraceback
            exc = getattr(exc, "exc", None)
        lost = isinstance(exc, WorkerLostError)
        setattr(self, _LOST, lost)
        try:
            return super().on_failure(exc_info, send_failed_event=send_failed_event,
                                      return_ok=return_ok)
        finally:
            setattr(self, _LOST, False)

    def reject(self, requeue: bool = False) -> None:
        if requeue and getattr(self, _LOST, False) and not self.acknowledged:
            turn_back(self)
        super().reject(requeue=requeue)


def delivered_once(request: Any) -> bool:
    """Whether the broker says this is the message's first delivery (False when it cannot
    say: a Celery that does not carry ``redelivered``)."""
    delivery = request.delivery_info or {}
    if "redelivered" not in delivery or delivery["redelivered"]:
        return False
    return not _compat.request_dict(request).get("redelivered")


def turn_back(request: Any) -> bool:
    """Turn the lock of ``request``'s lost body back to ``queued`` by its id (released under
    ``while_executing``), when it is known to be that body's own and still runs by its id;
    True when it was turned back. A store that cannot be reached leaves it to the lease."""
    task = request.task
    policy = getattr(task, "_dedup_policy", None)
    if policy is None or is_disabled() or policy.mode is Mode.UNTIL_EXECUTING:
        return False
    if policy.debounce is not None or policy.on_duplicate in (OnDuplicate.COALESCE,
                                                              OnDuplicate.REPLACE):
        return False  # a generation to compare, a queued lock to displace: the lease decides
    if not reliable_fetch(task.app) or not delivered_once(request):
        return False
    dedup = get_deduplicator(task.app)
    carried = carried_key(_compat.request_dict(request).get(HEADER), task.name)
    key = dedup.trusted_key(task.name, policy, carried) if carried else None
    if key is None:
        return False
    try:
        held = dedup.store.get(key)
        if held is None or held.owner != request.id or held.state is not LockState.RUNNING:
            return False  # lapsed, finished, or another id's: nothing of this body's
        if policy.mode is Mode.WHILE_EXECUTING:
            done = dedup.release(task.name, key, request.id, reason="worker_lost")
        else:  # running by this id -> queued by it (a retry's re-reservation)
            done = dedup.gate(task.name, policy, Identity(key), request.id).verdict is (
                Verdict.ACCEPTED)
    except StoreUnavailableError as exc:
        logger.warning("taskdedup: could not turn the lock of %s[%s] back to queued before "
                       "its message is requeued (%s): it runs once its lease lapses",
                       task.name, request.id, exc)
        return False
    if done:
        logger.info("taskdedup: %s[%s]: its pool process was lost; the lock is queued again "
                    "for the requeued message", task.name, request.id)
    return done
