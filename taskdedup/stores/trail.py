"""Commands sent at once whose replies are read later: a worker's completion off its path.

A worker's completion (``complete.lua``) decides nothing for the task that has just run: its
outcome is already in the result backend, and the next task does not depend on the reply.
Waiting for that reply cost every executed task a round trip. :class:`Trails` sends such a
command **at once** — the server applies it as soon as it reads it, exactly when a waited-for
call would have — and reads the reply later: on the same thread's next store call, from the
heartbeat thread within :data:`SETTLE_AFTER` seconds, or when the process ends. The reply's
callback then reports what happened (completed, or the lock lost).

Nothing is lost when a reply is not read: the command is on the server already. A connection
that breaks before its replies are read has them made again, one by one, with the store's
own call (``redo``): the commands sent this way are idempotent for their owner.

A thread whose next message's transaction can carry its commands (a solo Celery worker
consuming from the locks' own Redis: :mod:`taskdedup.celery.ahead`) may instead **hold** a
completion (:meth:`Trails.hold`) for at most :data:`HOLD_FOR`: the transaction kombu sends
as the next message arrives takes it (:meth:`Trails.take_held`), else it goes out on its own
(:meth:`Trails.flush_mine`, the heartbeat thread, or at exit). A send of its own per task cost
the worker more than the rest of the completion; only calls that no copy can follow are held.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from redis.exceptions import NoScriptError, RedisError, ResponseError

from ..pids import ForkSafeLock, pid
from .base import SETTLE_AFTER

__all__ = ["HOLD_FOR", "Trails", "keep_connections", "settle_all"]

logger = logging.getLogger("taskdedup")

Command = tuple[Any, ...]
OnReply = Callable[[Any], None]
"""Called with the reply, or with the exception :data:`Trails.redo` raised."""

_ALL: weakref.WeakSet[Trails] = weakref.WeakSet()

_KEEP_IN = [0]
"""The process whose trails keep their connection between settles (:func:`keep_connections`),
0 for none: a fork does not inherit it."""


def keep_connections() -> None:
    """Let this process's trails keep their connection once their replies are read, instead
    of giving it back to the pool: a long-lived worker process (a prefork pool process) then
    takes no connection from the pool, and checks none for unread data, per task. Not for a
    process forked per job (an RQ work-horse), whose next commands should reuse the pool's
    connection rather than open one more."""
    _KEEP_IN[0] = pid()


HOLD_FOR = 0.002
"""Seconds a held completion waits for a transaction to carry it before it goes out on its
own (:meth:`Trails.flush_mine`): about two round trips of a busy worker's next fetch."""


class _Trail:
    """One thread's connection with replies not read yet."""

    __slots__ = ("__weakref__", "conn", "held", "held_at", "holds", "lock", "pid", "replies",
                 "since")

    def __init__(self) -> None:
        self.conn: Any = None
        self.lock = threading.Lock()
        self.pid = pid()
        self.replies: list[tuple[Command, OnReply]] = []
        self.since = 0.0
        self.held: list[tuple[Command, OnReply]] = []  # not sent yet (Trails.hold)
        self.held_at = 0.0
        self.holds: Callable[[], None] | None = None  # hold_here's wake: this thread holds


class Trails:
    """Per-thread connections of one client pool, each with the replies it owes.

    Args:
        take: a connection from the pool (``stores/_compat.raw_exchange``).
        give_back: return it to the pool.
        pack: the packed bytes of a list of commands for a connection.
        redo: the command made again as an ordinary call (after NOSCRIPT, or on a connection
            that broke before its reply was read); its reply, or it raises.
    """

    def __init__(self, take: Callable[[], Any], give_back: Callable[[Any], None],
                 pack: Callable[[Any, list[Command]], list[bytes]],
                 redo: Callable[[Command], Any]) -> None:
        self._take, self._give_back, self._pack, self._redo = take, give_back, pack, redo
        self._local = threading.local()
        self._open: set[_Trail] = set()  # trails owing replies, for the heartbeat thread
        # a forked child (a work-horse, a new pool process) sends at once: never a lock that
        # the parent's heartbeat thread held at the fork
        self._open_lock = ForkSafeLock()
        self._pid = pid()
        _ALL.add(self)

    def send(self, command: Command, on_reply: OnReply) -> _Trail | None:
        """Send ``command`` now and read its reply later: the trail it went out on (its
        replies are read in order, ``on_reply`` called for this one, by
        :meth:`settle_mine` or :meth:`settle_trail`); None when it could not be sent
        (nothing of it reached the server: the caller makes the ordinary call)."""
        trail = self._mine()
        with trail.lock:
            if not self._send_held(trail, [(command, on_reply)]):
                return None
        return trail

    def _send_held(self, trail: _Trail, commands: list[tuple[Command, OnReply]]) -> bool:
        """Send ``trail``'s held commands, then ``commands``, in one write; their replies
        are owed. False when the write failed: the held ones are made again at once (they
        are owed by then), ``commands`` are not. Caller holds ``trail.lock``."""
        held, trail.held = trail.held, []
        conn = trail.conn
        try:
            if conn is None:
                conn = trail.conn = self._take()
            # redis-py's health check PINGs and reads: never with replies owed
            conn.send_packed_command(self._pack(conn, [c for c, _ in held + commands]),
                                     check_health=not trail.replies)
        except (RedisError, OSError):
            if conn is not None:
                conn.disconnect()
            trail.replies.extend(held)
            self._settle(trail)  # what it owed is made again; the connection goes back
            return False
        if not trail.replies and not held:
            trail.since = time.monotonic()
            with self._open_lock:
                self._open.add(trail)
        trail.replies.extend(held)
        trail.replies.extend(commands)
        return True

    def hold_here(self, wake: Callable[[], None] | None) -> None:
        """Let this thread hold its completions (:meth:`hold`): a transaction it sends
        anyway carries them (:meth:`take_held`). ``wake`` is called when a first one is
        held, to have :meth:`flush_mine` called on this thread within :data:`HOLD_FOR`;
        None: this thread sends at once again (what it holds goes out now)."""
        trail = self._mine()
        with trail.lock:
            trail.holds = wake
            if wake is None and trail.held:
                self._send_held(trail, [])

    def hold(self, command: Command, on_reply: OnReply) -> bool:
        """Keep ``command`` for a transaction this thread sends anyway, its reply to
        ``on_reply`` when read; False (nothing kept) when this thread does not hold: call
        :meth:`send`."""
        trail: _Trail | None = getattr(self._local, "trail", None)
        if trail is None or trail.holds is None or trail.pid != pid():
            return False
        with trail.lock:
            first = not trail.held
            trail.held.append((command, on_reply))
            if first:
                trail.held_at = time.monotonic()
                if not trail.replies:
                    trail.since = trail.held_at
                    with self._open_lock:
                        self._open.add(trail)
        if first:
            trail.holds()
        return True

    def take_held(self) -> list[tuple[Command, OnReply]]:
        """This thread's held commands, for its transaction to carry: it passes each reply
        to :meth:`carried` (a command whose reply never came is made again there)."""
        trail: _Trail | None = getattr(self._local, "trail", None)
        if trail is None or not trail.held:
            return []
        with trail.lock:
            held, trail.held = trail.held, []
            if not trail.replies:
                with self._open_lock:
                    self._open.discard(trail)
        return held

    def carried(self, held: list[tuple[Command, OnReply]], replies: list[Any] | None) -> None:
        """Report the replies of ``held`` (from :meth:`take_held`) that a transaction
        carried, as :meth:`settle_mine` reports its own; None (the transaction was refused):
        they go out on their own, now."""
        if replies is None:
            trail = self._mine()
            with trail.lock:
                trail.held[:0] = held
                self._send_held(trail, [])
            return
        for (command, on_reply), reply in zip(held, replies, strict=True):
            if isinstance(reply, NoScriptError) or (
                    isinstance(reply, ResponseError) and str(reply).startswith("NOSCRIPT")):
                try:
                    reply = self._redo(command)
                except Exception as exc:
                    reply = exc
            try:
                on_reply(reply)
            except Exception:
                logger.exception("taskdedup: reporting a completion failed")

    def flush_mine(self) -> float | None:
        """Send what this thread has held for :data:`HOLD_FOR` or more (replies owed, read
        later); how many seconds until the rest is due, or None when nothing is held."""
        trail: _Trail | None = getattr(self._local, "trail", None)
        if trail is None or not trail.held:
            return None
        left = trail.held_at + HOLD_FOR - time.monotonic()
        if left > 0:
            return left
        with trail.lock:
            if trail.held:
                self._send_held(trail, [])
        return None

    def settle_mine(self) -> None:
        """Read the replies this thread owes (they have usually arrived: no waiting)."""
        trail = getattr(self._local, "trail", None)
        if trail is not None and (trail.replies or trail.held):
            with trail.lock:
                self._settle(trail)

    def settle_trail(self, trail: _Trail) -> None:
        """Read the replies ``trail`` (from :meth:`send`) owes, whichever thread asks."""
        with trail.lock:  # always: a settle in progress elsewhere ends before this returns
            if trail.replies or trail.held:
                self._settle(trail)

    def settle_idle(self, older_than: float = SETTLE_AFTER) -> bool:
        """Read the replies owed for longer than ``older_than`` seconds by threads that are
        not using their connection now; whether any trail still owes replies."""
        if self._pid != pid():
            return False
        now = time.monotonic()
        with self._open_lock:
            trails = list(self._open)
        for trail in trails:
            if now - trail.since < older_than or not trail.lock.acquire(blocking=False):
                continue
            try:
                self._settle(trail)
            finally:
                trail.lock.release()
        return bool(self._open)

    def settle(self) -> None:
        """Read every reply owed (the process is ending)."""
        self.settle_idle(older_than=0.0)

    def _mine(self) -> _Trail:
        trail: _Trail | None = getattr(self._local, "trail", None)
        current = pid()
        if trail is None or trail.pid != current:
            if self._pid != current:  # a forked child: the parent's trails are not ours
                self._pid, self._open = current, set()
            trail = self._local.trail = _Trail()
        return trail

    def _settle(self, trail: _Trail) -> None:
        """Read ``trail``'s replies in order and report them; the connection goes back to
        the pool (a work-horse's next commands use it: no connection of its own per job),
        unless this process keeps it (:func:`keep_connections`). Caller holds
        ``trail.lock``."""
        if trail.held and not self._send_held(trail, []):
            return  # settled by the failed send
        replies, trail.replies = trail.replies, []
        with self._open_lock:
            self._open.discard(trail)
        conn, trail.conn = trail.conn, None
        broken = conn is None
        answers: list[Any] = []
        for command, _ in replies:
            if not broken:
                try:
                    answers.append(conn.read_response(disable_decoding=True))
                    continue
                except NoScriptError:
                    pass  # made again below, with EVAL
                except ResponseError as exc:
                    answers.append(exc)
                    continue
                except (RedisError, OSError):
                    conn.disconnect()
                    broken = True
            try:
                answers.append(self._redo(command))
            except Exception as exc:
                answers.append(exc)
        if conn is not None:
            if broken or _KEEP_IN[0] != trail.pid:
                self._give_back(conn)
            else:  # a worker process's next task sends on it again (keep_connections)
                trail.conn = conn
        for (_, on_reply), answer in zip(replies, answers, strict=True):
            try:
                on_reply(answer)
            except Exception:  # a report must not break the caller's next call
                logger.exception("taskdedup: reporting a completion failed")


def settle_all() -> None:
    """Read every reply this process owes, in every store (a worker process ending)."""
    for trails in list(_ALL):
        try:
            trails.settle()
        except Exception:  # never in the way of an exit
            logger.debug("taskdedup: could not read the last replies", exc_info=True)


atexit.register(settle_all)
