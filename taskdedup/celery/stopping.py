"""A stopping worker takes out the held messages whose gated body already ran.

Celery's prefork pool, closing (``AsynPool.flush``: a warm shutdown, a consumer restart),
drops from its record a job it wrote to a pool process before it read that the process had
started it, expecting the broker to hand the message out again. The process runs the body
anyway, and nobody acks the message: the worker puts it back when it has finished stopping,
30 s later or more (billiard waits for the result nobody reads; the stop also waits for every
task still running). By then the lock's ``F`` tombstone, which tells this very message's copies
from a new call, may have lapsed (it lives one lease): the body would run a second time.

So from the worker's SIGTERM (or its consumer's stop) until its channel closes, the worker
looks every :data:`~taskdedup.celery.fetch.SWEEP_EVERY` seconds at the messages it still
holds: one whose lock is ``F`` or ``D`` by the message's own task id has run, and is acked.
On the reliable fetch (SPEC §17) it leaves the processing list
(:meth:`~taskdedup.celery.fetch.Fetcher.sweep`, once more as the channel closes); on kombu's
Redis fetch, kombu's unacked record (``QoS.ack``). That is what its claim does with such a
message on redelivery, done while the tombstone still says so. Other transports (RabbitMQ)
put a held message back when the worker's connection closes, and their channels are not safe
to ack on from another thread: there the looks only note the requests Celery still holds
(``celery.worker.state.requests``) whose body ran, and the step's ``shutdown`` acks them on the
main thread, after the pool stopped and before the connection closes (:class:`_Noted`). Only
messages that are due (not a countdown still held) are read, one lock read each: the key the
message carries (every call made through taskdedup), else (sent by name) the identity of its
arguments, as its claim computes it.
"""

from __future__ import annotations

import base64
import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from celery import bootsteps, signals
from celery.worker import state as worker_state
from kombu import serialization as kombu_serialization
from kombu.utils.json import loads as kombu_loads

from ..core import Deduplicator
from ..events import logger
from ..stores.base import LockState
from . import _compat, fetch
from ._message import HEADER, carried_key, is_off
from .config import get_deduplicator

__all__ = ["SweepWhileStopping", "finished_among"]

_RAN = (LockState.FINISHED, LockState.DONE)


def finished_among(app: Any, raws: Sequence[bytes]) -> list[bytes]:
    """The messages among ``raws`` (as kombu's Redis transport stores them) whose gated body
    already finished: their lock is ``F`` or ``D`` by their own task id."""
    dedup = get_deduplicator(app)
    now = datetime.now(UTC)
    done = []
    for raw in raws:
        try:
            payload = kombu_loads(raw)  # type: ignore[no-untyped-call]
            headers = payload["headers"]
        except Exception:
            continue
        if _ran(app, dedup, headers, now, functools.partial(_stored_arguments, app, payload)):
            done.append(raw)
    return done


Arguments = Callable[[], "tuple[Sequence[Any], Mapping[str, Any]] | None"]
"""The call's arguments, decoded when a look needs them (a message without its lock key)."""


def _ran(app: Any, dedup: Deduplicator, headers: Any, now: datetime,
         arguments: Arguments | None = None) -> bool:
    """Whether the message with these headers is a due one of an execution-gated task of
    ``app`` and its lock says its body finished. The lock is the key the message carries
    when this task could have made it; else (sent by name, or a forged key) the identity of
    its ``arguments``, as the claim computes it."""
    if not isinstance(headers, Mapping):
        return False
    name, task_id = headers.get("task"), headers.get("id")
    if not isinstance(name, str) or not isinstance(task_id, str) or _later(headers.get("eta"),
                                                                           now):
        return False
    task = app.tasks.get(name)
    policy = getattr(task, "_dedup_policy", None)
    if policy is None or not policy.mode.gates_execution:
        return False
    raw = headers.get(HEADER)
    if is_off(raw, name):
        return False
    carried = carried_key(raw, name)
    key = None if carried is None else dedup.trusted_key(name, policy, carried)
    if key is None:
        called = arguments() if arguments is not None else None
        if called is None:
            return False
        try:
            key = dedup.identity(name, policy, called[0], called[1], func=task._func()).key
        except Exception:  # arguments the claim refuses too: no lock to read
            return False
    info = dedup.store.get(key)
    return info is not None and info.owner == task_id and info.state in _RAN


def _stored_arguments(app: Any, payload: Any) -> tuple[Sequence[Any], Mapping[str, Any]] | None:
    """The arguments of a message as kombu's Redis transport stores it (Celery's message
    protocol 2), decoded with the app's accepted content types; None if they cannot be."""
    try:
        body = payload["body"]
        if payload.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        accept = kombu_serialization.prepare_accept_content(  # type: ignore[no-untyped-call]
            app.conf.accept_content)
        decoded = kombu_serialization.loads(  # type: ignore[no-untyped-call]
            body, payload.get("content-type"), payload.get("content-encoding"), accept=accept)
        return _protocol_2(decoded)
    except Exception:
        return None


def _protocol_2(decoded: Any) -> tuple[Sequence[Any], Mapping[str, Any]] | None:
    """``(args, kwargs)`` of a protocol 2 body (``[args, kwargs, embed]``), else None."""
    if isinstance(decoded, (list, tuple)) and len(decoded) == 3 and isinstance(
            decoded[0], (list, tuple)) and isinstance(decoded[1], Mapping):
        return decoded[0], decoded[1]
    return None


def _message_arguments(message: Any) -> tuple[Sequence[Any], Mapping[str, Any]] | None:
    """The arguments of a kombu ``Message`` (its body decoded as kombu decodes it)."""
    try:
        return _protocol_2(message.decode())
    except Exception:
        return None


def _later(eta: Any, now: datetime) -> bool:
    """Whether a message's ``eta`` header is still ahead (a countdown the worker holds: its
    body has not run)."""
    if not isinstance(eta, str):
        return False
    try:
        when = datetime.fromisoformat(eta)
    except ValueError:
        return False
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when > now


_shutting_down = [False]
"""Set by ``worker_shutting_down``, which Celery sends from its signal handler: nothing else is
done there (a lock taken in a signal handler can deadlock the main thread that holds it)."""


def _on_shutting_down(**_: Any) -> None:
    _shutting_down[0] = True


signals.worker_shutting_down.connect(_on_shutting_down, weak=False)


def _gone(channel: Any) -> bool:
    """Whether ``channel`` closed: kombu's virtual channels say ``closed``, py-amqp's
    ``is_open``; both drop their connection."""
    closed = getattr(channel, "closed", None)
    if closed is None:
        closed = not getattr(channel, "is_open", True)
    return bool(closed) or getattr(channel, "connection", None) is None


def _watch(app: Any, channel: Any, stopped: threading.Event,
           look: Callable[[], Any] | None = None, done: threading.Event | None = None) -> None:
    """Wait (a look every :data:`~taskdedup.celery.fetch.SWEEP_EVERY` s) until the worker
    stops: its SIGTERM (Celery 5.3 stops the consumer only after the tasks it runs end) or the
    consumer's stop (also a restart); then take out what ran (``look``, else the channel's
    own: :func:`_look`), each look, until the channel closes or ``done`` is set."""
    while not (stopped.wait(fetch.SWEEP_EVERY) or _shutting_down[0]):
        if _gone(channel) or (done is not None and done.is_set()):
            return
    look = look or _look(app, channel)
    if look is None:
        return
    warned = False
    while not (_gone(channel) or (done is not None and done.is_set())):
        try:
            look()
        except Exception as exc:  # the broker or the lock store is away: the claim decides
            if not warned:
                logger.warning("taskdedup: a stopping worker could not look for held messages "
                               "whose body already ran (%s)", exc)
            warned = True
        time.sleep(fetch.SWEEP_EVERY)


def _look(app: Any, channel: Any) -> Callable[[], Any] | None:
    """One look at what ``channel`` holds: the reliable fetch's :meth:`~.fetch.Fetcher.sweep`
    (which then also looks as the channel closes), else one over kombu's record (None: kombu
    keeps none this module can read)."""
    fetcher = fetch.fetcher_of(channel)
    if fetcher is not None:
        fetcher.finished = functools.partial(finished_among, app)
        return fetcher.sweep
    held = _compat.held_unacked(channel)
    return None if held is None else functools.partial(_ack_what_ran, app, channel, held)


def _ack_what_ran(app: Any, channel: Any, held: Callable[[], list[tuple[str, Any]]]) -> None:
    """kombu's fetch: ack the held messages whose gated body already ran
    (:func:`~taskdedup.celery._compat.ack_held`: out of kombu's unacked hash, so neither its
    restore at close nor another worker's restore by time puts them back)."""
    dedup = get_deduplicator(app)
    now = datetime.now(UTC)
    for tag, message in held():
        if _ran(app, dedup, getattr(message, "headers", None), now,
                functools.partial(_message_arguments, message)):
            _compat.ack_held(channel, tag)
            _acked(message.headers.get("task"), message.headers.get("id"))


class _Noted:
    """Other transports (RabbitMQ): the requests Celery still holds whose message is unacked
    and whose gated body ran, noted by the looks from another thread (reading Celery's
    ``state.requests``, acking nothing), then acked by :meth:`ack` on the consumer's own
    thread, after the pool stopped and before the connection closes (which would put them
    back). The looks keep what they saw while the tombstone said so: a stop that waits for a
    long task can outlive it."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.ran: dict[int, Any] = {}  # id(message) -> (task, id, message)
        self.done = threading.Event()
        self._looking = threading.Lock()  # a look of the watcher's ends before the last one

    def look(self) -> None:
        """Note the held requests whose body ran (any thread)."""
        with self._looking:
            self._look()

    def _look(self) -> None:
        held = list(worker_state.requests.values())
        if not held:
            return
        dedup = get_deduplicator(self.app)
        now = datetime.now(UTC)
        for request in held:
            message = getattr(request, "message", None)
            if message is None or id(message) in self.ran or getattr(
                    message, "acknowledged", True):
                continue
            headers: Any = getattr(message, "headers", None)
            if _ran(self.app, dedup, headers, now, functools.partial(_request_arguments,
                                                                     request)):
                self.ran[id(message)] = (headers.get("task"), headers.get("id"), message)

    def ack(self) -> None:
        """On the consumer's thread: a last look, then ack what ran. Never raises."""
        self.done.set()
        with self._looking:
            try:
                self._look()
            except Exception as exc:  # the lock store is away: what the looks saw counts
                logger.warning("taskdedup: a stopping worker could not look for held "
                               "messages whose body already ran (%s)", exc)
            noted = list(self.ran.values())
        for name, task_id, message in noted:
            if message.acknowledged:
                continue
            try:
                message.ack()
            except Exception as exc:  # the connection is gone: the claim decides
                logger.warning("taskdedup: could not ack %s[%s], whose gated body already "
                               "ran, as the worker stops (%s)", name, task_id, exc)
                continue
            _acked(name, task_id)


def _request_arguments(request: Any) -> tuple[Sequence[Any], Mapping[str, Any]] | None:
    """The arguments of a request Celery holds (decoded when it was received)."""
    args, kwargs = getattr(request, "args", None), getattr(request, "kwargs", None)
    if isinstance(args, (list, tuple)) and isinstance(kwargs, Mapping):
        return args, kwargs
    return None


def _acked(name: Any, task_id: Any) -> None:
    logger.info("taskdedup: %s[%s]'s gated body already ran, its message not acked yet as the "
                "worker stops: acked (Celery's closing pool can leave one unacked; put back, "
                "it would run again once its lock's tombstone lapsed)", name, task_id)


class SweepWhileStopping(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: a thread per consumer start that, once the worker stops, takes out
    the held messages whose gated body already ran (see the module): the reliable fetch's
    processing lists, kombu's Redis fetch's record of what it holds unacked, or (other
    transports) the requests Celery holds, acked at the consumer's ``shutdown``."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    _stopped: threading.Event | None = None
    _noted: _Noted | None = None

    def start(self, c: Any) -> None:
        channel = getattr(getattr(c, "task_consumer", None), "channel", None)
        if channel is None:
            return
        _shutting_down[0] = False  # a worker started again in this process
        self._stopped = threading.Event()
        look, done = None, None
        if not isinstance(channel, _compat.Channel):  # not safe to ack on from another thread
            self._noted = noted = _Noted(c.app)
            look, done = noted.look, noted.done
        threading.Thread(target=_watch, args=(c.app, channel, self._stopped, look, done),
                         daemon=True, name="taskdedup-stop-sweep").start()

    def stop(self, c: Any) -> None:
        if self._stopped is not None:
            self._stopped.set()

    def shutdown(self, c: Any) -> None:
        """The worker's last step before the consumer's channel and connection close (its
        pool stopped): ack what the looks noted (other transports than Redis)."""
        noted, self._noted = self._noted, None
        if noted is not None:
            noted.ack()
