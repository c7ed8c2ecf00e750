"""What every ``effects()`` shares, whatever the database layer: the yielded :class:`Effects`,
the row's default lifetime, the identity taken from the running task, and the warning about a
row shorter than the task's redelivery delay.

Framework-free (no SQLAlchemy, no Django): :mod:`taskdedup.sql.recorder` and
:mod:`taskdedup.django.effects` build their claims on it.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import Any, Final

from . import running
from .exceptions import ConfigurationError
from .policy import duration_seconds

__all__ = ["DEFAULT_TTL", "Effects", "identity", "lifetime", "warn_if_short"]

DEFAULT_TTL: Final = 7 * 24 * 3600.0
"""Seconds a row counts when ``ttl`` is not given: 7 days, in a task or outside one.

The row is the authority after the Redis window has gone: it must outlive every redelivery
of the task's message, whatever the policy's ``ttl`` (kombu's Redis transport hands an unacked
message out again after ``visibility_timeout``, an hour by default, and a broker outage or a
stopped worker can hold a message much longer), and a payment provider's retries of one
webhook (Stripe: up to 3 days). Rows past it are taken over, and removed by ``taskdedup sql
prune``."""

logger = logging.getLogger("taskdedup")

_WARNED: set[str] = set()
"""Tasks already warned about a row shorter than their redelivery delay (once per process)."""


class Effects:
    """What ``effects()`` yields.

    Attributes:
        key: the identity recorded.
        first: True when this run recorded it (do the work); False when an earlier run
            committed it and its row has not expired (do nothing, return :attr:`result`).
        task_id: the id of the run whose row it is (this run's when ``first``; None for a row
            recorded outside a task).
    """

    __slots__ = ("_result", "_result_set", "first", "key", "task_id")

    def __init__(self, key: str, first: bool, task_id: str | None, result: Any) -> None:
        self.key = key
        self.first = first
        self.task_id = task_id
        self._result = result
        self._result_set = False

    @property
    def result(self) -> Any:
        """The earlier run's stored result (``first`` False), or what this run set (JSON).

        Setting it on the first run stores it with the row when the block exits without an
        error, in the same transaction.
        """
        return self._result

    @result.setter
    def result(self, value: Any) -> None:
        if not self.first:
            raise ConfigurationError(
                f"fx.result of {self.key} was stored by {self.task_id!r}, the first run; "
                "a later run reads it and cannot replace it"
            )
        try:
            json.dumps(value, allow_nan=False)
        except ValueError:  # NaN or ±Infinity somewhere inside: not JSON, PostgreSQL refuses
            raise ValueError(
                f"fx.result of {self.key} must be strict JSON: NaN and Infinity are not JSON "
                "numbers (PostgreSQL would fail the whole transaction); store None or a "
                "string instead"
            ) from None
        except TypeError as exc:
            raise TypeError(f"fx.result must be JSON-serializable: {exc}") from None
        self._result = value
        self._result_set = True

    @property
    def pending_result(self) -> Any:
        """What to store with the row when the block exits cleanly: the result this first
        run set, or None (nothing to store)."""
        if self.first and self._result_set:
            return self._result
        return None

    def __repr__(self) -> str:
        return f"Effects(key={self.key!r}, first={self.first}, task_id={self.task_id!r})"


def identity(key: str | None, call: str) -> tuple[str, running.Running | None]:
    """The key to record (``key``, else the running task's) and the running task, if any.

    Raises:
        ConfigurationError: no ``key`` and no gated task running in this context; ``call``
            names the function in the message (``effects(conn)``, ``effects()``).
    """
    now_running = running.current()
    if key is None:
        if now_running is None:
            raise ConfigurationError(
                f"{call} outside a gated Celery/RQ task needs key=...: no task is "
                "running in this context to take the identity from"
            )
        key = now_running.key
    return key, now_running


def lifetime(ttl: float | timedelta | None) -> float:
    """Seconds the row counts: ``ttl`` checked, or :data:`DEFAULT_TTL`."""
    return DEFAULT_TTL if ttl is None else duration_seconds("effects(ttl=...)", ttl)


def warn_if_short(now_running: running.Running | None, seconds: float) -> None:
    """Warn once per task when its rows expire before its broker may redeliver it."""
    if now_running is None or now_running.redelivery is None:
        return
    if seconds >= now_running.redelivery or now_running.task in _WARNED:
        return
    _WARNED.add(now_running.task)
    logger.warning(
        "taskdedup: effects() rows of %s live %.0fs (ttl), less than the %.0fs its broker may "
        "take to redeliver its message (visibility_timeout + lease): a redelivery after the "
        "row expired would do the work again; give effects(ttl=...) at least %.0f, or leave "
        "the default (%.0fs)", now_running.task, seconds, now_running.redelivery,
        now_running.redelivery, DEFAULT_TTL,
    )
