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

__all__ = ["Trails", "settle_all"]

logger = logging.getLogger("taskdedup")

Command = tuple[Any, ...]
OnReply = Callable[[Any], None]
"""Called with the reply, or with the exception :data:`Trails.redo` raised."""

_ALL: weakref.WeakSet[Trails] = weakref.WeakSet()


class _Trail:
    """One thread's connection with replies not read yet."""

    __slots__ = ("__weakref__", "conn", "lock", "pid", "replies", "since")

    def __init__(self) -> None:
        self.conn: Any = None
        self.lock = threading.Lock()
        self.pid = pid()
        self.replies: list[tuple[Command, OnReply]] = []
        self.since = 0.0


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
            conn = trail.conn
            try:
                if conn is None:
                    conn = trail.conn = self._take()
                # redis-py's health check PINGs and reads: never with replies owed
                conn.send_packed_command(self._pack(conn, [command]),
                                         check_health=not trail.replies)
            except (RedisError, OSError):
                if conn is not None:
                    conn.disconnect()
                self._settle(trail)  # what it owed is made again; the connection goes back
                return None
            if not trail.replies:
                trail.since = time.monotonic()
                with self._open_lock:
                    self._open.add(trail)
            trail.replies.append((command, on_reply))
        return trail

    def settle_mine(self) -> None:
        """Read the replies this thread owes (they have usually arrived: no waiting)."""
        trail = getattr(self._local, "trail", None)
        if trail is not None and trail.replies:
            with trail.lock:
                self._settle(trail)

    def settle_trail(self, trail: _Trail) -> None:
        """Read the replies ``trail`` (from :meth:`send`) owes, whichever thread asks."""
        with trail.lock:  # always: a settle in progress elsewhere ends before this returns
            if trail.replies:
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
        the pool (a work-horse's next commands use it: no connection of its own per job).
        Caller holds ``trail.lock``."""
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
            self._give_back(conn)
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
