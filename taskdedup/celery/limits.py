"""Per-key limits on a Celery worker (SPEC §16): ``@app.task(base=DedupTask, limits=[...])``.

:meth:`DedupTask.before_start <taskdedup.celery.DedupTask.before_start>` claims the lock,
then calls :func:`enter` (before it writes STARTED, when it tracks that; a task without a
policy calls it after its claim step): a skipped duplicate takes no slot; a call its limits
admit runs holding its slots (given back in ``task_postrun``, whatever the outcome:
success, failure, retry, ignore); a call a limit refuses is put off with the republish of a copy
(``DedupTask._defer``: same id, not a retry, a countdown, no pool process held while it
waits), its lock turned back to ``queued`` by its own id first so the republished message
claims it; ``on_excess="drop"`` ends it FAILURE with :class:`~taskdedup.RateLimitedError`.
Eager calls are not limited (they cannot be put off).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from celery import signals

from .. import limits
from ..core import Identity
from ..exceptions import StoreUnavailableError
from ..limits import LIMITED_SINCE, RateLimitedError
from ..policy import MAX_DURATION_MS, Mode, Policy, is_disabled
from ..stores.redis import refused
from . import claims
from ._message import SKIP_ATTR, SKIPPED, STATE_ATTR
from .config import get_deduplicator, visibility_timeout

if TYPE_CHECKING:
    from .task import DedupTask

__all__ = ["SLOTS_ATTR", "enter"]

SLOTS_ATTR: Final = "_taskdedup_slots"
"""Request attribute: the slots an execution holds while its body runs."""
_ENTERED: Final = "_taskdedup_limited"
"""Request attribute: this execution's limits were taken (or refused) already."""
_DEFAULT_POLICY: Final = Policy()


def enter(task: DedupTask, task_id: str, args: Sequence[Any],
          kwargs: Mapping[str, Any] | None) -> None:
    """Take ``task``'s limits for the body about to run, or put the call off / drop it
    (raising what ends this execution)."""
    request = task.request
    if (not task._dedup_limits or is_disabled() or request.is_eager
            or getattr(request, SKIP_ATTR, None) is not None
            or request.__dict__.get(_ENTERED)):
        return
    request.__dict__[_ENTERED] = True
    dedup = get_deduplicator(task.app)
    policy = task._dedup_policy or _DEFAULT_POLICY
    try:
        admission = limits.admit(dedup, task.name, task._dedup_limits, args, kwargs or {},
                                 task_id, policy.lease_ms)
    except StoreUnavailableError as exc:  # never run past a limit: tried again later
        if refused(exc):  # the same answer every time: this call's error, not an outage
            raise limits.refusal(task.name, task_id, exc) from exc
        _unclaim(task, request, policy, 0.0)
        raise task._retry_later(exc) from exc
    since = limits.limited_since(_carried(request))
    if admission.ok:
        setattr(request, SLOTS_ATTR, admission.slots)
        if since is not None:
            limits.note_waiting(dedup, task.name, task_id, None)
        return
    if admission.dropped:
        limits.note_waiting(dedup, task.name, task_id, None)
        raise RateLimitedError(task.name, repr(admission.limit))  # FAILURE: lock released
    assert admission.limit is not None
    now = time.time()
    waited = 0.0 if since is None else max(0.0, now - since)
    delay = limits.limit_delay(admission.limit, admission.wait_ms, waited, policy.lease,
                               visibility_timeout(task.app))
    held = _unclaim(task, request, policy, delay)
    limits.note_waiting(dedup, task.name, task_id, delay)
    try:
        put_off = task._defer(policy, delay, {LIMITED_SINCE: now if since is None else since})
    except Exception:  # not put off: the call ends with the publish error, holding nothing
        limits.note_waiting(dedup, task.name, task_id, None)
        if held is not None:
            dedup.release(task.name, held, task_id, reason="limit")
        raise
    raise put_off


def _carried(request: Any) -> Any:
    headers = request.headers if isinstance(request.headers, Mapping) else {}
    return headers.get(LIMITED_SINCE, getattr(request, LIMITED_SINCE, None))


def _unclaim(task: DedupTask, request: Any, policy: Policy, delay: float) -> str | None:
    """Hand back the running lock this execution claimed before its limits refused it: to
    ``queued`` by its own id for ``ttl`` + ``delay`` (the republished message claims it; a
    third party's duplicate meanwhile is still suppressed), or released under
    ``while_executing`` (it is not executing). The request is marked so the signal handlers
    leave the lock alone. Returns the key of the lock kept queued for this call, else None."""
    key = getattr(request, STATE_ATTR, None)
    setattr(request, STATE_ATTR, SKIPPED)
    if not key or key == SKIPPED:
        return None
    claims.forget(request.id)
    dedup = get_deduplicator(task.app)
    dedup.stop_heartbeat(key, request.id)
    if policy.mode is Mode.WHILE_EXECUTING:
        dedup.release(task.name, key, request.id, reason="limit")
        return None
    ttl_ms = min(policy.ttl_ms + int(delay * 1000), MAX_DURATION_MS)
    try:
        dedup.gate(task.name, policy, Identity(key), request.id, ttl_ms=ttl_ms, again="limit")
    except StoreUnavailableError:  # the running lock lapses within its lease; then claimed
        pass
    return str(key)


def _on_postrun(sender: Any = None, **_: Any) -> None:
    """Give back the slots of an execution whose body has ended."""
    request = getattr(sender, "request", None)
    slots = request.__dict__.pop(SLOTS_ATTR, None) if request is not None else None
    if slots:
        limits.release(get_deduplicator(sender.app), slots)


signals.task_postrun.connect(_on_postrun, weak=False)
