"""The worker guard's bookkeeping, on Celery's signals: complete or release the lock.

``task_success`` completes it; ``task_failure`` (also sent by the worker's main process for a
lost worker or a hard time limit, and after the request was popped on Celery's internal-error
path), ``task_internal_error``, ``task_revoked`` and ``task_postrun`` (for ``Ignore`` /
``Reject``) release it; ``task_retry`` keeps it for the retry. Every handler finds the lock by
task id first (:mod:`taskdedup.celery.claims`), then by the message's header, and recomputes
it from the arguments only as a last resort. Signals also cover tasks sent by name from
another process. Importing this module connects the handlers (once).
"""

from __future__ import annotations

from typing import Any

from celery import signals
from celery.exceptions import TimeLimitExceeded, WorkerLostError

from .. import running, stats
from ..events import logger
from ..policy import Mode
from ..stores import trail
from . import _compat, ahead, claims, handover, holders
from ._message import (
    COMPLETED_ATTR,
    HEADER,
    RELEASED_ATTR,
    RUNNING_ATTR,
    SKIPPED,
    STATE_ATTR,
    request_header,
)
from .config import get_deduplicator, say_fetch_path, say_publish_path, use_reliable_fetch
from .task import DedupTask

__all__: list[str] = []


def _dedup_task(sender: Any) -> DedupTask | None:
    return sender if isinstance(sender, DedupTask) and sender._dedup_policy is not None else None


def _own_key(task: DedupTask, request: Any, task_id: str | None) -> str | None:
    """The lock this execution claimed, or None: nothing of its own to complete or release.
    A request marked skipped (a duplicate, or a copy of a message whose other copy runs in
    this very process under the same id) owns nothing, whatever the claims table says."""
    state = getattr(request, STATE_ATTR, None) if request is not None else None
    if state == SKIPPED:
        return None
    key = claims.lookup(task_id, task.name) or state
    claims.forget(task_id)
    return str(key) if key else None


def _on_success(sender: Any = None, **_: Any) -> None:
    task = _dedup_task(sender)
    if task is None:
        return
    request = task.request
    if request.__dict__.pop(COMPLETED_ATTR, False):  # DedupTask.__call__ completed it
        claims.forget(request.id)
        return
    key = _own_key(task, request, request.id)
    if key:
        get_deduplicator(task.app).finish(  # the next task does not wait for its reply
            task.name, task._dedup_policy, key, request.id,  # type: ignore[arg-type]
            success=True, later=not request.is_eager,
        )


def _on_failure(
    sender: Any = None, task_id: str | None = None, args: Any = None, kwargs: Any = None,
    exception: Any = None, **_: Any
) -> None:
    """A final failure. In the pool process that ran it: release the lock this execution
    claimed, or only the reservation (``queued``) of one that failed before its claim — a
    ``running`` lock of its id is another copy's. In the worker's main process, for a pool
    process it lost (``WorkerLostError``, a hard time limit): the same, the claim read from
    :mod:`~taskdedup.celery.holders` — the dead process may have held only a copy being put
    off, and the ``running`` lock is then the live copy's; a lock the dead process held but
    did not record lapses within its lease (its heartbeat died with it)."""
    task = _dedup_task(sender)
    if task is None or task_id is None:
        return
    current = task.request
    if current is not None and current.id == task_id and current.__dict__.pop(
            RELEASED_ATTR, False):  # DedupTask.__call__ released it as the body raised
        claims.forget(task_id)
        return
    lost = isinstance(exception, (WorkerLostError, TimeLimitExceeded))
    claimed = claims.lookup(task_id, task.name) is not None
    key = _lock_key(task, task_id, None, args, kwargs)
    claims.forget(task_id)
    if not key:
        return
    held = _lost_held(task_id, exception) if lost else claimed
    if lost and not held:
        logger.info("taskdedup: %s[%s]: its pool process was lost without holding the lock "
                    "(another copy of its message may): only a reservation still queued by "
                    "this id is released (a lock the lost process did hold lapses within "
                    "its lease)", task.name, task_id)
    get_deduplicator(task.app).release(task.name, key, task_id, reason="failed",
                                       only_queued=not held)


def _lost_held(task_id: str, exception: Any) -> bool:
    """Whether the pool process the main process lost running ``task_id`` held its lock:
    what its slot in :mod:`~taskdedup.celery.holders` says for a lost process; where that
    cannot tell (a hard time limit, no table), unless another copy of the id runs on this
    worker now."""
    held = holders.lost_held(task_id) if isinstance(exception, WorkerLostError) else None
    if held is not None:
        return held
    return not _compat.active_copy(task_id)


def _on_internal_error(
    sender: Any = None, task_id: str | None = None, request: Any = None, **_: Any
) -> None:
    """Celery's internal-error path (a failing ``on_failure`` hook, a result that cannot be
    stored): the request is popped, and ``task_failure`` may follow or not. The task is a
    FAILURE: release the lock it claimed, or the reservation (``queued``) its message
    carries; a ``running`` lock of its id that it did not claim is another copy's."""
    task = _dedup_task(sender)
    if task is None or task_id is None:
        return
    claimed = claims.lookup(task_id, task.name) is not None
    key = _lock_key(task, task_id, request)
    claims.forget(task_id)
    if key:
        get_deduplicator(task.app).release(task.name, key, task_id, reason="internal_error",
                                           only_queued=not claimed)


def _on_retry(sender: Any = None, request: Any = None, **_: Any) -> None:
    task = _dedup_task(sender)
    if task is None or request is None:
        return
    key = _own_key(task, request, request.id)
    if not key:
        return
    dedup = get_deduplicator(task.app)
    if task._dedup_policy.mode is Mode.WHILE_EXECUTING:  # type: ignore[union-attr]
        dedup.release(task.name, key, request.id, reason="retry")  # not executing meanwhile
    else:  # the retry's publish re-reserved it for the countdown; just stop renewing
        dedup.stop_heartbeat(key, request.id)


def _on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    task = _dedup_task(sender)
    if task is None or request is None:
        return
    # Celery 5.3-5.7 send a Context built from the message (headers as attributes), not the
    # Request: _lock_key reads the header from either.
    task_id = request.id
    ahead.discard(task_id)  # its claim, sent as the message arrived (solo): released below
    handover.end(task_id, release=False)  # or carried for a pool process (prefork): so too
    key = _lock_key(task, task_id, request)
    claims.forget(task_id)
    if key and task_id:
        get_deduplicator(task.app).release(task.name, key, task_id, reason="revoked")


def _on_postrun(sender: Any = None, task_id: str | None = None, state: str | None = None,
                **_: Any) -> None:
    task = _dedup_task(sender)
    if task is None:
        return
    request = task.request
    token = request.__dict__.pop(RUNNING_ATTR, None) if request is not None else None
    if token is not None:  # set by DedupTask.before_start: back to the enclosing identity
        running.leave(token)
    if state not in ("IGNORED", "REJECTED") or task_id is None:
        return
    key = _own_key(task, request, task_id)
    if key:
        get_deduplicator(task.app).release(task.name, key, task_id, reason=state.lower())


def _lock_key(
    task: DedupTask, task_id: str, request: Any = None, args: Any = None, kwargs: Any = None,
) -> str | None:
    """The lock key of ``task_id`` for a release, in the pool process or the worker's main
    process: the lock it claimed here; else what its request says (the ``request`` a signal
    gave — a Request, a Context or a dict — or the task's current one when it is that id's):
    skipped, or the message's header; else the header of the message the main process
    received; and only as a last resort a recomputation from the arguments (a message sent
    by name, or by a client without taskdedup). None: nothing of this id's to release.
    A wrong key releases nothing: every release is compare-and-delete by ``task_id``."""
    if request is None:
        current = task.request
        request = current if current is not None and current.id == task_id else None
    if request is not None and not isinstance(request, dict) and getattr(
        request, STATE_ATTR, None
    ) == SKIPPED:
        return None
    claimed = claims.lookup(task_id, task.name)
    if claimed is not None:
        return claimed
    if request is not None:
        if isinstance(request, dict):
            raw = request.get(HEADER)
        else:
            state = getattr(request, STATE_ATTR, None)
            if state is not None:
                return None if state == SKIPPED else str(state)
            raw = _compat.request_dict(request).get(HEADER) or request_header(request)
            if args is None:
                args, kwargs = getattr(request, "args", None), getattr(request, "kwargs", None)
        known, key = claims.header_key(raw, task.name)
        if known:
            return key
    known, key = claims.header_key(claims.received_header(task_id), task.name)
    if known:
        return key
    return _recompute(task, args, kwargs)


def _recompute(task: DedupTask, args: Any, kwargs: Any) -> str | None:
    policy = task._dedup_policy
    if policy is None or args is None:
        return None
    try:
        return get_deduplicator(task.app).identity(
            task.name, policy, args, kwargs, func=task._func()
        ).key
    except Exception:
        return None


signals.task_success.connect(_on_success, weak=False)
signals.task_failure.connect(_on_failure, weak=False)
signals.task_retry.connect(_on_retry, weak=False)
signals.task_revoked.connect(_on_revoked, weak=False)
signals.task_internal_error.connect(_on_internal_error, weak=False)
signals.task_received.connect(lambda request=None, **_: claims.receive(request), weak=False)
signals.task_postrun.connect(_on_postrun, weak=False)



def _on_worker_init(sender: Any = None, **_: Any) -> None:
    """A worker starts, before it connects: with ``taskdedup_reliable_fetch``, it consumes
    through taskdedup's transport (:func:`~taskdedup.celery.config.use_reliable_fetch`)."""
    holders.open_table()  # before the pool forks: its processes say what they hold
    app = getattr(sender, "app", None)
    if app is None or app.conf.get("taskdedup_prefork_handover", False):
        handover.open_table()  # and take the claims the main process carried for them
    if app is not None:
        use_reliable_fetch(app, getattr(sender, "hostname", None))


def _on_worker_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """The publish path and the fetch are chosen before Celery sets up a worker's logging:
    say them again where the operator reads the worker's output."""
    if instance is not None:
        say_publish_path(instance.app)
        say_fetch_path(instance.app)


signals.worker_init.connect(_on_worker_init, weak=False)
signals.celeryd_after_setup.connect(_on_worker_setup, weak=False)


def _on_process_init(**_: Any) -> None:
    """A prefork pool process starts: it runs task after task, so the connection its
    claims and completions go out on stays its own between tasks."""
    trail.keep_connections()


signals.worker_process_init.connect(_on_process_init, weak=False)


# Pool processes exit without atexit handlers: flush the last counts explicitly.
def _on_process_shutdown(**_: Any) -> None:
    """A pool process ends: read the completion replies it owes (their reports count in
    the stats), then flush the stats."""
    trail.settle_all()
    stats.flush_before_exit()


signals.worker_process_shutdown.connect(_on_process_shutdown, weak=False)
