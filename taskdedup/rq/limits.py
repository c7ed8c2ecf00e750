"""Per-key limits on RQ (SPEC §16): ``DedupQueue(..., limits=[...])`` with ``DedupWorker``.

The queue knows the limits and the call's arguments, so it writes, in ``job.meta``
(:data:`META_KEY`), each limit's figures and its Redis key (a digest of the key value, never
the value: :func:`taskdedup.limits.limit_key`), with the lease the slots live for. The
worker's work-horse, after the claim (a duplicate takes no slot), takes them
(:func:`enter`): admitted, the body runs holding its slots, given back when it ends
(:func:`leave`); refused, the job is put back through RQ's scheduler as a copy is (same id,
not a retry, no work-horse held while it waits; run the worker ``--with-scheduler``), its
lock turned back to ``queued`` by its own id first; ``on_excess="drop"`` fails it with
:class:`~taskdedup.RateLimitedError`, its lock released.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from rq.job import Job
from rq.queue import Queue

from .. import limits
from ..events import logger
from ..exceptions import StoreUnavailableError, TaskDedupError
from ..limits import LIMITED_SINCE, Concurrency, Limit, Rate, RateLimitedError
from ..stores.redis import refused

if TYPE_CHECKING:
    from rq.executions import Execution

    from ..core import Deduplicator
    from .meta import Guard
    from .worker import DedupWorker

__all__ = ["META_KEY", "enter", "leave", "meta_entry"]

META_KEY: Final = "taskdedup_limits"
"""``job.meta`` entry: ``{"task", "lease", "limits": [[kind, limit, per, on, key], ...]}``,
``kind`` ``"c"`` or ``"r"``, ``per`` seconds (0 for a concurrency limit), ``on`` ``"wait"``
or ``"drop"``, ``key`` the limit's Redis key for this call."""
_SLOTS_ATTR: Final = "_taskdedup_slots"


def meta_entry(dedup: Deduplicator, name: str, declared: Sequence[Limit], lease: float,
               args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``job.meta`` entry of one call under ``declared`` limits (made by the queue)."""
    rows: list[list[Any]] = []
    for index, limit in enumerate(declared):
        key = limits.limit_key(dedup.prefix, name, index, limit, args, kwargs)
        if isinstance(limit, Concurrency):
            rows.append(["c", limit.limit, 0, limit.on_busy.value, key])
        else:
            rows.append(["r", limit.limit, limit.per, limit.on_excess.value, key])
    return {"task": name, "lease": lease, "limits": rows}


def _read(entry: Any, prefix: str) -> tuple[str, float, list[tuple[Limit, str]]]:
    """The task name, lease and limits a job's meta entry names.

    Raises:
        TaskDedupError: the entry is malformed, or a key lies outside this task's limits
            (a job is never run past limits it cannot read).
    """
    try:
        name, lease, rows = entry["task"], float(entry["lease"]), entry["limits"]
        out: list[tuple[Limit, str]] = []
        head = f"{prefix}:limit:{name}:"
        for kind, figure, per, on, key in rows:
            if not isinstance(key, str) or not key.startswith(head) or len(key) > 1024:
                raise ValueError("a key outside the task's limits")
            if kind == "c":
                out.append((Concurrency(figure, on_busy=on), key))
            elif kind == "r":
                out.append((Rate(figure, per, on_excess=on), key))
            else:
                raise ValueError(f"an unknown kind {kind!r}")
        if not isinstance(name, str) or lease <= 0:
            raise ValueError("no task name or lease")
        return name, lease, out
    except Exception as exc:
        raise TaskDedupError(
            f"taskdedup: the job's {META_KEY!r} meta cannot be read ({exc}); it is not run "
            "past limits it cannot check") from exc


def enter(worker: DedupWorker, job: Job, queue: Queue, execution: Execution | None,
          run: tuple[Any, ...], guard: Guard | None) -> bool | None:
    """Take the job's limits before its body: None when it runs (holding its slots), else
    what ``perform_job`` returns for a job put back or dropped."""
    meta = job.meta if isinstance(job.meta, dict) else {}
    entry = meta.get(META_KEY)
    if entry is None:
        return None
    dedup = worker.dedup
    try:
        name, lease, carried = _read(entry, dedup.prefix)
    except TaskDedupError as exc:
        _unclaim(worker, job, guard, 0.0, drop=True)
        return worker._fail(job, queue, run, exc)
    try:
        admission = _admit(dedup, name, carried, job.id, int(lease * 1000))
    except StoreUnavailableError as exc:  # refused for what it is: the job's error
        _unclaim(worker, job, guard, 0.0, drop=True)
        return worker._fail(job, queue, run, limits.refusal(name, job.id, exc))
    if admission is None:  # Redis down: never run past a limit
        _unclaim(worker, job, guard, worker.store_retry_delay)
        worker._put_back(job, queue, execution, worker.store_retry_delay, save=True)
        return False
    since = limits.limited_since(meta.get(LIMITED_SINCE))
    if admission.ok:
        setattr(job, _SLOTS_ATTR, admission.slots)
        if since is not None:
            limits.note_waiting(dedup, name, job.id, None)
        return None
    refused = admission.limit
    assert refused is not None
    if admission.dropped:
        _unclaim(worker, job, guard, 0.0, drop=True)
        return worker._fail(job, queue, run, RateLimitedError(name, repr(refused)))
    now = time.time()
    waited = 0.0 if since is None else max(0.0, now - since)
    delay = limits.limit_delay(refused, admission.wait_ms, waited, lease)
    _unclaim(worker, job, guard, delay)
    if since is None:
        job.meta[LIMITED_SINCE] = now  # saved with the job by _put_back
    limits.note_waiting(dedup, name, job.id, delay)
    how = "rescheduled" if queue.scheduler_pid is not None else "re-queued"
    logger.debug("taskdedup: %s[%s] %s in %.2fs: its limit %r is full", name, job.id, how,
                 delay, refused)
    worker._put_back(job, queue, execution, delay, save=True)
    return True


def _admit(dedup: Deduplicator, name: str, carried: list[tuple[Limit, str]], call_id: str,
           lease_ms: int) -> limits.Admission | None:
    """:func:`taskdedup.limits.admit` over the keys the job carries (None: Redis down)."""
    declared = tuple(limit for limit, _ in carried)
    keys = [key for _, key in carried]
    try:
        return limits.admit(dedup, name, declared, (), {}, call_id, lease_ms, keys=keys)
    except StoreUnavailableError as exc:
        if refused(exc):
            raise
        logger.warning("taskdedup: store unavailable for the limits of %s[%s]: %s", name,
                       call_id, exc)
        return None


def _unclaim(worker: DedupWorker, job: Job, guard: Guard | None, delay: float,
             drop: bool = False) -> None:
    """Hand back the lock this execution claimed before a limit refused it: re-reserved for
    the put-off job (queued by its own id), or released for a job that ends now."""
    if guard is None or worker._dedup_claims.pop(job.id, None) is None:
        return
    if drop:
        worker.dedup.release(guard.name, guard.key, job.id, reason="dropped")
    else:
        worker._rereserve(guard, job, delay, again="limit")


def leave(worker: DedupWorker, job: Job) -> None:
    """Give back the slots of a job whose body has ended."""
    slots = job.__dict__.pop(_SLOTS_ATTR, None)
    if slots:
        limits.release(worker.dedup, slots)

