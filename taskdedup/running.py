"""The identity of the task running in this thread (or greenlet), as its message carried it.

The integrations set it when a worker starts a gated task (Celery's ``before_start``, RQ's
job execution) and clear it when the task ends, so code inside the body — :mod:`taskdedup.sql`
first of all — can use the same identity without recomputing it. The core knows nothing of
Celery or RQ: it only holds the value.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass
from functools import partial

__all__ = ["Running", "current", "enter", "enter_later", "leave"]


@dataclass(frozen=True, slots=True)
class Running:
    """A task being executed: its name, its id and its identity's lock key.

    ``ttl`` is the policy's window in seconds (the Redis window: a durable record of the
    execution, :func:`taskdedup.sql.effects`, lives longer). A durable record shorter than
    ``redelivery`` could expire before the broker redelivers the message: it warns.
    """

    task: str
    task_id: str
    key: str
    ttl: float
    redelivery: float | None = None
    """Seconds the broker may take to hand this task's message out again if its worker dies
    (Celery on Redis/SQS: ``visibility_timeout`` plus the lease); None: not by time."""


_Entered = Running | partial[Running] | None
_CURRENT: ContextVar[_Entered] = ContextVar("taskdedup_running", default=None)


def current() -> Running | None:
    """The task running in this context, or ``None`` outside a gated task."""
    value = _CURRENT.get()
    return value() if type(value) is partial else value  # type: ignore[return-value]


def enter(running: Running | None) -> Token[_Entered]:
    """Mark ``running`` as the task of this context (None: no task, e.g. a direct call
    without an identity, which must not see its caller's); pass the token to :func:`leave`."""
    return _CURRENT.set(running)


def enter_later(make: Callable[..., Running], *args: object) -> Token[_Entered]:
    """:func:`enter` the task ``make(*args)`` returns, made only if :func:`current` asks
    for it: a worker enters one per task, and few bodies ask."""
    return _CURRENT.set(partial(make, *args))


def leave(token: Token[_Entered] | None = None) -> None:
    """End the current task: restore what was before ``token``, or clear it."""
    if token is not None:
        try:
            _CURRENT.reset(token)
            return
        except ValueError:  # made in another context (a signal in another frame): clear
            pass
    _CURRENT.set(None)
