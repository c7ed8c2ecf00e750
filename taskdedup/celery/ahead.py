"""The claim of a :class:`~taskdedup.celery.DedupTask` sent ahead of its body, so that its
round trip waits together with one the worker makes anyway (SPEC §10, the worker path).

A solo worker (one process, the body run inline: the common container setup) makes, per
task, kombu's fetch, kombu's unacked record (a round trip, before Celery sees the message),
the body's own commands, and the ack (deferred by Celery to after the body). The claim was
one more round trip of waiting, right before the body. Two places send it earlier, on a
connection of its own, and ``before_start`` then reads a reply that is there already:

- :class:`ClaimAhead`, a consumer bootstep: on a solo pool consuming from Redis with kombu's
  transport, kombu's record of the message as unacked (a ``MULTI … EXEC`` of its own)
  carries the claim in its transaction where the locks are in the broker's database: no
  round trip of its own. Elsewhere the claim goes out just before that record, so the two
  round trips wait together. It relies on kombu's ``QoS.append`` and ``pipe_or_acquire``
  seams (:mod:`._compat`), checked when the consumer starts; without them, the next place
  does.
- :class:`DedupRequest` (``DedupTask.Request``): on any pool that runs the body in the
  process that took the message (solo, threads, eventlet, gevent), the claim goes out when
  the pool accepts the task, overlapping Celery's own work before ``before_start``.

Under prefork the body runs in a pool process, later, and by default that process claims
in ``before_start``: the main process fetches, records, acks and dispatches every message,
and is the worker's bottleneck, so the claim's work stays with the pool processes, which
wait for it in parallel. With ``taskdedup_prefork_handover = True``, where kombu's record can
carry the claim (as on a solo pool), the main process's record carries it, and the request
hands it to the pool process (:mod:`.handover`): a round trip less per pool process, paid
for with the main process's time (measured: 0.83 of plain throughput with it, 0.93
without, prefork -c 2 on two cores; docs/explanation/performance.md).
Only a call that runs at once and whose message carries its lock key goes ahead (no ETA or
countdown, no rate limit, not bypassed or marked, no debounce/coalesce generation, no
approximate window, not ``until_executing``); anything else is claimed by ``before_start`` as
before. The claim still runs on the server before the body starts. On a solo pool it is
never made for a message that will wait (a lease taken ahead is taken moments before the
body); under prefork a message may wait in the prefetch buffer with its claim taken, its
lease renewed by the main process until a pool process takes it. A claim sent ahead
whose body never reaches ``before_start`` (revoked or expired on arrival, a message that does
not decode, an ack that fails) is read and, when it took the lock, released: when Celery says
so, else when the same thread takes its next message.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from celery import bootsteps
from celery.worker.request import Request
from vine.abstract import Thenable

from ..events import logger
from ..exceptions import StoreUnavailableError
from ..pids import pid as this_pid
from ..policy import OnDuplicate, is_disabled
from ..stores import trail
from ..stores.base import Outcome
from . import _compat, handover
from ._message import HEADER, carried_check, carried_key, is_off, marked
from .config import get_deduplicator

__all__ = ["ClaimAhead", "DedupRequest", "abandon", "discard", "send_ahead", "take"]

# task id -> (name, sent claim, Deduplicator, sending thread), on its way to its body
_ahead: dict[str, Any] = {}
_lock = threading.Lock()
_handing: list[bool] = [False]  # a prefork worker's main process hands its claims over


class DedupRequest(Request):  # type: ignore[misc]
    """Celery's ``Request``, with the claim sent when the pool accepts the task, if the body
    runs in this process and it was not sent already; on a prefork worker, with the claim
    that kombu's record carried handed to the pool process (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Celery's ``__init__``; then, in a prefork worker's main process, the claim carried
        by the message's record is handed over with the request's fields. Only this process
        sets that field: one the message brought is dropped."""
        super().__init__(*args, **kwargs)
        fields = getattr(self, "_request_dict", None)
        if isinstance(fields, dict):
            fields.pop(handover.FIELD, None)
            if _handing[0] and _ahead:
                _hand_over(self, fields)

    def on_accepted(self, pid: int, time_accepted: float) -> None:
        """Send the claim ahead when the body runs in this process, then Celery's own
        ``on_accepted``; an error there gives the claim back."""
        sent = pid == this_pid() and send_ahead(
            self.task, self.id, getattr(self, "request_dict", None) or {})
        try:
            super().on_accepted(pid, time_accepted)
        except BaseException:
            if sent:
                abandon(self.id)
            raise

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> None:
        """Celery's ``on_failure``; a claim sent ahead that the body never read (the
        message did not decode), or handed over and not taken, is given back first."""
        abandon(self.id)
        handover.end(self.id)
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


def _hand_over(request: Any, fields: dict[str, Any]) -> None:
    """Read the claim carried for ``request`` (prefork, main process) and, when it took the
    lock, hand it to the pool process; one that cannot be handed over is released, and the
    pool process claims as usual. Never raises."""
    taken = take(request.id)
    if taken is None:
        return
    name, sent, dedup, _ = taken
    try:
        result = sent.read()
    except StoreUnavailableError:  # nothing taken that we know of: the pool process claims
        return
    except Exception:
        logger.debug("taskdedup: the claim carried for %s could not be read", request.id,
                     exc_info=True)
        return
    if result.outcome is not Outcome.ACQUIRED:
        return  # the pool process's own claim gets the same answer
    try:
        policy = request.task._dedup_policy
        if handover.hand(request, fields, name, sent.key, dedup, policy):
            return
    except Exception:
        logger.debug("taskdedup: the claim carried for %s could not be handed over",
                     request.id, exc_info=True)
        fields.pop(handover.FIELD, None)
        handover.end(request.id, release=False)
    dedup.release(name, sent.key, request.id, reason="stopped")


class ClaimAhead(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: with kombu's Redis transport, on a solo pool, send each gated
    call's claim as kombu records its message unacked; on a prefork pool, where the locks
    are in the broker's database, carry it in that record and hand it to the pool process
    (:mod:`.handover`). See the module. Runs at every consumer (re)start, as the channel is
    made anew; a stop closes the offers no pool process took."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    _held: _compat.Held | None = None

    def start(self, c: Any) -> None:
        _handing[0] = False
        self._stop_holding()
        hub = getattr(c, "hub", None)
        kind = type(c.pool).__module__
        prefork = kind == "celery.concurrency.prefork"
        if (kind != "celery.concurrency.solo" and not prefork) or hub is None:
            return
        app, tasks = c.app, c.app.tasks
        if prefork and not app.conf.get("taskdedup_prefork_handover", False):
            # the main process is a prefork worker's bottleneck (it fetches, records, acks
            # and dispatches every message): each pool process claims its own calls
            logger.debug("taskdedup: each pool process claims its own calls "
                         "(taskdedup_prefork_handover is off)")
            return
        channel = getattr(getattr(c, "task_consumer", None), "channel", None)
        not_carried = _carry_missing(app, channel)
        if prefork and (not_carried or not handover.ready()):
            logger.debug("taskdedup: each pool process claims its own calls (%s)",
                         not_carried or "no table to hand claims over: the pool did not "
                         "fork after worker_init")
            return

        sweep = _Sweep()

        def before_append(message: Any, carry: bool) -> Any | None:
            headers = getattr(message, "headers", None)
            if not isinstance(headers, Mapping) or headers.get("eta"):
                return None
            if prefork and not (carry and handover.room()):  # never a round trip of its own
                return None
            task = tasks.get(headers.get("task"))
            if task is None or task.app is not app or (
                    getattr(task, "rate_limit", None) and not c.disable_rate_limits):
                return None
            task_id = headers.get("id")
            sent = send_ahead(task, task_id, headers, carry=carry, carried_only=prefork)
            if sent is None:
                return None
            # Celery handles the message (the solo pool: its body too; prefork: its request,
            # which takes the claim to hand it over) before the loop's next turn; a claim
            # still unread then had no body (revoked or expired on arrival, a message that
            # does not decode): give it back
            sweep.ids.append(task_id)
            hub.call_soon(sweep)
            return sent if getattr(sent, "command", None) is not None else None

        held = None if prefork or not_carried else _hold_completions(app, hub)
        missing = _compat.wrap_qos_append(channel, before_append, carry=not_carried is None,
                                          held=held)
        if missing and held is not None:
            held.stop()
        self._held = None if missing else held
        _handing[0] = prefork and not missing
        if missing:
            logger.debug("taskdedup: the claim goes out when the pool accepts the task "
                         "(%s)", missing)
        elif not_carried:
            logger.debug("taskdedup: the claim goes out on a connection of its own as kombu "
                         "records the message (%s)", not_carried)

    def stop(self, c: Any) -> None:
        """The consumer stops (a restart, the worker's shutdown): claims handed over that no
        pool process took go back to ``queued`` by their ids, as their messages go back to
        the broker."""
        self._stop_holding()
        handover.end_all()

    def shutdown(self, c: Any) -> None:
        self._stop_holding()
        handover.end_all()

    def _stop_holding(self) -> None:
        """Completions held for the next record go out now; none are held from here on."""
        held, self._held = self._held, None
        if held is not None:
            try:
                held.stop()
            except Exception:  # the heartbeat thread or the exit sends them instead
                logger.debug("taskdedup: could not send the held completions", exc_info=True)


class _Sweep:
    """The event loop's callback, on its next turn, that gives back the claims sent ahead
    (:class:`ClaimAhead`) that no body or request took (:func:`abandon`). One object per
    consumer, scheduled again for each message: kombu's hub keeps its callbacks in a set, so
    it runs once a turn, and kombu wraps no promise around it (a ``Thenable``) — a promise per
    message cost more Python than anything else the claim sent ahead does."""

    __slots__ = ("ids",)

    def __init__(self) -> None:
        self.ids: list[str | None] = []

    def __call__(self) -> None:
        ids, self.ids = self.ids, []
        for task_id in ids:
            abandon(task_id)


Thenable.register(_Sweep)


def _hold_completions(app: Any, hub: Any) -> _compat.Held | None:
    """Have this thread (a solo pool's: the consumer's, which runs the bodies) hold the
    completions of calls no copy can follow, for kombu's record of the next message to
    carry (``RedisStore.hold_here``); one not carried within ``HOLD_FOR`` goes out on its
    own, from a timer of the worker's own event loop. None: the store cannot hold."""
    store: Any = get_deduplicator(app).store
    hold_here = getattr(store, "hold_here", None)
    if hold_here is None:
        return None
    pending = [False]  # a flush timer is due on the hub

    def flush() -> None:
        pending[0] = False
        try:
            left = store.flush_held()
        except Exception:  # the heartbeat thread sends it within SETTLE_AFTER instead
            logger.debug("taskdedup: could not send the held completions", exc_info=True)
            return
        if left is not None:
            wake(left)

    def wake(delay: float | None = None) -> None:
        if not pending[0]:
            pending[0] = True
            hub.call_later(trail.HOLD_FOR if delay is None else delay, flush)

    if not hold_here(wake):
        return None
    return _compat.Held(store.carry_held, store.held_replies, lambda: hold_here(None))


def _carry_missing(app: Any, channel: Any) -> str | None:
    """Why the claim cannot ride in kombu's unacked record on ``channel`` (the transaction
    kombu sends for each message anyway), or None: it can."""
    missing = _compat.carry_missing(channel)
    if missing:
        return missing
    try:
        store = get_deduplicator(app).store
    except Exception as exc:  # said again, with what to do, at the first gated task
        return f"the locks' store could not be built ({type(exc).__name__})"
    if not hasattr(store, "carry_claim"):
        return "the locks' store cannot hand its claim to another client"
    return _compat.same_database_missing(channel, getattr(store, "client", None))


def send_ahead(task: Any, task_id: Any, fields: Mapping[str, Any], *, carry: bool = False,
               carried_only: bool = False) -> Any | None:
    """Send the claim of ``task``'s call ``task_id`` now, if it can go ahead (``fields``:
    the message headers, or the request's fields, holding the ``taskdedup`` header): the
    claim sent, or None. ``carry``: the caller's transaction carries it where the store can
    (the claim's ``command`` is then set, for the caller to add, else it went out);
    ``carried_only``: a claim that cannot be carried is not sent at all."""
    if isinstance(task_id, str) and task_id in _ahead:
        return None  # sent already (the solo pool accepts what kombu's record claimed)
    try:
        policy = getattr(task, "_dedup_policy", None)
        if policy is None or not isinstance(task_id, str) or not task_id or is_disabled():
            return None
        name = task.name
        raw = fields.get(HEADER)
        carried = carried_key(raw, name)
        if (carried is None or is_off(raw, name) or marked(raw, name) is not None
                or policy.debounce is not None or policy.on_duplicate is OnDuplicate.COALESCE):
            return None
        dedup = get_deduplicator(task.app)
        key = dedup.trusted_key(name, policy, carried)
        if key is None:
            return None
        thread = threading.get_ident()
        with _lock:
            if task_id in _ahead:  # sent already, or another copy of this id on its way
                return None
            # a claim this thread sent for a body that never came (Celery ended the message
            # before its tracer): this thread takes one message at a time, so it is over
            left = [tid for tid, entry in _ahead.items() if entry and entry[3] == thread]
            _ahead[task_id] = None
        for tid in left:
            abandon(tid)
        check = carried_check(raw, name)
        sent = dedup.carry_start(policy, key, task_id, check=check) if carry else None
        if sent is None and not carried_only:
            sent = dedup.send_start(policy, key, task_id, check=check)
    except Exception:  # anything odd: before_start claims as before, and says what is wrong
        logger.debug("taskdedup: the claim of %s was not sent ahead", task_id, exc_info=True)
        with _lock:
            if isinstance(task_id, str) and task_id in _ahead and _ahead[task_id] is None:
                del _ahead[task_id]
        return None
    with _lock:
        if sent is None:
            del _ahead[task_id]
            return None
        _ahead[task_id] = (name, sent, dedup, thread)
    return sent


def take(task_id: str) -> tuple[str, Any, Any, int] | None:
    """``(name, sent claim, deduplicator, thread)`` sent ahead for ``task_id``, taken out
    (None when there is none)."""
    if not _ahead:
        return None
    with _lock:
        entry = _ahead.get(task_id)
        if entry:  # not a claim another thread is sending right now
            del _ahead[task_id]
    return entry or None


def abandon(task_id: str | None, taken: tuple[str, Any, Any, int] | None = None) -> None:
    """Read a claim sent ahead that will not guard a body (the one kept for ``task_id``, or
    ``taken``, from :func:`take`), and release the lock when it took it: it never holds a
    lock for a body that does not run. Never raises."""
    if taken is None:
        taken = take(task_id) if task_id else None
        if taken is None:
            return
    name, sent, dedup, _ = taken
    try:
        result = sent.read()
    except StoreUnavailableError:  # nothing taken that we know of: it lapses with its lease
        return
    except Exception:
        logger.debug("taskdedup: the claim sent ahead for %s could not be read", task_id,
                     exc_info=True)
        return
    if result.outcome is Outcome.ACQUIRED and task_id:
        dedup.release(name, sent.key, task_id, reason="stopped")


def discard(task_id: str | None) -> None:
    """Read and drop the reply of a claim sent ahead for ``task_id``, whose lock the caller
    releases itself (a revoked call)."""
    taken = take(task_id) if task_id else None
    if taken is not None:
        taken[1].discard()
